"""The capture book: every capture of the runs this processor holds, from request to digest.

One owner for a capture's life: created (by the diagnosis' policy or a person), handed to each of
its two ranks once (their poll of the control path), answered (each rank's summary, trace or
failure), finished (done when both summaries arrived, failed when a rank could not record or a
deadline passed) and digested. The rules it keeps:

- at most one capture of a run is in progress; a request meanwhile is refused (409);
- the diagnosis asks at most once per run per cooldown, a person whenever nothing is in progress;
- with capture `off` nothing is created and nothing handed out, `manual` takes only a person's;
- a capture no rank took within the deadline fails (are the ranks polling?), and so does one
  whose rank took it but did not answer within the deadline after that.

Thread-safe: the HTTP routes (a pool), the run monitor (the policy) and the web view call it. Each
state change is written through `files.CaptureFiles` before the caller hears of it, so another
process reading the store later finds the same captures.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from traceml.processor import settings
from traceml.processor.capture.files import CaptureFiles
from traceml.processor.capture.model import CaptureRecord
from traceml.schema.capture import (
    MAX_STEPS,
    ROLE_CULPRIT,
    ROLE_REFERENCE,
    STATUS_CAPTURING,
    STATUS_DONE,
    STATUS_FAILED,
    STATUS_REQUESTED,
    TRIGGER_MANUAL,
    CaptureFormatError,
    CaptureRequest,
    RankCaptureSummary,
)

LOG = logging.getLogger(__name__)

MODE_AUTO, MODE_MANUAL, MODE_OFF = "auto", "manual", "off"
GZIP_MAGIC = b"\x1f\x8b"
MAX_REASON_CHARS = 300


class CaptureRefused(Exception):
    """A request or upload the book turns down; `status` is the HTTP answer, the message says why."""

    status = 400


class NotHeld(CaptureRefused):
    """The run (or capture) is not one this processor holds: another replica may own it."""

    status = 404


class InProgress(CaptureRefused):
    status = 409


class CaptureOff(CaptureRefused):
    status = 403


class TooLarge(CaptureRefused):
    status = 413


@dataclass
class _Entry:
    """A record plus what only the book needs: delivery and answers per rank."""

    record: CaptureRecord
    max_trace_bytes: int
    asked_mono: float
    delivered: dict[int, float] = field(default_factory=dict)  # rank -> monotonic time it took the request
    answered: set[int] = field(default_factory=set)  # ranks whose summary or failure arrived
    traces: dict[int, str] = field(default_factory=dict)

    def ranks(self) -> tuple[int, ...]:
        r = self.record
        return (r.culprit_rank,) if r.reference_rank is None else (r.culprit_rank, r.reference_rank)

    def role(self, rank: int) -> str | None:
        if rank == self.record.culprit_rank:
            return ROLE_CULPRIT
        if rank == self.record.reference_rank:
            return ROLE_REFERENCE
        return None


class CaptureBook:
    """Args:
        files: where records and uploads are written.
        mode: `auto`, `manual` or `off` (`settings.CAPTURE`).
        steps: steps of an automatic capture.
        cooldown_s: between two automatic captures of one run.
        max_trace_bytes: the raw-trace cap each request carries (0: no trace kept).
        deadline_s: how long a capture waits for its ranks (see the module docstring).
        holds_run: whether this processor holds a run, and which ranks it has seen of it
            (None: not held); the run monitor's view.
        run_ended: whether a held run has ended (its ranks are gone: a request would wait for
            nobody); the run monitor's view.
        digest: record -> its `Digest` (or None), called once a capture is done.
        choose_reference: (run id, culprit rank) -> the reference rank a person's request gets
            when it names none (the policy's choice), or None.
    """

    def __init__(self, files: CaptureFiles, *, mode: str = settings.CAPTURE.default,
                 steps: int = settings.CAPTURE_STEPS.default,
                 cooldown_s: float = settings.CAPTURE_COOLDOWN.default,
                 max_trace_bytes: int = settings.CAPTURE_MAX_TRACE_BYTES.default,
                 deadline_s: float = settings.CAPTURE_DEADLINE.default,
                 holds_run: Callable[[str], Iterable[int] | None] = lambda run_id: None,
                 run_ended: Callable[[str], bool] = lambda run_id: False,
                 digest: Callable[[CaptureRecord], object] | None = None,
                 choose_reference: Callable[[str, int], int | None] | None = None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic):
        self.files = files
        self.mode = mode
        self.steps = steps
        self.cooldown_s = cooldown_s
        self.max_trace_bytes = max_trace_bytes
        self.deadline_s = deadline_s
        self.holds_run = holds_run
        self.run_ended = run_ended
        self.digest = digest
        self.choose_reference = choose_reference
        self._clock = clock
        self._mono = monotonic
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}  # capture id -> entry, in creation order
        self._last_auto: dict[str, float] = {}  # run id -> monotonic time of its latest automatic capture

    # --- creating ----------------------------------------------------------------------------

    def request_capture(self, run_id: str, rank: int, reference: int | None = None, steps: int | None = None,
                        trigger: str = TRIGGER_MANUAL) -> CaptureRecord:
        """A person's request (HTTP route, web view, `traceml capture`): the new record.

        Raises `CaptureRefused` (its `status` is the HTTP answer): capture off (403), a run this
        processor does not hold or a rank it has not seen (404), a capture of the run in progress
        (409) or the run ended (409), a bad rank, reference or step count (400)."""
        if self.mode == MODE_OFF:
            raise CaptureOff("captures are off on this processor (--capture off)")
        steps = self.steps if steps is None else steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise CaptureRefused(f"steps must be 1..{MAX_STEPS}, got {steps!r}")
        ranks = self.holds_run(run_id)
        if ranks is None:
            raise NotHeld(f"run {run_id!r} is not held by this processor")
        if self.run_ended(run_id):
            raise InProgress(f"run {run_id!r} has ended: no rank is left to record a capture")
        ranks = set(ranks)
        if rank not in ranks:
            raise NotHeld(f"rank {rank} of run {run_id!r} has sent nothing to this processor")
        if reference is None and self.choose_reference is not None:
            reference = self.choose_reference(run_id, rank)
        if reference is None:  # no analysis of the run yet: the lowest other rank seen
            reference = min((r for r in ranks if r != rank), default=None)
        if reference is not None:
            if reference == rank:
                raise CaptureRefused(f"the reference rank must differ from the captured rank ({rank})")
            if reference not in ranks:
                raise NotHeld(f"reference rank {reference} of run {run_id!r} has sent nothing to this processor")
        return self._create(run_id, rank, reference, steps, trigger, auto=False)

    def auto_capture(self, run_id: str, culprit: int, reference: int | None, trigger: str) -> CaptureRecord | None:
        """The diagnosis' request (`policy`): a new record, or None when capture is not `auto`, one
        of the run is in progress, or the run's cooldown has not passed."""
        if self.mode != MODE_AUTO or reference == culprit:
            return None
        with self._lock:
            last = self._last_auto.get(run_id)
            if last is not None and self._mono() - last < self.cooldown_s:
                return None
        try:
            return self._create(run_id, culprit, reference, self.steps, trigger, auto=True)
        except InProgress:
            return None

    def _create(self, run_id, rank, reference, steps, trigger, *, auto: bool) -> CaptureRecord:
        self.expire()
        with self._lock:
            busy = self._in_progress(run_id)
            if busy is not None:
                raise InProgress(f"capture {busy.record.capture_id} of run {run_id!r} is in progress "
                                 f"({busy.record.status})")
            capture_id = f"c{int(self._clock())}-{secrets.token_hex(3)}"
            record = CaptureRecord(capture_id=capture_id, run_id=run_id, trigger=trigger, status=STATUS_REQUESTED,
                                   culprit_rank=rank, reference_rank=reference, steps=steps,
                                   requested_at=self._clock())
            self._entries[capture_id] = _Entry(record, self.max_trace_bytes, self._mono())
            if auto:
                self._last_auto[run_id] = self._mono()
            self.files.save_record(record)
        LOG.info("capture %s of run %r asked (%s): rank %d against %s over %d steps", capture_id, run_id, trigger,
                 rank, "no reference" if reference is None else f"rank {reference}", steps)
        return record

    def _in_progress(self, run_id: str) -> _Entry | None:
        for entry in self._entries.values():
            if entry.record.run_id == run_id and not entry.record.finished:
                return entry
        return None

    # --- handing out ------------------------------------------------------------------------

    def pending_for(self, run_id: str, rank: int) -> CaptureRequest | None:
        """The request for `rank` of `run_id` it has not taken yet (now marked taken), or None."""
        if self.mode == MODE_OFF:
            return None
        self.expire()
        with self._lock:
            entry = self._in_progress(run_id)
            if entry is None or rank in entry.delivered:
                return None
            role = entry.role(rank)
            if role is None:
                return None
            entry.delivered[rank] = self._mono()
            if entry.record.status == STATUS_REQUESTED:
                entry.record = replace(entry.record, status=STATUS_CAPTURING)
                self.files.save_record(entry.record)
            record = entry.record
            return CaptureRequest(capture_id=record.capture_id, run_id=run_id, rank=rank, role=role,
                                  steps=record.steps, max_trace_bytes=entry.max_trace_bytes)

    # --- answers ----------------------------------------------------------------------------

    def _entry_for(self, capture_id: str, rank: int) -> _Entry:
        entry = self._entries.get(capture_id)
        if entry is None:
            raise NotHeld(f"capture {capture_id!r} is not held by this processor")
        if entry.role(rank) is None:
            raise CaptureRefused(f"rank {rank} is not part of capture {capture_id}")
        return entry

    def receive_summary(self, capture_id: str, rank: int, raw: bytes) -> CaptureRecord:
        """A rank's summary: validated (400 naming the problem, nothing stored), kept, and the
        capture done once every rank answered."""
        try:
            summary = RankCaptureSummary.from_json(raw)
        except CaptureFormatError as exc:
            raise CaptureRefused(str(exc)) from None
        with self._lock:
            entry = self._entry_for(capture_id, rank)
            record = entry.record
            for key, got, want in (("capture_id", summary.capture_id, capture_id), ("rank", summary.rank, rank),
                                   ("run_id", summary.run_id, record.run_id), ("role", summary.role, entry.role(rank))):
                if got != want:
                    raise CaptureRefused(f"capture summary: {key!r} is {got!r}, the path names {want!r}")
            if record.finished:
                raise InProgress(f"capture {capture_id} is already {record.status}")
            if rank in entry.answered:
                raise InProgress(f"rank {rank} already answered capture {capture_id}")
            self.files.save_summary(summary, raw)
            entry.answered.add(rank)
            entry.record = replace(record, summaries=record.summaries + (summary,))
            done = entry.answered >= set(entry.ranks())
            if done:
                entry.record = replace(entry.record, status=STATUS_DONE, finished_at=self._clock())
            self.files.save_record(entry.record)
        if done:
            self._digest(capture_id)
        return self.get(capture_id)

    def receive_trace(self, capture_id: str, rank: int, data: bytes) -> CaptureRecord:
        """A rank's gzip'd trace: over the request's cap 413 and not kept; one per rank."""
        with self._lock:
            entry = self._entry_for(capture_id, rank)
            if len(data) > entry.max_trace_bytes:
                raise TooLarge(f"trace of {len(data)} bytes is over the cap of {entry.max_trace_bytes} bytes; "
                               "not kept")
            if not data.startswith(GZIP_MAGIC):
                raise CaptureRefused("a capture trace must be gzip'd (the Chrome trace, as .json.gz)")
            if rank in entry.traces:
                raise InProgress(f"rank {rank} already uploaded its trace for capture {capture_id}")
            run_id = entry.record.run_id
            entry.traces[rank] = ""  # claimed: a second upload meanwhile is refused
        name = self.files.save_trace(run_id, capture_id, rank, data)  # megabytes: outside the lock
        with self._lock:
            entry.traces[rank] = name
            entry.record = replace(entry.record, traces=entry.record.traces + (name,))
            self.files.save_record(entry.record)
            return entry.record

    def receive_failure(self, capture_id: str, rank: int, reason: str) -> CaptureRecord:
        """A rank could not record: the capture fails with its reason (the other rank's answer,
        if it comes, is refused)."""
        with self._lock:
            entry = self._entry_for(capture_id, rank)
            if entry.record.finished:
                raise InProgress(f"capture {capture_id} is already {entry.record.status}")
            entry.answered.add(rank)
            self._fail(entry, f"rank {rank}: {reason[:MAX_REASON_CHARS]}")
            return entry.record

    def _fail(self, entry: _Entry, reason: str) -> None:
        entry.record = replace(entry.record, status=STATUS_FAILED, reason=reason, finished_at=self._clock())
        self.files.save_record(entry.record)
        LOG.info("capture %s of run %r failed: %s", entry.record.capture_id, entry.record.run_id, reason)

    def _digest(self, capture_id: str) -> None:
        if self.digest is None:
            return
        with self._lock:
            record = self._entries[capture_id].record
        try:
            digest = self.digest(record)
        except Exception:
            LOG.exception("digest of capture %s failed", capture_id)
            return
        with self._lock:
            entry = self._entries.get(capture_id)
            if entry is not None:
                entry.record = replace(entry.record, digest=digest)

    # --- deadlines, reading, forgetting -------------------------------------------------------

    def expire(self) -> None:
        """Fail the captures past their deadline (called on every access; cheap when none is open)."""
        now = self._mono()
        with self._lock:
            for entry in self._entries.values():
                if entry.record.finished:
                    continue
                missing = [r for r in entry.ranks() if r not in entry.answered]
                if not entry.delivered:
                    if now - entry.asked_mono >= self.deadline_s:
                        self._fail(entry, f"no rank took the request within {self.deadline_s:g} s (are the ranks "
                                          "polling this processor? TRACEML_CONTROL_ENDPOINT)")
                    continue
                late = [r for r in missing if now - entry.delivered.get(r, entry.asked_mono) >= self.deadline_s]
                if late:
                    which = ", ".join(f"rank {r}" for r in late)
                    self._fail(entry, f"{which} did not answer within {self.deadline_s:g} s")

    def get(self, capture_id: str) -> CaptureRecord | None:
        self.expire()
        with self._lock:
            entry = self._entries.get(capture_id)
            return None if entry is None else entry.record

    def of_run(self, run_id: str) -> list[CaptureRecord]:
        """The run's captures, oldest first."""
        self.expire()
        with self._lock:
            return [e.record for e in self._entries.values() if e.record.run_id == run_id]

    def adopt(self, run_ids: Iterable[str]) -> None:
        """At start-up: the captures of the runs adopted again come back from their files (a capture
        open at the restart fails: its ranks may have answered the process that is gone), and the
        files of every other run go (they left this processor before its restart)."""
        from traceml.processor.capture.files import load_records

        run_ids = list(run_ids)
        self.files.keep_only(run_ids)
        with self._lock:
            for run_id in run_ids:
                for record in load_records(self.files.db_path, run_id):
                    if record.status == STATUS_DONE and self.digest is not None:
                        record = replace(record, digest=self.digest(record))
                    entry = _Entry(record, self.max_trace_bytes, self._mono())
                    self._entries[record.capture_id] = entry
                    if not record.finished:
                        self._fail(entry, "the processor restarted while the capture was open")

    def stop(self) -> None:
        """The processor stops: captures still open fail, saying so (their ranks may answer a
        processor that is gone), and none is created after."""
        with self._lock:
            self.mode = MODE_OFF
            for entry in self._entries.values():
                if not entry.record.finished:
                    self._fail(entry, "the processor stopped before every rank answered")

    def forget_run(self, run_id: str) -> None:
        """The run left the processor: its captures and their files go with it."""
        with self._lock:
            for capture_id in [c for c, e in self._entries.items() if e.record.run_id == run_id]:
                del self._entries[capture_id]
            self._last_auto.pop(run_id, None)
        self.files.remove_run(run_id)


# --- the digest, and captures read back from a store -----------------------------------------


def digest_of(record: CaptureRecord, window=None):
    """The record's `Digest` (`digest.compute_digest` on its culprit's and reference's summaries),
    or None until both summaries are there. `window`: an analysis window of the run, whose
    captured steps give the digest its phase gap (`phases.captured_phase_means`)."""
    from traceml.processor.capture.digest import compute_digest
    from traceml.processor.capture.phases import captured_phase_means

    culprit, reference = record.summary_of(record.culprit_rank), record.summary_of(record.reference_rank)
    if culprit is None or reference is None or record.status != STATUS_DONE:
        return None
    return compute_digest(culprit, reference, phase_means=captured_phase_means(window, culprit, reference))


def stored_captures(db_path, run_id: str, window=None) -> list[CaptureRecord]:
    """The run's captures as the store's processor left them, digests computed again (with the
    phases of their steps when `window` holds them): what the final summary reads (in whichever
    process writes it)."""
    from traceml.processor.capture.files import load_records

    return [replace(record, digest=digest_of(record, window)) for record in load_records(db_path, run_id)]
