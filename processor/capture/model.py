"""The capture's shapes at the processor's boundaries: one `CaptureRecord` per capture, and the
`Digest` the two ranks' summaries become.

The book (`book.py`) creates and advances records, `digest.py` computes digests, and the final
summary, the card, the web view and the HTML report read both without computing anything. The
wire documents the ranks send are `schema.capture`'s; these are the processor's own view of a
capture. Standard library only, frozen: a record changes state by being replaced.
"""
from __future__ import annotations

from dataclasses import dataclass

from traceml.schema.capture import STATUS_DONE, STATUS_FAILED, STATUS_REFUSED, RankCaptureSummary

FINISHED_STATUSES: tuple[str, ...] = (STATUS_DONE, STATUS_FAILED, STATUS_REFUSED)
"""States a capture never leaves."""


@dataclass(frozen=True)
class DigestRow:
    """One entry's time per captured step on both ranks (self times: an op's children are theirs).

    `reference_ms` is None when the reference rank left entries out of its summary (only its
    largest are sent) and this one is not among those kept: its time there is unknown, not zero,
    and so `excess_ms` and `share_of_gap` are None too. An entry the reference's complete summary
    does not hold ran 0 ms there."""

    name: str
    kind: str
    """One of `schema.capture.OP_KINDS`; KIND_HOST is the time no recorded operator covers."""
    culprit_ms: float
    reference_ms: float | None
    excess_ms: float | None
    """culprit_ms - reference_ms: positive when the culprit spends more."""
    share_of_gap: float | None
    """excess_ms / gap_ms; None when the gap is not positive or the excess is unknown."""


@dataclass(frozen=True)
class PhaseGap:
    """One phase's mean over the captured steps on both ranks, from the store's step rows."""

    phase: str
    culprit_ms: float
    reference_ms: float
    gap_ms: float


@dataclass(frozen=True)
class Digest:
    """What the culprit did over its captured steps that the reference did not, largest first.

    Never invents: what the captures could not see or left out is said in `not_seen`."""

    gap_ms: float
    """Mean captured step ms, culprit minus reference (may be <= 0: then no share is given)."""
    culprit_step_ms: float
    reference_step_ms: float
    culprit_steps: int
    """Captured steps compared on the culprit (and on the reference, below)."""
    reference_steps: int
    rows: tuple[DigestRow, ...]
    """The top entries by excess, input and collectives kept by kind, the host row always."""
    rows_left_out: int = 0
    """Entries present on either rank that are not among `rows`."""
    not_seen: tuple[str, ...] = ()
    phase_gap: tuple[PhaseGap, ...] = ()
    """Per-phase means of the captured steps; empty when the store did not hold those steps."""


@dataclass(frozen=True)
class CaptureRecord:
    """One capture of one run, from request to digest (the book's unit; public in final_summary)."""

    capture_id: str
    run_id: str
    trigger: str
    """The kind of the finding that asked (`schema.diagnosis`), or `schema.capture.TRIGGER_MANUAL`."""
    status: str
    """One of `schema.capture.CAPTURE_STATUSES`."""
    culprit_rank: int
    reference_rank: int | None
    steps: int
    requested_at: float
    """Unix seconds (wall clock), as every public timestamp."""
    finished_at: float | None = None
    reason: str | None = None
    """Why a capture failed or was refused (a rank's failure message, the deadline, a refusal)."""
    summaries: tuple[RankCaptureSummary, ...] = ()
    """The ranks' uploaded summaries (culprit's and reference's, as they arrived)."""
    traces: tuple[str, ...] = ()
    """File names (`schema.capture.trace_file_name`) of the raw traces kept with the run."""
    digest: Digest | None = None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    def summary_of(self, rank: int | None) -> RankCaptureSummary | None:
        """The summary `rank` uploaded, if it did."""
        for summary in self.summaries:
            if summary.rank == rank:
                return summary
        return None
