"""`traceml run` leaves the job's own OpenTelemetry alone (issue 31 item 3).

The job (`scripts/own_otel_job.py`) exports its own traces, metrics and logs with the
official SDK, configured from the standard `OTEL_EXPORTER_OTLP_*` variables, to an
agent of its own (a real OTLP receiver). Under `traceml run` with the embedded
processor the agent gets every span, metric point and log record of both ranks, over
the protocol the job chose, and the processor gets every step of ours. Before, the
launcher set `OTEL_EXPORTER_OTLP_ENDPOINT` / `_PROTOCOL` for the ranks, and the job's
telemetry went to the processor, which dropped it (logs: UNIMPLEMENTED).
"""
from __future__ import annotations

import pytest

from harness.otlp_receiver import OtlpTestReceiver
from harness.stored_rows import steps_per_rank
from tests.launcher.launcher_helpers import SCRIPTS, traceml

pytestmark = pytest.mark.slow

STEPS = 8


def _resource_rank(resource) -> int:
    (rank,) = [a.value.int_value for a in resource.attributes if a.key == "job.rank"]
    return rank


def test_the_jobs_own_traces_metrics_and_logs_reach_its_agent_and_ours_reach_the_processor(workdir):
    with OtlpTestReceiver() as agent:
        run = traceml(["run", "--nproc-per-node", "2", "--no-summary-print", str(SCRIPTS / "own_otel_job.py"),
                       "--agent", agent.http_endpoint, "--steps", str(STEPS)], workdir)
        assert run.returncode == 0, run.output[-3000:]
        for rank in (0, 1):
            assert f"rank {rank}: {STEPS} steps, own OTel exported to {agent.http_endpoint} over http/protobuf" \
                in run.output
        spans = {(_resource_rank(rs.resource), span.name) for request in agent.trace_requests
                 for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans}
        points = {(_resource_rank(rm.resource), metric.name, point.as_int)
                  for request in agent.metric_requests for rm in request.resource_metrics
                  for sm in rm.scope_metrics for metric in sm.metrics for point in metric.sum.data_points}
        logs = sorted((_resource_rank(rl.resource), record.body.string_value)
                      for request in agent.log_requests for rl in request.resource_logs
                      for sl in rl.scope_logs for record in sl.log_records)
        calls = dict(agent.calls)
    assert spans == {(0, "job.train"), (1, "job.train")}
    assert points == {(0, "job.batches", STEPS), (1, "job.batches", STEPS)}
    assert logs == sorted((rank, f"job step {step} done") for rank in (0, 1) for step in range(STEPS))
    assert calls["grpc"] == 0  # the job's protocol, not the processor's
    # Every step of ours reached the embedded processor, and nothing of the job's did.
    assert steps_per_rank(run.run_dir / "traceml.sqlite") == {0: STEPS, 1: STEPS}
    processor_log = (run.run_dir / "processor.log").read_text()
    assert "job.train" not in processor_log and "UNIMPLEMENTED" not in processor_log
