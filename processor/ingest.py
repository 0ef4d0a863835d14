"""Bounded ingest: receivers submit decoded batches, one writer thread commits them.

A receiver thread calls `IngestQueue.submit(batch)`, which returns only after the
SQLite commit that holds the batch (acknowledge after commit), or raises
`Backpressure` at once when the pending work is over its bound (the receiver
answers UNAVAILABLE / 503 and the client retries later). The writer thread merges
whatever is pending into one `StepTimeStore.write` call, so commits grow with
load. Retried requests are harmless: the store ignores identical rows.

When nothing is pending and no commit is running (a rank's exporter sending a few
steps a second), the submitting thread commits its own batch: handing one small batch
to the writer thread and back costs two thread wake-ups, about as much CPU as the
commit itself. One commit runs at a time either way (`_busy`), in arrival order.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from traceml.processor import settings
from traceml.processor.store_records import IGNORED_UNKNOWN_HOST, DecodedBatch
from traceml.processor.self_telemetry import SelfTelemetry
from traceml.schema import vocabulary as v

LOG = logging.getLogger(__name__)


RETRY_AFTER_S = 1
"""How long a refused client is told to wait before it retries (HTTP `Retry-After`,
gRPC `RetryInfo`): about one commit of the writer, so the queue has drained by then."""

DEFAULT_MAX_CONCURRENT_REQUESTS = settings.MAX_CONCURRENT_REQUESTS.default
"""Export requests each receiver (gRPC, HTTP) admits at once; beyond it a request is
refused at once and told to retry after `RETRY_AFTER_S` (`--max-concurrent-requests`)."""


class Backpressure(Exception):
    """The ingest queue is full: the client should retry later."""


class IngestUnavailable(Exception):
    """The batch was not committed (store failure or shutdown): the client should retry."""


@dataclass(frozen=True)
class IngestOutcome:
    """What a committed batch did in the store.

    No refusal count: the store refuses nothing (validation lives in the decoder
    alone), so a request's refusals are its decoded batch's `rejected`.
    """

    accepted: int
    duplicates: int


@dataclass
class _Ticket:
    batch: DecodedBatch
    size: int
    done: threading.Event = field(default_factory=threading.Event)
    outcome: IngestOutcome | None = None
    error: BaseException | None = None


class IngestQueue:
    """Bounded queue of decoded batches in front of the single SQLite writer."""

    def __init__(
        self,
        store,
        *,
        max_pending_records: int = settings.MAX_PENDING_RECORDS,
        max_commit_records: int = 50_000,
        stats: SelfTelemetry | None = None,
        on_committed: Callable[[list[DecodedBatch]], None] | None = None,
        submit_timeout_s: float = 30.0,
    ):
        self._store = store
        self._max_pending = max_pending_records
        self._max_commit = max_commit_records
        self._stats = stats or SelfTelemetry()
        self._on_committed = on_committed
        self._submit_timeout = submit_timeout_s
        self._cond = threading.Condition()
        self._pending: deque[_Ticket] = deque()
        self._pending_records = 0
        self._stopping = False
        self._busy = False  # a commit is running (the writer's or a submitter's own)
        self.in_flight_records = 0  # records the writer is committing right now
        self._thread = threading.Thread(target=self._run, name="traceml-ingest-writer", daemon=True)
        self.commits = 0

    @property
    def stats(self) -> SelfTelemetry:
        return self._stats

    def start(self) -> None:
        self._thread.start()

    def pending_records(self) -> int:
        return self._pending_records

    def submit(self, batch: DecodedBatch) -> IngestOutcome:
        """Queue `batch` and wait until it is committed. Raises Backpressure / IngestUnavailable.

        Each refusal is counted here, where it is decided (the receivers only
        translate it into 429 / 503 / UNAVAILABLE).
        """
        size = batch.record_count
        if size == 0:
            return IngestOutcome(0, 0)
        ticket = _Ticket(batch, size)
        with self._cond:
            if self._stopping:
                raise self._unavailable(batch, "processor is shutting down")
            # One oversized batch is still admitted when nothing else waits, so it can progress.
            if self._pending and self._pending_records + size > self._max_pending:
                self._stats.refused(batch.signal, v.REFUSED_BACKPRESSURE)
                raise Backpressure(
                    f"ingest queue holds {self._pending_records} records (bound {self._max_pending})")
            inline = not self._pending and not self._busy
            if inline:  # nothing ahead of it: commit it on this thread (see the module docstring)
                self._busy = True
                self.in_flight_records = size
            else:
                self._pending.append(ticket)
                self._pending_records += size
                self._cond.notify()
        if inline:
            self._commit_taken([ticket])
        elif not ticket.done.wait(self._submit_timeout):
            # The writer still owns the ticket; the client retries, duplicates are harmless.
            raise self._unavailable(batch, "commit did not finish in time")
        if ticket.error is not None:
            raise self._unavailable(batch, f"commit failed: {ticket.error}")
        return ticket.outcome

    def _unavailable(self, batch: DecodedBatch, message: str) -> IngestUnavailable:
        self._stats.refused(batch.signal, v.REFUSED_UNAVAILABLE)
        return IngestUnavailable(message)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Commit what is pending, then stop the writer."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # --- writer thread -----------------------------------------------------------------

    def _take(self) -> list[_Ticket] | None:
        with self._cond:
            while self._busy or not self._pending:
                if self._stopping and not self._busy and not self._pending:
                    return None
                self._cond.wait()
            self._busy = True
            taken, total = [], 0
            while self._pending and (not taken or total + self._pending[0].size <= self._max_commit):
                ticket = self._pending.popleft()
                taken.append(ticket)
                total += ticket.size
            self._pending_records -= total
            self.in_flight_records = total
            return taken

    def _run(self) -> None:
        while True:
            tickets = self._take()
            if tickets is None:
                return
            self._commit_taken(tickets)

    def _commit_taken(self, tickets: list[_Ticket]) -> None:
        """Commit tickets taken under `_busy` (on the writer or the submitting thread), then free it."""
        try:
            self._commit(tickets)
        except BaseException as exc:  # never lose the thread: fail these tickets, go on
            LOG.exception("ingest commit failed for %d batch(es)", len(tickets))
            for ticket in tickets:
                ticket.error = exc
                ticket.done.set()
        finally:
            self.in_flight_records = 0
            with self._cond:
                self._busy = False
                if self._pending or self._stopping:
                    self._cond.notify_all()  # the writer takes what queued meanwhile, or stops

    def _commit(self, tickets: list[_Ticket]) -> None:
        steps, memory, resources = [], [], []
        for t in tickets:
            steps.extend(t.batch.step_records)
            memory.extend(t.batch.memory_records)
            resources.extend(t.batch.resource_records)
        result = self._store.write(steps, memory, resources)
        # Foreign resource samples the store left out (no stored rank on their host): the
        # decoder could not know, so they become the batch's ignored here, before the
        # intake counts and answers it.
        unjoined = [0] * len(tickets)
        if result.unjoined_resources:
            ends, end = [], 0
            for t in tickets:
                end += len(t.batch.resource_records)
                ends.append(end)
            k = 0
            for position in result.unjoined_resources:  # ascending
                while position >= ends[k]:
                    k += 1
                unjoined[k] += 1
            for t, n in zip(tickets, unjoined):
                if n:
                    t.batch.ignored[IGNORED_UNKNOWN_HOST] += n
        for t in tickets:
            for marker in t.batch.run_ends:
                self._store.mark_rank_finished(marker.run_id, marker.global_rank, dict(marker.final_counts),
                                               outcome=marker.outcome, exit_code=marker.exit_code,
                                               attempt=marker.attempt)
        drops: dict[tuple[str, int], dict[str, int]] = {}
        for t in tickets:
            for m in t.batch.run_ends:
                queues = drops.setdefault((m.run_id, m.global_rank), {})
                for queue, n in m.dropped.items():
                    queues[queue] = max(queues.get(queue, 0), n)
            for d in t.batch.drops:
                queues = drops.setdefault((d.run_id, d.global_rank), {})
                queues[d.queue] = max(queues.get(d.queue, 0), d.dropped)
        for (run_id, rank), counts in drops.items():
            if counts:
                self._store.record_drops(run_id, rank, counts)
        notes = [note for t in tickets for note in t.batch.mapped.values()]
        if notes:
            self._store.record_sources(notes)
        self.commits += 1
        # The store reports one merged result; split its duplicates over the tickets in
        # order. It refuses nothing: every record passed the decoder.
        duplicates_left = result.duplicates
        for t, left_out in zip(tickets, unjoined):
            written = len(t.batch.step_records) + len(t.batch.memory_records) + len(t.batch.resource_records) - left_out
            dup = min(duplicates_left, written)
            duplicates_left -= dup
            accepted = written - dup + len(t.batch.run_ends) + len(t.batch.drops)
            t.outcome = IngestOutcome(accepted, dup)
            signal = t.batch.signal
            self._stats.records(v.RECORD_ACCEPTED, signal, accepted)
            self._stats.records(v.RECORD_DUPLICATE, signal, dup)
        if self._on_committed is not None:
            try:
                self._on_committed([t.batch for t in tickets])
            except Exception:
                LOG.exception("post-commit hook failed")
        for t in tickets:
            t.done.set()
