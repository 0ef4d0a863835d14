"""A dead, stalling or erroring endpoint never blocks or crashes training; losses are counted.

Retries follow the OTLP specification and the Collector's exporter: back-pressure is
retried no sooner than the server asked (gRPC `RetryInfo`, HTTP `Retry-After`) and
within the export deadline; gRPC RESOURCE_EXHAUSTED is retried only with a RetryInfo.

Step times with and without the exporter are printed (run with -s), never asserted:
the only time bounds are generous "did not hang" limits.
"""
from __future__ import annotations

import email.utils
import socket
import statistics
import threading
import time

import pytest
from harness.exporter_records import identity, memory_record, step_record
from harness.otlp_receiver import OtlpTestReceiver

import traceml
from traceml.exporter import OtlpStepExporter, resolve_settings
from traceml.exporter.transport import make_transport, retry_after_s
from traceml.schema import vocabulary as v

HANG_BOUND_S = 60.0  # "did not hang", not a performance claim


def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens here any more


def _settings(endpoint, protocol, **env):
    base = {"OTEL_EXPORTER_OTLP_TIMEOUT": "1000", "TRACEML_EXPORT_QUEUE_SIZE": "32"}
    base.update(env)
    settings = resolve_settings(endpoint, protocol, environ=base)
    from dataclasses import replace
    return replace(settings, export_interval_s=0.05)


# --- the sink itself: calls return at once, overflow is counted ----------------------------

@pytest.mark.parametrize("scenario", ["dead", "stall", "error"])
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
@pytest.mark.slow
def test_sink_calls_never_block_and_losses_are_counted(scenario, protocol):
    with OtlpTestReceiver(mode="ok" if scenario == "dead" else scenario, stall_s=30.0) as receiver:
        endpoint = _dead_endpoint() if scenario == "dead" else (
            receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint)
        exporter = OtlpStepExporter(identity(f"fail-{scenario}"), _settings(endpoint, protocol),
                                    instrumentation_drops=lambda: {})
        n = 400
        worst = 0.0
        began = time.monotonic()
        for step in range(n):
            t0 = time.perf_counter()
            exporter.on_step_time(step_record(step))
            exporter.on_step_memory(memory_record(step))
            worst = max(worst, time.perf_counter() - t0)
        fed = time.monotonic() - began
        t0 = time.monotonic()
        exporter.shutdown(2.0)
        shutdown_s = time.monotonic() - t0
        receiver.release_stalls()
        stats = exporter.stats()
        print(f"\n[{scenario}/{protocol}] fed {n} steps in {fed * 1e3:.1f} ms, worst sink call "
              f"{worst * 1e6:.0f} us, shutdown {shutdown_s:.2f} s, stats {stats}")
        assert fed < HANG_BOUND_S and shutdown_s < HANG_BOUND_S
        # Every step is accounted for: exported, dropped at our queue, or counted as failed.
        assert stats.dropped["spans"] > 0
        assert stats.steps_exported == 0
        assert stats.dropped["spans"] + stats.failures["traces"] >= n
        assert stats.failures["traces"] > 0 and stats.failures["metrics"] > 0
        assert not exporter.run_end_sent
        if scenario in ("dead", "error"):
            assert stats.retries["traces"] + stats.retries["metrics"] > 0


def test_permanent_rejection_is_a_failure_without_retries(fresh_receiver):
    fresh_receiver.mode = "reject"
    exporter = OtlpStepExporter(identity("reject"), _settings(fresh_receiver.http_endpoint, "http/protobuf"),
                                instrumentation_drops=lambda: {})
    exporter.on_step_time(step_record(0))
    exporter.shutdown(5.0)
    stats = exporter.stats()
    assert stats.retries == {"traces": 0, "metrics": 0}
    assert stats.failures["traces"] == 2  # the step, then the run-end marker (counted in steps, not spans)


@pytest.mark.slow
def test_export_resumes_after_the_endpoint_recovers(fresh_receiver):
    fresh_receiver.mode = "error"
    exporter = OtlpStepExporter(identity("recover"), _settings(fresh_receiver.grpc_endpoint, "grpc"),
                                instrumentation_drops=lambda: {})
    exporter.on_step_time(step_record(0))
    assert fresh_receiver.wait_for(lambda: exporter.stats().failures["traces"] > 0, HANG_BOUND_S)
    fresh_receiver.mode = "ok"
    exporter.on_step_time(step_record(1))
    assert exporter.shutdown(10.0)
    assert ("recover", 0, 1) in fresh_receiver.step_spans()
    assert exporter.run_end_sent
    (end,) = [r for k, r in fresh_receiver.step_spans(v.SPAN_RUN_END).items() if k[0] == "recover"]
    assert end["attributes"][v.ATTR_RUN_END_EXPORT_FAILURES] == exporter.stats().failures["traces"] > 0


@pytest.mark.slow
def test_export_resumes_when_a_dead_grpc_endpoint_comes_up():
    endpoint = _dead_endpoint()
    port = int(endpoint.rsplit(":", 1)[1])
    exporter = OtlpStepExporter(identity("late-collector"), _settings(endpoint, "grpc"),
                                instrumentation_drops=lambda: {})
    exporter.on_step_time(step_record(0))
    deadline = time.monotonic() + HANG_BOUND_S
    while exporter.stats().failures["traces"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exporter.stats().failures["traces"] == 1  # nothing listened: the step was lost, and counted
    with OtlpTestReceiver(grpc_port=port) as receiver:  # the collector starts late on the same port
        step = 1
        while ("late-collector", 0, step - 1) not in receiver.step_spans() and time.monotonic() < deadline:
            exporter.on_step_time(step_record(step))
            step += 1
            time.sleep(0.2)
        assert exporter.shutdown(10.0)
        assert exporter.run_end_sent
    print(f"\nrecovered after {step - 1} steps of the late collector")


# --- retries: what the server asks for, within the deadline ------------------------------

def _export_once(receiver, protocol, timeout_ms=5000):
    """One traces request through the real transport: (outcome, seconds between the server's calls)."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    settings = resolve_settings(endpoint, protocol, environ={"OTEL_EXPORTER_OTLP_TIMEOUT": str(timeout_ms)})
    transport = make_transport(settings, threading.Event())
    try:
        outcome = transport.export(v.SIGNAL_TRACES, trace_service_pb2.ExportTraceServiceRequest(),
                                   time.monotonic() + timeout_ms / 1000.0)
    finally:
        transport.close()
    times = receiver.call_times
    return outcome, [b - a for a, b in zip(times, times[1:])]


def test_grpc_resource_exhausted_without_retry_info_is_not_retried(fresh_receiver):
    fresh_receiver.mode = "exhausted"
    outcome, _ = _export_once(fresh_receiver, "grpc")
    assert (outcome.delivered, outcome.retries, len(fresh_receiver.call_times)) == (False, 0, 1)
    assert "RESOURCE_EXHAUSTED" in outcome.error


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exhausted", "throttle"])
def test_grpc_retry_info_is_retried_no_sooner_than_its_delay(fresh_receiver, mode):
    fresh_receiver.mode, fresh_receiver.retry_delay_s, fresh_receiver.failures_left = mode, 1.0, 1
    outcome, gaps = _export_once(fresh_receiver, "grpc")
    assert (outcome.delivered, outcome.retries) == (True, 1)
    assert gaps[0] >= 0.95  # the backoff alone would have waited at most 0.3 s


def test_a_retry_delay_beyond_the_deadline_gives_up_at_once(fresh_receiver):
    fresh_receiver.mode, fresh_receiver.retry_delay_s = "throttle", 30.0
    began = time.monotonic()
    outcome, _ = _export_once(fresh_receiver, "grpc", timeout_ms=3000)
    assert (outcome.delivered, outcome.retries, len(fresh_receiver.call_times)) == (False, 0, 1)
    assert time.monotonic() - began < 2.5  # it did not sleep into the deadline


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exhausted", "throttle"])  # HTTP 429, 503
def test_http_retry_after_seconds_is_honoured(fresh_receiver, mode):
    fresh_receiver.mode, fresh_receiver.retry_delay_s, fresh_receiver.failures_left = mode, 1.0, 1
    outcome, gaps = _export_once(fresh_receiver, "http/protobuf")
    assert (outcome.delivered, outcome.retries) == (True, 1)
    assert gaps[0] >= 0.95


@pytest.mark.slow
def test_http_retry_after_as_an_http_date_is_honoured(fresh_receiver):
    fresh_receiver.mode, fresh_receiver.failures_left = "throttle", 1
    fresh_receiver.retry_after = email.utils.formatdate(time.time() + 2.0, usegmt=True)
    outcome, gaps = _export_once(fresh_receiver, "http/protobuf")
    assert (outcome.delivered, outcome.retries) == (True, 1)
    assert gaps[0] >= 0.9  # an HTTP date has whole seconds: between 1 and 2 s from the answer


def test_retry_after_values():
    assert retry_after_s("3") == 3.0
    assert retry_after_s(email.utils.formatdate(1_000_010.0, usegmt=True), now=1_000_000.0) == 10.0
    assert retry_after_s(email.utils.formatdate(999_990.0, usegmt=True), now=1_000_000.0) == 0.0
    assert [retry_after_s(x) for x in (None, "", "-1", "soon", "1.5")] == [None] * 5


# --- a real training loop with the real instrumentation ----------------------------------

def _loop(steps: int, traced: bool) -> list[float]:
    import torch
    from harness.tiny_training import plain_step, traced_step
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(16, 64), torch.randn(16, 1)) for _ in range(8)]
    step = traced_step if traced else plain_step
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        x, y = data[i % len(data)]
        step(model, opt, x, y)
        times.append(time.perf_counter() - t0)
    return times


@pytest.mark.parametrize("scenario,protocol", [("dead", "grpc"), ("stall", "grpc"), ("error", "http/protobuf"),
                                               ("stall", "http/protobuf")])
@pytest.mark.slow
def test_real_training_loop_is_never_blocked_by_a_bad_endpoint(scenario, protocol, monkeypatch):
    steps = 300
    with OtlpTestReceiver(mode=scenario if scenario != "dead" else "ok", stall_s=30.0) as receiver:
        endpoint = _dead_endpoint() if scenario == "dead" else (
            receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1000")
        monkeypatch.setenv("TRACEML_EXPORT_QUEUE_SIZE", "64")
        baseline = _loop(steps, traced=False)
        traceml.init("manual", endpoint=endpoint, protocol=protocol, run_id=f"loop-{scenario}")
        sink = traceml._exporter_sink
        assert isinstance(sink, OtlpStepExporter)
        began = time.monotonic()
        traced = _loop(steps, traced=True)
        loop_s = time.monotonic() - began
        t0 = time.monotonic()
        traceml.shutdown(timeout_s=2.0)
        shutdown_s = time.monotonic() - t0
        receiver.release_stalls()
        stats = sink.stats()
    print(f"\n[{scenario}/{protocol}] median step: uninstrumented {statistics.median(baseline) * 1e6:.0f} us, "
          f"traced+exporting {statistics.median(traced) * 1e6:.0f} us (max {max(traced) * 1e3:.1f} ms); "
          f"loop {loop_s:.2f} s; "
          f"shutdown {shutdown_s:.2f} s; {stats}")
    assert len(traced) == steps and shutdown_s < HANG_BOUND_S
    assert stats.steps_received + stats.dropped["spans"] == steps
    assert stats.steps_exported == 0
    assert stats.dropped["spans"] + stats.failures["traces"] >= steps
