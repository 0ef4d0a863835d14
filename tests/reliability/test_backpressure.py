"""Overload: when the writer cannot keep up, new requests are refused at once (retryable), never queued
without bound, and every request that is eventually acknowledged is stored exactly once.

The writer is held up deterministically (another connection holds an exclusive
lock on the SQLite file), so the test needs no timing: the queue state is
observed, not guessed.
"""
from __future__ import annotations

import sqlite3
import threading

import grpc
from harness.reliability.fuzz_cases import TRACES, OtlpClient

from harness import wait_until
from harness.stored_rows import count_rows, stored_step_keys
from harness.reliability import reliability_helpers as h
from traceml.processor.service import ProcessorConfig, ProcessorService

RUN = "overload"
ACKNOWLEDGED = (grpc.StatusCode.OK, 200)  # gRPC OK, HTTP 200


def retry_until_acknowledged(call, statuses: list | None = None):
    """A patient OTLP client: repeats `call()` (one export) while it is refused, until acknowledged.

    Every answer's status is appended to `statuses` when given."""
    while True:
        answer = call()
        if statuses is not None:
            statuses.append(answer.status)
        if answer.status in ACKNOWLEDGED:
            return answer


def test_a_stalled_writer_refuses_new_work_at_once_and_nothing_acknowledged_is_lost(tmp_path):
    config = ProcessorConfig(db=tmp_path / "traceml.db", otlp_grpc=("127.0.0.1", 0), otlp_http=("127.0.0.1", 0),
                             refresh_interval_s=0.5, max_pending_records=100)
    service = ProcessorService(config).start()
    client = OtlpClient(service.grpc_port, service.http_port)
    requests = {name: h.steps_request(RUN, rank, range(1, n + 1))
                for name, rank, n in (("a", 0, 50), ("b", 1, 50), ("c", 2, 60), ("d", 3, 60))}
    answers: dict = {}
    client_for = {name: OtlpClient(service.grpc_port, service.http_port) for name in "ab"}

    def send(name: str) -> None:
        retry_until_acknowledged(lambda: client_for[name].grpc(TRACES, requests[name]),
                                 answers.setdefault(name, []))

    lock = sqlite3.connect(config.db, timeout=30, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")  # the writer now waits on the database
        first = threading.Thread(target=send, args=("a",))
        first.start()
        assert wait_until(lambda: service.ingest.in_flight_records == 50, 30)  # the writer holds a
        second = threading.Thread(target=send, args=("b",))
        second.start()
        assert wait_until(lambda: service.ingest.pending_records() == 50, 30)  # b waits in the queue
        # The queue is at 50 of 100: 60 more records are refused at once, over both transports.
        refused_grpc = client.grpc(TRACES, requests["c"])
        refused_http = client.http(TRACES, requests["d"])
        assert refused_grpc.status == grpc.StatusCode.UNAVAILABLE, refused_grpc
        assert refused_http.status == 429, refused_http
        assert service.ingest.pending_records() == 50  # nothing of c or d was queued
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    try:
        first.join(120)
        second.join(120)
        assert not first.is_alive() and not second.is_alive()
        # The refused clients retry, each over the transport it was refused on, now that the writer is free.
        for name, export in (("c", client.grpc), ("d", client.http)):
            retry_until_acknowledged(lambda: export(TRACES, requests[name]))
        stored = stored_step_keys(config.db, RUN)
        want = {(RUN, rank, s) for rank, n in ((0, 50), (1, 50), (2, 60), (3, 60)) for s in range(1, n + 1)}
        assert stored == want
        assert count_rows(config.db) == len(want)  # retries added nothing
        print(f"\nanswers while the writer was held: {answers}")
    finally:
        for c in (client, *client_for.values()):
            c.close()
        service.stop()
