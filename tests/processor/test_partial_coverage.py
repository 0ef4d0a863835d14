"""A run first seen part-way is flagged, not silently short (issue 17, item 4).

The processor here receives a run whose stored steps begin at 500, as it would
after starting later than the job or after the Collector's load-balancing
exporter moved the run to this replica: its final summary, card and live
metric say "covered from step 500"; a run received from its first step says
nothing of the kind.
"""
from __future__ import annotations

import json

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from harness import wait_until
from harness.otlp_payloads import run_end_span, steps_request, trace_request
from tests.processor.test_runs import scrape, summary_written


def _send_run(port: int, run_id: str, steps: range) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        traces = trace_service_pb2_grpc.TraceServiceStub(channel)
        for rank in (0, 1):
            traces.Export(steps_request(run_id, rank, steps), timeout=10)
        for rank in (0, 1):  # each rank completed every step from 0, as its end marker says
            traces.Export(trace_request(run_id, rank, [run_end_span(rank, steps.stop)]), timeout=10)


def _summary(service, run_id: str) -> dict:
    return json.loads((service.config.summary_dir / run_id / "final_summary.json").read_text())


def test_a_run_first_seen_at_step_500_says_so_in_summary_card_and_metrics(service):
    _send_run(service.grpc_port, "late-run", range(500, 530))
    assert wait_until(lambda: summary_written(service, "late-run"), 30)
    summary = _summary(service, "late-run")
    assert summary["telemetry"]["first_step_stored"] == 500
    assert summary["telemetry"]["started_part_way"] is True
    assert summary["global"]["window"]["first_step"] == 500
    assert "Coverage: from step 500 only" in summary["card"]
    assert summary["telemetry"]["steps_missing"] == {"0": 500, "1": 500}  # the steps before coverage
    assert 'traceml_run_first_step{traceml_run_id="late-run"} 500' in scrape(service.prometheus_port)


def test_a_run_received_from_its_first_step_is_not_flagged(service):
    _send_run(service.grpc_port, "whole-run", range(0, 30))
    assert wait_until(lambda: summary_written(service, "whole-run"), 30)
    summary = _summary(service, "whole-run")
    assert summary["telemetry"]["first_step_stored"] == 0
    assert summary["telemetry"]["started_part_way"] is False
    assert "Coverage:" not in summary["card"]
    assert 'traceml_run_first_step{traceml_run_id="whole-run"} 0' in scrape(service.prometheus_port)
