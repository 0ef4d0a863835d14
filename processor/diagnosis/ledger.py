"""Badput ledger: the rank-time a run lost, per cause, and what fixing each finding would buy.

Synchronous data-parallel training is bounded by its slowest rank: every rank waits
in the collective for the last one, so a second one rank loses is a second every
other rank spends waiting. The ledger therefore counts **rank-time** (a rank idle
for one second is one rank-second; on GPUs, one device-second) and sorts it into
causes that never overlap inside one rank's step, so they add up:

- `input_stall`: Input Wait (time before the step had its batch);
- `h2d`: host-to-device copies;
- `communication`: the collective wait even the least waiting rank spent (its wait is
  communication no late rank explains), paid by every rank;
- `straggler_wait`: each rank's collective wait beyond that floor: waiting for a later
  rank, summed over the ranks that waited (without collective wait measured: each rank's
  visible phase beyond the least, as the straggler rule reads it);
- `drift`: when `STEP_TIME_DRIFT` fired, the growth after its onset of the time no cause
  above holds (compute and residual) over the rank's own steps before it (the run's best
  window); growth in input, copies or waits is already in their causes;
- `restarts` (whole run, `run_ledger`): steps of an earlier attempt done again by the next,
  and the time between attempts, on every rank.

The window's figures use the rank averages the analyzer computed (exactly their per-step
sums / steps), so the ledger is cheap enough for every live tick; per-step arrays are read
only for the findings that get a what-if. `docs/DIAGNOSIS.md` ("Badput ledger") states the
method and what the estimate cannot know.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from traceml.processor.diagnosis.context import RuleContext
from traceml.processor.diagnosis.policy import DEFAULT_POLICY, DiagnosisPolicy
from traceml.processor.diagnosis.straggler import visible_phases
from traceml.processor.reporting.inputs import AttemptSpan
from traceml.processor.step_time.analysis import rank_step_matrix
from traceml.processor.step_time.model import DiagnosisIssue, StepTimeDiagnosis, StepTimeWindow, finite_ratio
from traceml.schema.badput import (
    CAUSE_COMMUNICATION,
    CAUSE_DRIFT,
    CAUSE_H2D,
    CAUSE_INPUT_STALL,
    CAUSE_RESTARTS,
    CAUSE_STRAGGLER_WAIT,
    LEDGER_CAUSES,
    WINDOW_CAUSES,
)
from traceml.schema.diagnosis import (
    COLLECTIVE_BOUND,
    COMPONENT_H2D,
    COMPONENT_INPUT_WAIT,
    H2D_BOUND,
    INPUT_BOUND,
    RESIDUAL_HEAVY,
    STEP_TIME_DRIFT,
    STRAGGLER_KINDS,
)
from traceml.schema.vocabulary import (
    METRIC_COLLECTIVE_WAIT,
    METRIC_H2D,
    METRIC_INPUT_WAIT,
    METRIC_RESIDUAL,
    METRIC_STEP_TIME,
)

MS_PER_SECOND = 1_000.0
SECONDS_PER_HOUR = 3_600.0

BASIS_MEDIAN = "median"
"""What-if of a straggler: its cause at the median rank's level (the others stop waiting for it)."""
BASIS_REMOVED = "removed"
"""What-if of a share or collective finding: the named time removed from every step."""
BASIS_BEST_WINDOW = "best_window"
"""What-if of a drift: the steps back at their level before the onset."""
WHAT_IF_BASES: tuple[str, ...] = (BASIS_MEDIAN, BASIS_REMOVED, BASIS_BEST_WINDOW)
SPREAD_PERCENTILES: tuple[float, float] = (10.0, 90.0)
"""A what-if's interval: 8 in 10 of the window's per-step predictions lie between these percentiles.
The middle half (25-75) was tried first: a second run of the job without the cause, on a busy shared
2-core machine, came out just beyond it (its mean step 4 % above the predictions' 75th percentile):
half the window's own steps lie outside such a band, so it claimed more certainty than one window has."""

_CAUSE_OF_KIND = {INPUT_BOUND: CAUSE_INPUT_STALL, H2D_BOUND: CAUSE_H2D, RESIDUAL_HEAVY: None,
                  COLLECTIVE_BOUND: CAUSE_COMMUNICATION, STEP_TIME_DRIFT: CAUSE_DRIFT}
_METRIC_OF_SHARE_KIND = {INPUT_BOUND: METRIC_INPUT_WAIT, H2D_BOUND: METRIC_H2D, RESIDUAL_HEAVY: METRIC_RESIDUAL}
_OWN_EXCESS_COMPONENTS = {COMPONENT_INPUT_WAIT: METRIC_INPUT_WAIT, COMPONENT_H2D: METRIC_H2D}
"""A straggler's own idle excess over the victim (the typical rank: its input wait, its copies) is
lost time too; a compute straggler's extra compute is work, so only the others' wait counts for it."""


# --- Shapes ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CauseLoss:
    """Rank-time lost to one cause. `rank_seconds` None: not measurable in this run (the signal
    was not measured); 0.0: measured, none lost. `device_hours` None: no device known for the
    ranks (a CPU run), never a guess."""

    cause: str
    rank_seconds: float | None
    device_hours: float | None = None
    share: float | None = None  # of the window's rank-time (the ledger's denominator)
    ranks: int = 0  # ranks that lost time to it
    worst_rank: int | None = None  # the rank that lost the most to it
    culprit_rank: int | None = None  # straggler_wait: the rank waited for, when a finding names it


@dataclass(frozen=True, slots=True)
class WhatIf:
    """One finding's counterfactual: the job's step time now and if its cause were at the median
    rank's level (stragglers), removed (shares, communication) or back at the run's best window
    (drift). `speedup_low`..`speedup_high` is the interval the window's step-to-step spread
    allows (the 10th to 90th percentile of its per-step predictions); `rank_seconds` the window's lost
    rank-time the finding accounts for."""

    kind: str
    cause: str | None
    culprit_rank: int | None
    basis: str  # WHAT_IF_BASES
    step_time_ms: float
    predicted_step_time_ms: float
    speedup: float
    speedup_low: float
    speedup_high: float
    rank_seconds: float | None
    device_hours: float | None = None


@dataclass(frozen=True)
class WindowLedger:
    """The ledger over one analysis window (live: 100 steps; summary: the run up to 10,000)."""

    run_id: str
    steps: int
    ranks: int  # ranks in the ledger's cohort (those with the step duration measured)
    first_step: int | None
    last_step: int | None
    step_basis: str | None  # `step_time` or `traced_step_time` (RuleContext.step_basis)
    window_rank_seconds: float | None  # the cohort's summed step durations over the window
    causes: Mapping[str, CauseLoss]  # WINDOW_CAUSES, each always present
    total_rank_seconds: float | None  # the measurable causes summed; None when none is
    total_device_hours: float | None
    devices_known: int  # ranks with a known GPU (resource metrics); 0 on CPU
    what_ifs: tuple[WhatIf, ...] = ()

    @property
    def total_share(self) -> float | None:
        if self.total_rank_seconds is None or self.window_rank_seconds is None:
            return None
        return finite_ratio(self.total_rank_seconds, self.window_rank_seconds)


@dataclass(frozen=True, slots=True)
class RestartLoss:
    """Rank-time lost to restarts over the whole run: steps of earlier attempts that the next
    attempt did again (it began at or before their step ids), and the time between attempts."""

    attempts: int  # attempts stored (1: never restarted)
    redone_steps: int  # (rank, step) cells done again
    redone_rank_seconds: float
    downtime_s: float  # wall time between one attempt's last step and the next one's first
    downtime_rank_seconds: float

    @property
    def rank_seconds(self) -> float:
        return self.redone_rank_seconds + self.downtime_rank_seconds


NO_RESTARTS = RestartLoss(attempts=1, redone_steps=0, redone_rank_seconds=0.0, downtime_s=0.0,
                          downtime_rank_seconds=0.0)


@dataclass(frozen=True)
class RunLedger:
    """The window's ledger extrapolated over the run so far (its current attempt's steps), plus
    the restarts before it. `scale` = run steps / window steps (1.0 when the window is the run)."""

    run_id: str
    window: WindowLedger
    run_steps: int | None
    scale: float | None
    causes: Mapping[str, CauseLoss]  # LEDGER_CAUSES, each always present
    total_rank_seconds: float | None
    total_device_hours: float | None
    devices_known: int
    restarts: RestartLoss | None = None  # None: not read (the live view does not read attempts)


# --- The window ledger ------------------------------------------------------------------------


def empty_ledger(window: StepTimeWindow) -> WindowLedger:
    """No aligned step (or no step duration): nothing measurable, every cause None."""
    return WindowLedger(run_id=window.run_id, steps=window.step_count, ranks=0,
                        first_step=window.steps[0] if window.steps else None,
                        last_step=window.steps[-1] if window.steps else None, step_basis=None,
                        window_rank_seconds=None, causes={c: CauseLoss(c, None) for c in WINDOW_CAUSES},
                        total_rank_seconds=None, total_device_hours=None, devices_known=0)


def standout_rank(per_rank: Mapping[int, float]) -> int | None:
    """The rank that lost the most to a cause, when it stands out: more than twice the median of
    the other ranks' losses (with one rank, when it lost any). A loss spread evenly names no rank:
    'most on rank 0' of two equal halves would send a reader to the wrong machine."""
    if not per_rank:
        return None
    ranks = np.fromiter(per_rank.keys(), dtype=np.int64, count=len(per_rank))
    values = np.fromiter(per_rank.values(), dtype=np.float64, count=len(per_rank))
    top = float(values.max())
    if not top > 0:
        return None
    worst = int(ranks[values == top].min())  # ties: the lower rank id
    others = values[ranks != worst]
    if others.size and not top > 2.0 * float(np.median(others)):
        return None
    return worst


def _device_ranks(resources, ranks: Sequence[int]) -> frozenset[int]:
    """Ranks whose resource figures name a GPU (its UUID, or `cuda:N`); none on a CPU run."""
    by_rank = getattr(resources, "ranks", None) or {}
    return frozenset(r for r in ranks if getattr(by_rank.get(r), "device", None))


class _Ledger:
    """One window's arithmetic: per-rank loss vectors (ms over the window) over the cohort."""

    def __init__(self, window: StepTimeWindow, diagnosis: StepTimeDiagnosis, resources,
                 policy: DiagnosisPolicy):
        self.window = window
        self.diagnosis = diagnosis
        self.ctx = RuleContext(window=window, policy=policy)
        self.basis = self.ctx.step_basis
        self.cohort = self.ctx.cohort((self.basis,))
        self.n = window.step_count
        self.step_ms = self.ctx.column(self.basis)
        self.devices = _device_ranks(resources, self.cohort)
        self._matrices: dict[str, np.ndarray] = {}

    # per-rank vectors --------------------------------------------------------------------

    def per_rank(self, metric: str, missing: float | None) -> dict[int, float] | None:
        """rank -> window average of `metric` over the cohort; `missing` for a rank without it
        (None: the metric is unmeasurable for the ledger unless every cohort rank has it)."""
        col = self.ctx.column(metric)
        if missing is None and not all(r in col for r in self.cohort):
            if not any(r in col for r in self.cohort):
                return None
        return {r: float(col[r]) if r in col else float(missing or 0.0) for r in self.cohort}

    def waits(self) -> tuple[dict[int, float] | None, dict[int, float] | None, int | None]:
        """(communication, straggler wait, least-waiting rank) per rank (ms per step)."""
        col = self.ctx.column(METRIC_COLLECTIVE_WAIT)
        if self.cohort and all(r in col for r in self.cohort):
            floor_rank = min(self.cohort, key=lambda r: (col[r], r))
            floor = float(col[floor_rank])
            return ({r: floor for r in self.cohort},
                    {r: float(col[r]) - floor for r in self.cohort}, floor_rank)
        phases = visible_phases(self.ctx)
        cohort = self.ctx.cohort((*phases, self.basis))
        if len(cohort) < 2:
            return None, ({r: 0.0 for r in self.cohort} if len(self.cohort) == 1 else None), None
        visible = {r: sum(float(self.ctx.column(p)[r]) for p in phases) for r in cohort}
        floor_rank = min(cohort, key=lambda r: (visible[r], r))
        return None, {r: visible.get(r, visible[floor_rank]) - visible[floor_rank] for r in self.cohort}, floor_rank

    def matrix(self, metric: str) -> np.ndarray:
        """(aligned steps, cohort ranks) per-step values of `metric` (NaN = unavailable)."""
        if metric not in self._matrices:
            facts = [self.window.rank_facts[r] for r in self.cohort]
            self._matrices[metric] = rank_step_matrix(facts, metric)
        return self._matrices[metric]

    def columns(self, metric: str, ranks: Sequence[int]) -> np.ndarray:
        """(aligned steps, len(ranks)) per-step values of `metric` for a few ranks: a straggler's
        what-if reads its culprit and victim only, not every rank of a wide window."""
        if metric in self._matrices:
            index = self._index()
            return self._matrices[metric][:, [index[r] for r in ranks]]
        return rank_step_matrix([self.window.rank_facts[r] for r in ranks], metric)

    def drift(self) -> dict[int, float] | None:
        """Per rank (ms over the window): growth after the drift's onset of the time no other cause
        holds, over the rank's median before it. None when the drift rule could not run."""
        if self.n < 2 * self.ctx.policy.drift_min_segment:
            return None
        issue = next((i for i in self.diagnosis.issues if i.kind == STEP_TIME_DRIFT), None)
        if issue is None:
            return {r: 0.0 for r in self.cohort}
        split = int(issue.evidence.get("steps_before") or 0)
        scope = self.cohort if issue.culprit_rank is None else (issue.culprit_rank,)
        free = self.matrix(self.basis).copy()  # minus what the phase causes already hold
        held = [METRIC_H2D, METRIC_COLLECTIVE_WAIT] + ([METRIC_INPUT_WAIT] if self.basis == METRIC_STEP_TIME else [])
        for metric in held:
            free -= np.nan_to_num(self.matrix(metric), nan=0.0)
        _, _, floor_rank = self.waits()
        waits = self.ctx.column(METRIC_COLLECTIVE_WAIT)
        if floor_rank is not None and not all(r in waits for r in self.cohort):
            # No collective wait measured: the straggler wait is each step's visible phase beyond the
            # least waiting rank's (its per-step sum is the straggler cause), not the drift's.
            visible = sum(np.nan_to_num(self.matrix(p), nan=0.0) for p in visible_phases(self.ctx))
            free -= visible - visible[:, [self.cohort.index(floor_rank)]]
        out = {r: 0.0 for r in self.cohort}
        if not 0 < split < self.n:
            return out
        index = {r: i for i, r in enumerate(self.cohort)}
        for r in scope:
            if r not in index:
                continue
            series = free[:, index[r]]
            if np.isnan(series).any():
                continue
            best = float(np.median(series[:split]))
            out[r] = max(0.0, float(np.sum(series[split:] - best)))
        return out

    # the ledger ----------------------------------------------------------------------------

    def build(self) -> WindowLedger:
        if not self.cohort or self.n == 0:
            return empty_ledger(self.window)
        n = self.n
        comm, stragglers, _ = self.waits()
        per_step: dict[str, dict[int, float] | None] = {
            CAUSE_INPUT_STALL: (self.per_rank(METRIC_INPUT_WAIT, None)
                                if self.basis == METRIC_STEP_TIME else None),
            CAUSE_H2D: self.per_rank(METRIC_H2D, 0.0),  # occurrence-driven: absent = no copies
            CAUSE_COMMUNICATION: comm,
            CAUSE_STRAGGLER_WAIT: stragglers,
        }
        totals: dict[str, dict[int, float] | None] = {
            c: None if v is None else {r: x * n for r, x in v.items()} for c, v in per_step.items()}
        totals[CAUSE_DRIFT] = self.drift()
        window_ms = sum(float(self.step_ms[r]) for r in self.cohort) * n
        straggler = next((i for i in self.diagnosis.issues if i.kind in STRAGGLER_KINDS), None)
        causes = {}
        for cause in WINDOW_CAUSES:
            causes[cause] = self.cause_loss(cause, totals.get(cause), window_ms,
                                            straggler.culprit_rank if straggler is not None
                                            and cause == CAUSE_STRAGGLER_WAIT else None)
        measured = [c for c in causes.values() if c.rank_seconds is not None]
        total = sum(c.rank_seconds for c in measured) if measured else None
        device = ([c.device_hours for c in measured if c.device_hours is not None] if self.devices else [])
        return WindowLedger(
            run_id=self.window.run_id, steps=n, ranks=len(self.cohort), first_step=self.window.steps[0],
            last_step=self.window.steps[-1], step_basis=self.basis, window_rank_seconds=window_ms / MS_PER_SECOND,
            causes=causes, total_rank_seconds=total,
            total_device_hours=sum(device) if self.devices else None, devices_known=len(self.devices),
            what_ifs=tuple(w for issue in self.diagnosis.issues if (w := self.what_if(issue, totals)) is not None))

    def cause_loss(self, cause: str, per_rank: dict[int, float] | None, window_ms: float,
                   culprit: int | None) -> CauseLoss:
        if per_rank is None:
            return CauseLoss(cause, None)
        total_ms = sum(per_rank.values())
        return CauseLoss(
            cause, total_ms / MS_PER_SECOND, device_hours=self.device_hours(per_rank),
            share=finite_ratio(total_ms, window_ms), ranks=sum(1 for v in per_rank.values() if v > 0),
            worst_rank=standout_rank(per_rank), culprit_rank=culprit)

    def device_hours(self, per_rank: Mapping[int, float]) -> float | None:
        if not self.devices:
            return None
        return sum(v for r, v in per_rank.items() if r in self.devices) / MS_PER_SECOND / SECONDS_PER_HOUR

    # what-ifs ------------------------------------------------------------------------------

    def job_series(self) -> np.ndarray:
        """Per aligned step, the median over the cohort of its step duration: the job's step time."""
        return np.median(self.matrix(self.basis), axis=1)

    def what_if(self, issue: DiagnosisIssue, totals: Mapping[str, dict[int, float] | None]) -> WhatIf | None:
        try:
            if issue.kind in STRAGGLER_KINDS:
                return self._straggler_what_if(issue, totals)
            if issue.kind in _METRIC_OF_SHARE_KIND:
                return self._share_what_if(issue)
            if issue.kind == COLLECTIVE_BOUND:
                return self._collective_what_if(issue, totals)
            if issue.kind == STEP_TIME_DRIFT:
                return self._drift_what_if(issue)
        except (KeyError, ValueError, IndexError):  # a rank outside the cohort, an empty series
            return None
        return None

    def _index(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(self.cohort)}

    def _straggler_what_if(self, issue: DiagnosisIssue, totals) -> WhatIf | None:
        culprit, victim = issue.culprit_rank, issue.victim_rank
        index = self._index()
        if culprit not in index or victim not in index:
            return None
        pair = (victim, culprit)
        if issue.evidence.get("wait_basis") == METRIC_COLLECTIVE_WAIT:
            waits = np.nan_to_num(self.columns(METRIC_COLLECTIVE_WAIT, pair), nan=0.0)
        else:
            waits = sum(self.columns(p, pair) for p in visible_phases(self.ctx))
        gap = waits[:, 0] - waits[:, 1]
        now = self.columns(self.basis, (victim,))[:, 0]  # the victim's step, the score's denominator
        lost = totals.get(CAUSE_STRAGGLER_WAIT)
        lost_ms = None if lost is None else sum(lost.values())
        own_metric = _OWN_EXCESS_COMPONENTS.get(issue.component or "")
        own: dict[int, float] = {}
        if own_metric is not None and lost_ms is not None:
            col = self.ctx.column(own_metric)  # the culprit's excess over the victim, as the rule's
            own[culprit] = max(0.0, float(col.get(culprit, 0.0)) - float(col.get(victim, 0.0))) * self.n
            lost_ms += own[culprit]
        per_rank = dict(lost or {})
        if own:
            per_rank[culprit] = per_rank.get(culprit, 0.0) + own[culprit]
        return _what_if(issue, CAUSE_STRAGGLER_WAIT, BASIS_MEDIAN, now, now - gap, lost_ms,
                        None if lost is None else self.device_hours(per_rank))

    def _share_what_if(self, issue: DiagnosisIssue) -> WhatIf | None:
        metric = _METRIC_OF_SHARE_KIND[issue.kind]
        index = self._index()
        ranks = [r for r in issue.evidence.get("cohort_ranks") or () if r in index]
        if not ranks:
            return None
        values = np.nan_to_num(self.matrix(metric)[:, [index[r] for r in ranks]], nan=0.0)
        col = self.ctx.column(metric)
        per_rank = {r: float(col.get(r, 0.0)) * self.n for r in ranks}
        now = self.job_series()
        return _what_if(issue, _CAUSE_OF_KIND[issue.kind], BASIS_REMOVED, now, now - np.median(values, axis=1),
                        sum(per_rank.values()), self.device_hours(per_rank))

    def _collective_what_if(self, issue: DiagnosisIssue, totals) -> WhatIf | None:
        waits = self.matrix(METRIC_COLLECTIVE_WAIT)
        if np.isnan(waits).any():
            return None
        lost = totals.get(CAUSE_COMMUNICATION)
        now = self.job_series()
        return _what_if(issue, CAUSE_COMMUNICATION, BASIS_REMOVED, now, now - waits.min(axis=1),
                        None if lost is None else sum(lost.values()),
                        None if lost is None else self.device_hours(lost))

    def _drift_what_if(self, issue: DiagnosisIssue) -> WhatIf | None:
        split = int(issue.evidence.get("steps_before") or 0)
        if not 0 < split < self.n:
            return None
        matrix = self.matrix(self.basis)
        index = self._index()
        if issue.culprit_rank is None:
            series, scope = np.median(matrix, axis=1), list(range(len(self.cohort)))
        else:
            series, scope = matrix[:, index[issue.culprit_rank]], [index[issue.culprit_rank]]
        before, after = series[:split], series[split:]
        now, best = float(np.median(after)), float(np.median(before))
        excess = {self.cohort[i]: max(0.0, float(np.sum(matrix[split:, i] - np.median(matrix[:split, i]))))
                  for i in scope}
        return _interval(issue, CAUSE_DRIFT, BASIS_BEST_WINDOW, now, best,
                         *(float(q) for q in np.percentile(before, SPREAD_PERCENTILES)),
                         sum(excess.values()), self.device_hours(excess))


def _what_if(issue: DiagnosisIssue, cause: str | None, basis: str, now: np.ndarray, predicted: np.ndarray,
             lost_ms: float | None, device_hours: float | None) -> WhatIf | None:
    """Step time now (mean over the window's steps) and predicted (mean of the per-step
    predictions), with the 10th to 90th percentile of the per-step predictions as the interval."""
    if now.size == 0 or np.isnan(now).any() or np.isnan(predicted).any():
        return None
    low, high = np.percentile(predicted, SPREAD_PERCENTILES)
    return _interval(issue, cause, basis, float(now.mean()), float(predicted.mean()), float(low), float(high),
                     lost_ms, device_hours)


def _interval(issue: DiagnosisIssue, cause: str | None, basis: str, now: float, predicted: float,
              low: float, high: float, lost_ms: float | None, device_hours: float | None) -> WhatIf | None:
    if not (now > 0 and predicted > 0 and math.isfinite(now) and math.isfinite(predicted)):
        return None
    fast, slow = min(low, predicted), max(high, predicted)  # the interval holds the point
    if not fast > 0:
        fast = predicted
    return WhatIf(kind=issue.kind, cause=cause, culprit_rank=issue.culprit_rank, basis=basis,
                  step_time_ms=now, predicted_step_time_ms=predicted, speedup=now / predicted,
                  speedup_low=now / slow, speedup_high=now / fast,
                  rank_seconds=None if lost_ms is None else lost_ms / MS_PER_SECOND, device_hours=device_hours)


def window_ledger(window: StepTimeWindow, diagnosis: StepTimeDiagnosis, resources=None, *,
                  policy: DiagnosisPolicy = DEFAULT_POLICY) -> WindowLedger:
    """The ledger of one analysed window with its diagnosis (and the run's `ResourceWindow`, whose
    GPU identities say which ranks' time is device time). Pure: same inputs, same ledger."""
    if window.is_empty:
        return empty_ledger(window)
    return _Ledger(window, diagnosis, resources, policy).build()


# --- The run ledger ---------------------------------------------------------------------------


def restart_loss(spans: Sequence[AttemptSpan], redone: Mapping[int, tuple[int, float]]) -> RestartLoss:
    """Rank-time lost to restarts from the run's attempts (oldest first) and, per earlier attempt,
    the (rank, step) cells and summed seconds of its steps at or after the next attempt's first
    step id (`redone`, read by `store_read.read_attempt_steps_from`): the next attempt did them
    again. Downtime: from an attempt's last step end to the next attempt's first step start, on
    every rank of the next attempt."""
    if len(spans) < 2:
        return RestartLoss(attempts=len(spans) or 1, redone_steps=0, redone_rank_seconds=0.0,
                           downtime_s=0.0, downtime_rank_seconds=0.0)
    cells, seconds, down, down_rank = 0, 0.0, 0.0, 0.0
    for earlier, later in zip(spans, spans[1:]):
        count, took = redone.get(earlier.attempt, (0, 0.0))
        cells += int(count)
        seconds += float(took)
        if earlier.last_end is not None and later.first_start is not None and later.first_start > earlier.last_end:
            gap = later.first_start - earlier.last_end
            down += gap
            down_rank += gap * later.ranks
    return RestartLoss(attempts=len(spans), redone_steps=cells, redone_rank_seconds=seconds,
                       downtime_s=down, downtime_rank_seconds=down_rank)


def run_ledger(ledger: WindowLedger, *, first_step_stored: int | None = None,
               restarts: RestartLoss | None = None) -> RunLedger:
    """The window's ledger over the run so far: each window cause scaled by the run's steps (its
    current attempt, from `first_step_stored` to the window's last step) over the window's, and
    the restarts (whole-run facts, not scaled). The scaling assumes the window is representative
    of the steps before it (the summary's window is the whole run up to 10,000 steps)."""
    run_steps: int | None = ledger.steps or None
    if first_step_stored is not None and ledger.last_step is not None and ledger.last_step >= first_step_stored:
        run_steps = max(ledger.steps, ledger.last_step - first_step_stored + 1)
    scale = None if not ledger.steps or run_steps is None else run_steps / ledger.steps
    causes: dict[str, CauseLoss] = {}
    for cause in WINDOW_CAUSES:
        c = ledger.causes[cause]
        causes[cause] = CauseLoss(
            cause, None if c.rank_seconds is None or scale is None else c.rank_seconds * scale,
            device_hours=None if c.device_hours is None or scale is None else c.device_hours * scale,
            share=c.share, ranks=c.ranks, worst_rank=c.worst_rank, culprit_rank=c.culprit_rank)
    if restarts is None:
        causes[CAUSE_RESTARTS] = CauseLoss(CAUSE_RESTARTS, None)
    else:
        device = None
        if ledger.devices_known and ledger.ranks:
            device = restarts.rank_seconds * ledger.devices_known / ledger.ranks / SECONDS_PER_HOUR
        window_s = ledger.window_rank_seconds
        causes[CAUSE_RESTARTS] = CauseLoss(
            CAUSE_RESTARTS, restarts.rank_seconds, device_hours=device,
            share=None if window_s is None or scale is None else finite_ratio(restarts.rank_seconds, window_s * scale),
            ranks=ledger.ranks if restarts.rank_seconds > 0 else 0)
    measured = [c for c in causes.values() if c.rank_seconds is not None]
    devices = [c.device_hours for c in measured if c.device_hours is not None]
    return RunLedger(run_id=ledger.run_id, window=ledger, run_steps=run_steps, scale=scale, causes=causes,
                     total_rank_seconds=sum(c.rank_seconds for c in measured) if measured else None,
                     total_device_hours=sum(devices) if ledger.devices_known and devices else None,
                     devices_known=ledger.devices_known, restarts=restarts)


def run_ledger_from(analysis, telemetry) -> RunLedger | None:
    """The run ledger of an analysis (its `ledger`, the window's) and the run's `RunTelemetry`
    (its first stored step; its restarts when they were read): what the final summary, the web
    view and the report show. None when the analysis carries no ledger."""
    ledger = getattr(analysis, "ledger", None)
    if not isinstance(ledger, WindowLedger):
        return None
    redone = getattr(telemetry, "redone_steps", None)
    restarts = None if redone is None else restart_loss(tuple(telemetry.attempt_spans), redone)
    return run_ledger(ledger, first_step_stored=getattr(telemetry, "first_step_stored", None), restarts=restarts)


def build_run_ledger(db_path: str | Path, run_id: str) -> RunLedger:
    """A stored run's ledger, read as its final summary reads it (summary profile, restarts from
    the attempt tables): for a caller that holds no summary (a cross-run record at a run's end)."""
    from traceml.processor.step_time.pipeline import PROFILE_SUMMARY, StepTimePipeline, StepTimeRequest
    from traceml.processor.store_read import read_run_facts

    analysis = StepTimePipeline().run(StepTimeRequest(db_path, run_id, profile=PROFILE_SUMMARY))
    _, telemetry = read_run_facts(db_path, run_id, latest_memory=False, count_stored=False)
    ledger = analysis.ledger if isinstance(analysis.ledger, WindowLedger) else window_ledger(
        analysis.window, analysis.diagnosis, analysis.resources)
    return run_ledger(ledger, first_step_stored=telemetry.first_step_stored,
                      restarts=run_restarts(db_path, run_id))


def run_restarts(db_path: str | Path, run_id: str) -> RestartLoss | None:
    """The run's restart loss from its store (None when the store cannot be read)."""
    from traceml.processor.store_read import read_run_restarts

    facts = read_run_restarts(db_path, run_id)
    if facts is None:
        return None
    spans, redone = facts
    return restart_loss(spans, redone)


__all__ = [
    "AttemptSpan", "BASIS_BEST_WINDOW", "BASIS_MEDIAN", "BASIS_REMOVED", "CauseLoss", "LEDGER_CAUSES",
    "NO_RESTARTS", "RestartLoss", "RunLedger", "WHAT_IF_BASES", "WhatIf", "WindowLedger", "build_run_ledger",
    "empty_ledger", "restart_loss", "run_ledger", "run_ledger_from", "run_restarts", "window_ledger",
]
