"""Back-pressure that OTLP clients we did not write retry: at twice the processor's concurrent-call
limit, the official OpenTelemetry Python gRPC exporter loses nothing.

The processor (the service with its real gRPC server on loopback and a real SQLite
file) admits LIMIT calls at once. Its writer is held up deterministically (another
connection holds an exclusive lock on the SQLite file), so 2 x LIMIT concurrent
exports find LIMIT calls admitted and the rest refused (UNAVAILABLE with RetryInfo),
observed on the receiver's own counts rather than guessed; then the lock goes and
each refused client retries by its own policy.
"""
from __future__ import annotations

import sqlite3
import threading

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from tests.harness import wait_until
from tests.harness.processor_service import make_service
from tests.harness.stored_rows import count_rows
from tests.processor.otlp_payloads import steps_request

LIMIT = 2
SENDERS = 2 * LIMIT
STEPS = 50


def _value(any_value):
    return getattr(any_value, any_value.WhichOneof("value"))


def step_spans(run_id: str, rank: int) -> list[ReadableSpan]:
    """One rank's TraceML step spans as SDK spans: the same resource, scope and attributes the
    receiver tests send as raw OTLP (`otlp_payloads.steps_request`)."""
    [resource_spans] = steps_request(run_id, rank, range(STEPS), world_size=SENDERS).resource_spans
    resource = Resource({kv.key: _value(kv.value) for kv in resource_spans.resource.attributes})
    [scope_spans] = resource_spans.scope_spans
    scope = InstrumentationScope(scope_spans.scope.name)
    return [ReadableSpan(
        name=span.name, resource=resource, instrumentation_scope=scope, kind=SpanKind.INTERNAL,
        context=SpanContext(int.from_bytes(span.trace_id, "big"), int.from_bytes(span.span_id, "big"),
                            is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED)),
        attributes={kv.key: _value(kv.value) for kv in span.attributes},
        start_time=span.start_time_unix_nano, end_time=span.end_time_unix_nano,
    ) for span in scope_spans.spans]


def _concurrent_exports(port: int, run_id: str) -> tuple[list[threading.Thread], dict]:
    """SENDERS official exporters, one rank each, exporting at once; their results by rank."""
    results: dict[int, SpanExportResult] = {}

    def send(rank: int) -> None:
        exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=30)
        try:
            results[rank] = exporter.export(step_spans(run_id, rank))
        finally:
            exporter.shutdown()

    threads = [threading.Thread(target=send, args=(rank,)) for rank in range(SENDERS)]
    for thread in threads:
        thread.start()
    return threads, results


@pytest.fixture
def stalled(tmp_path):
    """A processor admitting LIMIT calls, and the lock that holds its writer until released."""
    service = make_service(tmp_path, max_concurrent_requests=LIMIT, prometheus=None)
    lock = sqlite3.connect(service.config.db, timeout=30, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        yield service, lock
    finally:
        if lock.in_transaction:
            lock.execute("ROLLBACK")
        lock.close()
        service.stop()


def _wait_for_refusals(service) -> None:
    """LIMIT calls admitted (held by the writer), every other sender refused at least once."""
    pool = service.grpc.pool
    assert wait_until(lambda: pool.admitted == LIMIT and pool.refused >= SENDERS - LIMIT, 30), \
        (pool.admitted, pool.refused)


@pytest.mark.slow
def test_official_grpc_exporter_at_twice_the_limit_loses_nothing(stalled):
    service, lock = stalled
    run_id = "peers-sdk"
    threads, results = _concurrent_exports(service.grpc_port, run_id)
    _wait_for_refusals(service)
    lock.execute("ROLLBACK")
    for thread in threads:
        thread.join(60)
    assert results == {rank: SpanExportResult.SUCCESS for rank in range(SENDERS)}
    assert count_rows(service.config.db, run_id=run_id) == SENDERS * STEPS
    print(f"\nofficial exporter: {SENDERS} x {STEPS} spans sent at limit {LIMIT}, "
          f"{service.grpc.pool.refused} calls refused and retried, "
          f"{count_rows(service.config.db, run_id=run_id)} stored")

