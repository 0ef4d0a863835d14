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

import pytest
from opentelemetry.sdk.trace.export import SpanExportResult

from harness import wait_until
from harness.processor_service import make_service
from harness.sdk_senders import concurrent_exports
from harness.stored_rows import count_rows

LIMIT = 2
SENDERS = 2 * LIMIT
STEPS = 50


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
    threads, results = concurrent_exports(f"127.0.0.1:{service.grpc_port}", run_id, senders=SENDERS, steps=STEPS)
    _wait_for_refusals(service)
    lock.execute("ROLLBACK")
    for thread in threads:
        thread.join(60)
    assert results == {rank: SpanExportResult.SUCCESS for rank in range(SENDERS)}
    assert count_rows(service.config.db, run_id=run_id) == SENDERS * STEPS
    print(f"\nofficial exporter: {SENDERS} x {STEPS} spans sent at limit {LIMIT}, "
          f"{service.grpc.pool.refused} calls refused and retried, "
          f"{count_rows(service.config.db, run_id=run_id)} stored")

