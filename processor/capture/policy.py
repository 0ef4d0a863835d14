"""When the diagnosis asks for a capture, of which rank, and against which reference.

After each live refresh of a run (`RunMonitor`'s `on_refreshed`), the first confirmed finding
that names one culprit rank asks the book for a capture (the book keeps the cooldown and the one
at a time):

- a straggler kind (`STRAGGLER_KINDS`): its culprit;
- `STEP_TIME_DRIFT` scoped to a rank: that rank (a job-wide drift names none);
- `COLLECTIVE_BOUND` when one rank stands out: the rank that waited least (the one the others
  waited for) when its wait share is at most half the median share of the others.

The reference is the fastest other rank of the culprit's node (same node rank, else same host
name) when there is one, else the window's representative rank, else the other rank nearest the
median step time; never the culprit. Only the analysis is read: no store, no clock.
"""
from __future__ import annotations

import statistics
import threading

from traceml.processor.capture.book import CaptureBook
from traceml.processor.diagnosis.policy import DEFAULT_POLICY
from traceml.schema.diagnosis import COLLECTIVE_BOUND, STATUS_CONFIRMED, STEP_TIME_DRIFT, STRAGGLER_KINDS
from traceml.schema.vocabulary import METRIC_STEP_TIME

STANDS_OUT_RATIO = 0.5
"""COLLECTIVE_BOUND names a rank when its wait share is at most this fraction of the others' median."""


def culprit_of(issue) -> int | None:
    """The one rank a finding blames, or None (not a kind that names one, or nobody stands out)."""
    if issue.kind in STRAGGLER_KINDS or issue.kind == STEP_TIME_DRIFT:
        return issue.culprit_rank
    if issue.kind == COLLECTIVE_BOUND:
        evidence = issue.evidence or {}
        least, shares = evidence.get("least_wait_rank"), evidence.get("rank_shares") or {}
        others = [float(v) for r, v in shares.items() if str(r) != str(least) and v is not None]
        mine = shares.get(str(least))
        if least is None or mine is None or not others:
            return None
        return int(least) if float(mine) <= STANDS_OUT_RATIO * statistics.median(others) else None
    return None


def reference_for(window, culprit: int) -> int | None:
    """The reference rank for `culprit` in `window` (module docstring), or None when the window
    has no other rank."""
    facts = window.rank_facts
    step_of = {r: f.average.step_time for r, f in facts.items()}
    others = [r for r in facts if r != culprit]
    if not others:
        return None
    mine = facts.get(culprit)
    if mine is not None:
        ident = mine.identity
        same_node = [r for r in others if _same_node(ident, facts[r].identity)]
        timed = [r for r in same_node if step_of[r] is not None]
        if timed:
            return min(timed, key=lambda r: (step_of[r], r))
        if same_node:
            return min(same_node)
    metric = window.metrics.get(METRIC_STEP_TIME)
    representative = None if metric is None else metric.representative_rank
    if representative is not None and representative != culprit and representative in facts:
        return representative
    timed = [r for r in others if step_of[r] is not None]
    if timed:
        middle = statistics.median(step_of[r] for r in timed)
        return min(timed, key=lambda r: (abs(step_of[r] - middle), r))
    return min(others)


def _same_node(a, b) -> bool:
    if a.node_rank is not None and b.node_rank is not None:
        return a.node_rank == b.node_rank
    return a.hostname is not None and a.hostname == b.hostname


def capture_target(analysis) -> tuple[str, int, int] | None:
    """(trigger kind, culprit, reference) of the first confirmed finding naming a culprit, or None."""
    for issue in analysis.diagnosis.issues:
        if issue.status != STATUS_CONFIRMED:
            continue
        culprit = culprit_of(issue)
        if culprit is None:
            continue
        reference = reference_for(analysis.window, culprit)
        if reference is None or reference == culprit:
            continue
        return issue.kind, culprit, reference
    return None


def bears_watching(analysis) -> bool:
    """Whether the watch should look at the run again soon: a finding names a culprit (confirmed or
    not yet), or the window is still shorter than a confirmation needs. Otherwise (balanced, or
    findings that name nobody, over enough steps) no capture is near, and the watch may slow down."""
    if analysis.window.step_count < DEFAULT_POLICY.crit_min_steps:
        return True
    return any(culprit_of(issue) is not None for issue in analysis.diagnosis.issues)


class CapturePolicy:
    """The monitor's side of the book: asks after refreshes, answers reference choices."""

    def __init__(self, book: CaptureBook):
        self.book = book
        self._lock = threading.Lock()
        self._windows: dict[str, object] = {}  # run id -> its latest analysed window

    def after_refresh(self, run_id: str, result) -> bool:
        """Ask for a capture if a confirmed finding calls for one; returns `bears_watching`."""
        analysis = result.analysis
        with self._lock:
            self._windows[run_id] = analysis.window
        self.book.expire()  # captures past their deadline fail now, not at the next reader
        target = capture_target(analysis)
        if target is not None:
            trigger, culprit, reference = target
            self.book.auto_capture(run_id, culprit, reference, trigger)
        return bears_watching(analysis)

    def choose_reference(self, run_id: str, culprit: int) -> int | None:
        with self._lock:
            window = self._windows.get(run_id)
        return None if window is None else reference_for(window, culprit)

    def window_of(self, run_id: str):
        """The run's latest analysed window (the live digest's phase gap reads it), or None."""
        with self._lock:
            return self._windows.get(run_id)

    def forget(self, run_id: str) -> None:
        with self._lock:
            self._windows.pop(run_id, None)
