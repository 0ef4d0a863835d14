"""Run lifecycle: live refresh, summary metrics on /metrics, run end by markers and by idle timeout."""
from __future__ import annotations

import pytest

import json
import subprocess
import urllib.request

import grpc
from harness.processor_service import make_service
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from harness.otlp_payloads import memory_request, run_end_span, steps_request, trace_request

from harness import wait_until
from traceml.processor.security import sanitize_run_id
from traceml.schema import vocabulary as v

# The contract's ddp_rank_straggler scenario: rank 0 waits on input, rank 1 waits in backward.
STRAGGLER = {
    0: {v.RAW_DATALOADER_NEXT: 100.0, v.RAW_FORWARD: 20.0, v.RAW_BACKWARD: 20.0, v.RAW_STEP_TIME: 40.0},
    1: {v.RAW_DATALOADER_NEXT: 0.0, v.RAW_FORWARD: 20.0, v.RAW_BACKWARD: 120.0, v.RAW_STEP_TIME: 140.0},
}


def send_straggler_run(port: int, run_id: str, steps: int = 24, *, end_markers=(0, 1)):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        traces = trace_service_pb2_grpc.TraceServiceStub(channel)
        metrics = metrics_service_pb2_grpc.MetricsServiceStub(channel)
        for rank, events in STRAGGLER.items():
            traces.Export(steps_request(run_id, rank, range(steps), events), timeout=10)
            metrics.Export(memory_request(run_id, rank, range(steps), allocated=(rank + 1) << 20,
                                          drops={"timing": rank}), timeout=10)
        for rank in end_markers:
            traces.Export(trace_request(run_id, rank, [run_end_span(rank, steps)]), timeout=10)


def summary_written(service, run_id: str) -> bool:
    state = service.monitor.state(run_id)
    return state is not None and len(state.summary_files) == 2


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return response.read().decode()


def test_run_ended_by_every_rank_marker_writes_summary_and_card(service):
    send_straggler_run(service.grpc_port, "run-end")
    folder = service.config.summary_dir / "run-end"
    assert wait_until(lambda: summary_written(service, "run-end"), 30)
    assert service.monitor.state("run-end").ended == "markers"
    summary = json.loads((folder / "final_summary.json").read_text())
    assert summary["metadata"]["run_id"] == "run-end"
    assert summary["metadata"]["world_size"] == 2
    assert summary["diagnosis"]["kind"] == "INPUT_STRAGGLER"
    assert summary["diagnosis"]["severity"] == "crit"
    assert (folder / "summary_card.txt").read_text().strip()


@pytest.mark.slow
def test_run_without_markers_ends_after_idle_timeout(tmp_path):
    svc = make_service(tmp_path, idle_timeout_s=1.0, prometheus=None)
    try:
        send_straggler_run(svc.grpc_port, "run-idle", end_markers=())
        folder = svc.config.summary_dir / "run-idle"
        assert wait_until(lambda: summary_written(svc, "run-idle"), 30)
        assert svc.monitor.state("run-idle").ended == "idle"
        assert json.loads((folder / "final_summary.json").read_text())["metadata"]["run_id"] == "run-idle"
    finally:
        svc.stop()


def test_one_missing_end_marker_keeps_the_run_open(service):
    send_straggler_run(service.grpc_port, "run-half", end_markers=(1,))
    assert wait_until(lambda: (service.monitor.state("run-half") or None) is not None
                      and service.monitor.state("run-half").finished == {1}, 30)
    # A round after the marker arrived (a reader's, or the one the marker woke): it would have ended the run.
    assert service.monitor.refresh_for_reader(30)
    state = service.monitor.state("run-half")
    assert state.ended is None and state.finished == {1}
    send_straggler_run(service.grpc_port, "run-half", end_markers=(0,))
    assert wait_until(lambda: service.monitor.state("run-half").ended == "markers", 30)


def test_hostile_run_id_cannot_leave_the_summary_dir(service):
    run_id = "../../etc/evil run\n1"
    send_straggler_run(service.grpc_port, run_id, steps=4)
    folder = service.config.summary_dir / sanitize_run_id(run_id)
    assert wait_until(lambda: summary_written(service, run_id), 30)
    assert (folder / "final_summary.json").exists()
    assert folder.parent == service.config.summary_dir
    assert "/" not in folder.name and not folder.name.startswith(".")


def test_metrics_endpoint_exposes_diagnosis_per_rank_and_self_metrics(service, tmp_path):
    send_straggler_run(service.grpc_port, "run-prom", end_markers=())
    # prometheus_client writes labels in name order.
    expected = ('traceml_diagnosis_active_ratio{traceml_diagnosis_culprit_rank="0",traceml_diagnosis_kind="INPUT_STRAGGLER",'
                'traceml_diagnosis_severity="crit",traceml_diagnosis_status="confirmed",traceml_run_id="run-prom"} 0.714285714285')
    # Refreshes run while ranks still arrive; wait for the one that saw everything.
    assert wait_until(lambda: expected in scrape(service.prometheus_port), 30), scrape(service.prometheus_port)
    text = scrape(service.prometheus_port)
    assert 'traceml_rank_metric_seconds{traceml_metric="backward",traceml_rank="1",traceml_run_id="run-prom"} 0.12' in text
    assert 'traceml_rank_memory_peak_bytes{traceml_rank="1",traceml_run_id="run-prom"} ' in text
    assert 'traceml_rank_telemetry_dropped_total{traceml_queue="timing",traceml_rank="1",traceml_run_id="run-prom"} 1' in text
    assert 'traceml_processor_records_total{traceml_outcome="accepted",traceml_signal="traces"} 48' in text
    assert "traceml_step" not in text.replace("traceml_window_steps", "")
    assert "# HELP traceml_window_metric_seconds " in text
    # The exposition passes Prometheus' own linter (HELP present, names, types).
    page = tmp_path / "metrics.txt"
    page.write_text(text)
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_restart_watches_only_runs_that_were_still_open(tmp_path):
    first = make_service(tmp_path, prometheus=None, summary_dir=None)
    try:
        send_straggler_run(first.grpc_port, "finished-run")
        send_straggler_run(first.grpc_port, "open-run", end_markers=(0,))
    finally:
        first.stop()
    second = make_service(tmp_path, prometheus=None)
    try:
        assert second.monitor.run_ids() == ["open-run"]
        # The adopted run still ends: its missing rank's marker arrives after the restart.
        send_straggler_run(second.grpc_port, "open-run", end_markers=(1,))
        assert wait_until(lambda: summary_written(second, "open-run"), 30)
        assert second.monitor.state("open-run").ended == "markers"
    finally:
        second.stop()
