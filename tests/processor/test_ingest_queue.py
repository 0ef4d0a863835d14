"""The ingest queue commits a lone small batch on the submitting thread (issue 37): handing it to
the writer thread and back would cost two thread wake-ups, about the commit's own CPU. While a
commit runs, later batches wait for the writer, which merges them into one commit in order."""
from __future__ import annotations

import threading
import time

from traceml.processor.ingest import IngestQueue
from traceml.processor.sqlite_writer import WriteResult
from traceml.processor.step_time.model import RankIdentity, RawEventValue, StepTimeIngestRecord
from traceml.processor.store_records import DecodedBatch
from traceml.schema import vocabulary as v


class _Store:
    """Records each write's thread and steps; the first write can be held until released."""

    def __init__(self, hold_first: bool = False) -> None:
        self.writes: list[tuple[str, list[int]]] = []
        self.release = threading.Event()
        self.entered = threading.Event()
        self.hold_first = hold_first

    def write(self, steps, memory=(), resources=()):
        self.entered.set()
        if self.hold_first and not self.writes:
            self.release.wait(10)
        self.writes.append((threading.current_thread().name, [r.step for r in steps]))
        return WriteResult(accepted=len(steps), duplicates=0)


def _batch(*steps: int) -> DecodedBatch:
    events = {v.RAW_STEP_TIME: RawEventValue(9.0, None, 1)}
    return DecodedBatch(v.SIGNAL_TRACES, step_records=[
        StepTimeIngestRecord("q", RankIdentity(0, world_size=1), s, float(s), s + 0.5, events, "ddp") for s in steps])


def test_a_lone_batch_is_committed_on_the_submitting_thread():
    store = _Store()
    queue = IngestQueue(store)
    queue.start()
    try:
        for step in range(3):
            assert queue.submit(_batch(step)).accepted == 1
    finally:
        queue.stop()
    me = threading.current_thread().name
    assert store.writes == [(me, [0]), (me, [1]), (me, [2])] and queue.commits == 3


def test_batches_arriving_during_a_commit_wait_for_the_writer_which_merges_them_in_order():
    store = _Store(hold_first=True)
    seen: list = []
    queue = IngestQueue(store, on_committed=lambda batches: seen.append([r.step for b in batches
                                                                          for r in b.step_records]))
    queue.start()
    threads = []
    try:
        first = threading.Thread(target=queue.submit, args=(_batch(0),), name="sender-0")
        first.start()
        assert store.entered.wait(10) and queue.in_flight_records == 1
        for step in (1, 2):
            t = threading.Thread(target=queue.submit, args=(_batch(step),), name=f"sender-{step}")
            t.start()
            threads.append(t)
            deadline = time.monotonic() + 10
            while queue.pending_records() < step and time.monotonic() < deadline:
                time.sleep(0.005)
        assert queue.pending_records() == 2
        store.release.set()
        first.join(10)
        for t in threads:
            t.join(10)
    finally:
        queue.stop()
    assert store.writes == [("sender-0", [0]), ("traceml-ingest-writer", [1, 2])]
    assert seen == [[0], [1, 2]] and queue.pending_records() == 0
