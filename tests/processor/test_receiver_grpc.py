"""OTLP/gRPC receiver over a real grpc server on loopback, into a real SQLite file."""
from __future__ import annotations

import sqlite3
import threading

import grpc
import pytest
from harness.processor_service import make_service
from harness.stored_rows import count_rows
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from harness.otlp_payloads import (foreign_request, memory_request, run_end_span, step_span, steps_request,
                           trace_request)

from traceml.processor.receiver_grpc import MAX_RECEIVE_BYTES
from traceml.processor.security import BearerAuth
from traceml.schema import vocabulary as v


def stubs(port: int):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)])
    return channel, trace_service_pb2_grpc.TraceServiceStub(channel), metrics_service_pb2_grpc.MetricsServiceStub(channel)


def test_spans_are_committed_before_the_answer(service):
    channel, traces, _ = stubs(service.grpc_port)
    with channel:
        for rank in (0, 1):
            response = traces.Export(steps_request("run-a", rank, range(5)), timeout=10)
            assert not response.HasField("partial_success")
        # No waiting: the answer came after the commit.
        assert count_rows(service.config.db, run_id="run-a") == 10
    conn = sqlite3.connect(service.config.db)
    forward = conn.execute("SELECT forward_cpu_ms, forward_count, training_strategy, world_size"
                           " FROM step_time_samples WHERE run_id='run-a' AND global_rank=1 AND step=3").fetchone()
    conn.close()
    assert forward == (30.0, 1, "ddp", 2)


def test_duplicate_delivery_adds_no_rows(service):
    request = steps_request("run-dup", 0, range(8))
    channel, traces, _ = stubs(service.grpc_port)
    with channel:
        traces.Export(request, timeout=10)
        traces.Export(request, timeout=10)  # a client retry of the same batch
        traces.Export(request, timeout=10)
    assert count_rows(service.config.db, run_id="run-dup") == 8
    assert service.stats.snapshot()[("duplicate", "traces")] == 16


def test_bad_spans_are_rejected_with_counted_reasons_and_good_ones_kept(service):
    good = [step_span(s, 0) for s in range(3)]
    bad = [
        step_span(10, 0, extra={v.legacy_event_attribute(v.RAW_FORWARD, "cpu_ms"): float("nan")}),
        step_span(11, 0, drop=[v.ATTR_STEP]),
        step_span(12, 0, extra={v.ATTR_STEP: "twelve"}),
        step_span(13, 0, extra={v.legacy_event_attribute(v.RAW_BACKWARD, "cpu_ms"): -40.0}),
        step_span(14, 0, extra={v.legacy_event_attribute(v.RAW_BACKWARD, "cpu_ms"): 1e12}),
        step_span(15, 0, extra={v.ATTR_STEP: -1}),
    ]
    channel, traces, _ = stubs(service.grpc_port)
    with channel:
        response = traces.Export(trace_request("run-bad", 0, good + bad), timeout=10)
    assert response.partial_success.rejected_spans == 6
    message = response.partial_success.error_message
    for reason in ("non_finite_value=1", "missing_step=1", "wrong_attribute_type=1", "negative_value=2",
                   "absurd_value=1"):
        assert reason in message, message
    assert count_rows(service.config.db, run_id="run-bad") == 3


def test_missing_run_or_rank_is_rejected(service):
    spans = [step_span(0, 0, drop=[v.ATTR_RANK])]
    channel, traces, _ = stubs(service.grpc_port)
    with channel:
        no_run = traces.Export(trace_request(None, 0, [step_span(0, 0)]), timeout=10)
        no_rank = traces.Export(trace_request("run-x", None, spans), timeout=10)
    assert no_run.partial_success.rejected_spans == 1
    assert "missing_run_id" in no_run.partial_success.error_message
    assert no_rank.partial_success.rejected_spans == 1
    assert "missing_rank" in no_rank.partial_success.error_message
    assert count_rows(service.config.db) == 0


def test_other_services_telemetry_is_ignored_and_counted_not_rejected(service):
    channel, traces, _ = stubs(service.grpc_port)
    with channel:
        response = traces.Export(foreign_request(4), timeout=10)
    assert response.partial_success.rejected_spans == 0
    assert "ignored 4" in response.partial_success.error_message
    assert service.stats.snapshot()[("ignored", "traces")] == 4
    assert count_rows(service.config.db) == 0


def test_nemo_megatron_resource_aliases_are_accepted(service):
    request = trace_request("nemo-run", 3, [step_span(0, 3, drop=[v.ATTR_RANK])], aliases=True, world_size=4)
    channel, traces, _ = stubs(service.grpc_port)
    with channel:
        response = traces.Export(request, timeout=10)
    assert not response.HasField("partial_success")
    conn = sqlite3.connect(service.config.db)
    row = conn.execute("SELECT run_id, global_rank, local_rank, world_size FROM step_time_samples").fetchone()
    conn.close()
    assert row == ("nemo-run", 3, 3, 4)


@pytest.mark.slow
def test_message_above_grpc_default_4_mib_is_received(service):
    # ~8,000 spans with all attributes: well above grpcio's 4 MiB default receive limit.
    request = steps_request("run-big", 0, range(8000))
    assert request.ByteSize() > 4 * 1024 * 1024
    channel, traces, _ = stubs(service.grpc_port)
    with channel:
        traces.Export(request, timeout=60)
    assert count_rows(service.config.db, run_id="run-big") == 8000


def test_memory_gauges_drop_counters_and_run_end_marker_are_stored(service):
    channel, traces, metrics = stubs(service.grpc_port)
    with channel:
        response = metrics.Export(memory_request("run-m", 1, range(3), drops={"timing": 2, "spans": 7}), timeout=10)
        assert not response.HasField("partial_success")
        traces.Export(trace_request("run-m", 1, [run_end_span(1, 3)]), timeout=10)
    conn = sqlite3.connect(service.config.db)
    mem = conn.execute("SELECT step, peak_allocated_bytes, peak_reserved_bytes, device FROM step_memory_samples"
                       " WHERE run_id='run-m' ORDER BY step").fetchall()
    drops = dict(conn.execute("SELECT queue, dropped FROM step_time_drops WHERE run_id='run-m'").fetchall())
    finished = conn.execute("SELECT final_counts FROM step_time_ranks WHERE run_id='run-m' AND global_rank=1"
                            " AND finished_time IS NOT NULL").fetchone()
    conn.close()
    assert mem == [(0, 1 << 30, 2 << 30, "cuda:0"), (1, (1 << 30) + 1, (2 << 30) + 1, "cuda:0"),
                   (2, (1 << 30) + 2, (2 << 30) + 2, "cuda:0")]
    assert drops == {"timing": 2, "spans": 7}
    assert finished is not None and '"traceml.steps.completed": 3' in finished[0]


def test_bearer_token_is_required_when_configured(tmp_path):
    svc = make_service(tmp_path, auth=BearerAuth("s3cret"), prometheus=None)
    try:
        channel, traces, _ = stubs(svc.grpc_port)
        with channel:
            with pytest.raises(grpc.RpcError) as err:
                traces.Export(steps_request("run-auth", 0, range(2)), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError):
                traces.Export(steps_request("run-auth", 0, range(2)), timeout=10,
                              metadata=[("authorization", "Bearer wrong")])
            traces.Export(steps_request("run-auth", 0, range(2)), timeout=10,
                          metadata=[("authorization", "Bearer s3cret")])
        assert count_rows(svc.config.db, run_id="run-auth") == 2
    finally:
        svc.stop()


@pytest.mark.slow
def test_unauthenticated_calls_are_refused_before_their_body_is_read(tmp_path):
    """A body over the receive limit is answered UNAUTHENTICATED, not RESOURCE_EXHAUSTED: never read."""
    svc = make_service(tmp_path, auth=BearerAuth("s3cret"), prometheus=None)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{svc.grpc_port}", options=[("grpc.max_send_message_length", -1)])
        export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
        oversized = b"\x0a" + b"\x00" * (MAX_RECEIVE_BYTES + (1 << 20))
        with channel:
            for metadata in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as err:
                    export(oversized, timeout=30, metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:  # with the token, the receive limit applies
                export(oversized, timeout=30, metadata=(("authorization", "Bearer s3cret"),))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert svc.stats.refusals() == {(v.REFUSED_UNAUTHENTICATED, v.SIGNAL_TRACES): 2}
        assert svc.grpc.pool.admitted == 0 and svc.grpc.pool.refused == 0  # no admission slot was taken
    finally:
        svc.stop()


def test_back_pressure_answers_unavailable_and_loses_nothing(tmp_path):
    svc = make_service(tmp_path, max_pending_records=10, prometheus=None)
    try:
        # Another process holds the SQLite write lock: the writer stalls on its busy timeout.
        blocker = sqlite3.connect(svc.config.db)
        blocker.execute("BEGIN EXCLUSIVE")
        channel, traces, _ = stubs(svc.grpc_port)
        results = {}

        def send(name, request):
            results[name] = traces.Export(request, timeout=30)

        first = threading.Thread(target=send, args=("first", steps_request("run-bp", 0, range(6))))
        first.start()
        assert _wait(lambda: svc.ingest.in_flight_records == 6)
        second = threading.Thread(target=send, args=("second", steps_request("run-bp", 1, range(6))))
        second.start()
        assert _wait(lambda: svc.ingest.pending_records() == 6)
        with pytest.raises(grpc.RpcError) as err:
            traces.Export(steps_request("run-bp", 0, range(6, 12)), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "back-pressure" in err.value.details()
        assert 0.4 <= _retry_advice(err.value) <= 1.6  # retryable by the Collector's rules too
        blocker.rollback()
        blocker.close()
        first.join(30)
        second.join(30)
        channel.close()
        assert set(results) == {"first", "second"}
        assert count_rows(svc.config.db, run_id="run-bp") == 12
    finally:
        svc.stop()


def _wait(predicate, timeout_s=10.0):
    from harness import wait_until

    return wait_until(predicate, timeout_s)


def _retry_advice(error: grpc.RpcError):
    """The RetryInfo of a refusal, from the standard status details and from the OTel Python SDK's trailer."""
    from google.rpc import error_details_pb2, status_pb2

    trailers = dict(error.trailing_metadata())
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    assert status.code == error.code().value[0] and status.message == error.details()
    [detail] = status.details
    info = error_details_pb2.RetryInfo()
    assert detail.Unpack(info)
    assert error_details_pb2.RetryInfo.FromString(trailers["google.rpc.retryinfo-bin"]) == info
    return info.retry_delay.ToTimedelta().total_seconds()


def test_calls_over_the_concurrent_limit_are_refused_at_once_with_retry_advice(tmp_path):
    svc = make_service(tmp_path, max_concurrent_requests=1, prometheus=None)
    blocker = sqlite3.connect(svc.config.db)
    try:
        blocker.execute("BEGIN EXCLUSIVE")  # the writer stalls: the first call stays admitted
        channel, traces, _ = stubs(svc.grpc_port)
        results = {}
        first = threading.Thread(target=lambda: results.setdefault(
            "first", traces.Export(steps_request("run-limit", 0, range(3)), timeout=30)))
        first.start()
        assert _wait(lambda: svc.ingest.in_flight_records == 3)
        assert svc.grpc.pool.admitted == 1
        with pytest.raises(grpc.RpcError) as err:
            traces.Export(steps_request("run-limit", 1, range(3)), timeout=10)
        # UNAVAILABLE (what OTLP names for back-pressure), never grpcio's RESOURCE_EXHAUSTED without RetryInfo.
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "over the limit of 1 concurrent calls" in err.value.details()
        assert 0.4 <= _retry_advice(err.value) <= 1.6
        assert svc.grpc.pool.refused == 1
        blocker.rollback()
        first.join(30)
        # A call's admission ends after its answer is sent: wait for the room the retry needs.
        assert _wait(lambda: svc.grpc.pool.admitted == 0)
        traces.Export(steps_request("run-limit", 1, range(3)), timeout=10)  # the retry, once there is room
        channel.close()
        assert "first" in results
        assert count_rows(svc.config.db, run_id="run-limit") == 6
        assert _wait(lambda: svc.grpc.pool.admitted == 0)
    finally:
        blocker.close()
        svc.stop()
