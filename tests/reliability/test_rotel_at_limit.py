"""Back-pressure through a non-Python OTLP peer: at twice the processor's concurrent-call
limit, senders pushing through a `rotel-agent` relay lose nothing.

Real processes only: `traceml-processor` (the CLI, `--max-concurrent-requests 2`, a real
SQLite file), `rotel-agent` relaying to it over OTLP/gRPC or OTLP/HTTP, and 2 x LIMIT
official OpenTelemetry SDK gRPC exporters sending into rotel at once. The processor's
writer is held up deterministically (this test holds an exclusive lock on its SQLite
file), so LIMIT calls are admitted and held and every further call is refused: gRPC
UNAVAILABLE with RetryInfo, HTTP 429 with Retry-After. rotel's own log shows each refusal
and the retry it scheduled; then the lock goes, rotel's retries land, and every span of
every sender is stored, with no drop line in rotel's log.

Why rotel runs with `--disable-batching`: rotel answers its senders on receipt and
batches what it relays, so with batching on the senders' exports leave rotel as one call
and the limit is never reached. A batch size small enough to split them does not work in
rotel 0.0.1a15 (the newest on PyPI): its batch splitter copies the resource from the new
batch instead of the one being split, so the spans leave rotel with no resource, and the
processor rightly rejects them as having no `traceml.run.id` (a partial success, which no
client retries). Fixed upstream in rotel-dev/rotel PR #187 ("clone resource on split in
BatchSplittable"). Without batching rotel forwards each export as its own call, at once.

rotel ignores RetryInfo and Retry-After and waits its own backoff; the test shortens that
to 1 s (`--otlp-exporter-retry-initial-backoff`) so it does not wait rotel's default 5 s.
"""
from __future__ import annotations

import sqlite3

import pytest
from opentelemetry.sdk.trace.export import SpanExportResult

from harness import ProcessorProcess, wait_until
from harness.rotel_relay import DROP_MARKERS, RETRY_LINE, RotelRelay, rotel_binary
from harness.sdk_senders import concurrent_exports
from harness.stored_rows import count_rows

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(rotel_binary() is None, reason="needs rotel-agent (pip install rotel)")]

LIMIT = 2
SENDERS = 2 * LIMIT
STEPS = 50
# How each protocol's refusal reads in rotel's retry line (its status, the processor's message).
REFUSAL = {"grpc": ("code: Unavailable", f"over the limit of {LIMIT} concurrent calls"),
           "http": ("Http(429", f"over the limit of {LIMIT} concurrent requests")}


@pytest.fixture
def processor(tmp_path):
    proc = ProcessorProcess(tmp_path / "processor", extra_args=["--max-concurrent-requests", str(LIMIT)])
    proc.start(wait_readyz=True)
    yield proc
    proc.stop()


def _send_all(endpoint: str, run_id: str) -> dict[int, SpanExportResult]:
    """SENDERS official exporters, one rank each, exporting to `endpoint` at once; their results."""
    threads, results = concurrent_exports(endpoint, run_id, senders=SENDERS, steps=STEPS)
    for thread in threads:
        thread.join(60)
    return results


def _refusals(relay: RotelRelay, protocol: str) -> list[str]:
    """rotel's retry lines for the processor's concurrency refusal."""
    return [line for line in relay.log_lines(RETRY_LINE) if all(n in line for n in REFUSAL[protocol])]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_senders_through_rotel_at_twice_the_limit_lose_nothing(processor, tmp_path, protocol):
    port = processor.grpc if protocol == "grpc" else processor.http
    run_id = f"rotel-{protocol}"
    relay = RotelRelay(tmp_path / "rotel", f"http://127.0.0.1:{port}", protocol,
                       ["--disable-batching", "--otlp-exporter-retry-initial-backoff", "1s",
                        "--otlp-exporter-request-timeout", "30s"])
    lock = sqlite3.connect(processor.db, timeout=30, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        with relay:
            # rotel acknowledges on receipt, so the senders all succeed at once; what it then
            # does with their spans is what this test is about.
            assert _send_all(relay.grpc_endpoint, run_id) == {r: SpanExportResult.SUCCESS for r in range(SENDERS)}
            assert wait_until(lambda: len(_refusals(relay, protocol)) >= SENDERS - LIMIT, 20), \
                relay.log_text()[-4000:]
            lock.execute("ROLLBACK")
            assert wait_until(lambda: count_rows(processor.db, run_id=run_id) >= SENDERS * STEPS, 60), \
                (count_rows(processor.db, run_id=run_id), relay.log_text()[-4000:])
        stored = count_rows(processor.db, run_id=run_id)
        assert stored == SENDERS * STEPS
        log = relay.log_text()
        assert not [line for line in log.splitlines() if any(m in line for m in DROP_MARKERS)], log[-4000:]
        print(f"\nrotel ({protocol}): {SENDERS} x {STEPS} spans at limit {LIMIT}, "
              f"{len(_refusals(relay, protocol))} refusals seen and retried by rotel "
              f"({len(relay.log_lines(RETRY_LINE))} retries in all), {stored} stored")
    finally:
        if lock.in_transaction:
            lock.execute("ROLLBACK")
        lock.close()
