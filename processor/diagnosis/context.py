"""What every rule reads from a window: rule cohorts, cohort shares, severity caps.

A rule only looks at ranks that carry every metric it needs (its cohort); it
never invents values for a rank that did not measure them.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from traceml.processor.diagnosis.policy import DiagnosisPolicy
from traceml.processor.step_time.model import StepTimeValues, StepTimeWindow, finite_ratio
from traceml.schema.diagnosis import (
    CAP_FSDP,
    CAP_SHORT_WINDOW,
    SEVERITY_CRIT,
    SEVERITY_WARN,
    STATUS_CONFIRMED,
    STATUS_PROVISIONAL,
)
from traceml.schema.vocabulary import METRIC_STEP_TIME, METRIC_TRACED_STEP_TIME, STRATEGY_FSDP


@dataclass(frozen=True)
class ShareFacts:
    """One metric's share of Step Time over the ranks measuring both."""

    metric: str
    share: float
    median_ms: float
    step_time_median_ms: float
    cohort: tuple[int, ...]
    worst_rank: int
    worst_ms: float
    excluded: tuple[int, ...] = ()
    basis: str = METRIC_STEP_TIME
    """The step duration divided by: `step_time`, or `traced_step_time` (`RuleContext.step_basis`)."""


@dataclass(frozen=True)
class RuleContext:
    window: StepTimeWindow
    policy: DiagnosisPolicy
    excluded: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """metric -> ranks a share rule leaves out: a straggler's culprit for the metric that
    explains it (an input straggler's own input wait is not the job's input problem)."""
    resources: object = None
    """The run's `ResourceWindow` over the same window, when the caller read one (else None: the
    resource rules then say nothing)."""
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def step_count(self) -> int:
        return self.window.step_count

    @property
    def is_fsdp(self) -> bool:
        return (self.window.training_strategy or "").lower() == STRATEGY_FSDP

    def column(self, metric: str) -> Mapping[int, float]:
        """rank -> window average of `metric`, measured ranks only (the analyzer's own map)."""
        key = ("column", metric)
        if key not in self._memo:
            stats = self.window.metrics.get(metric)
            if stats is not None:
                col = stats.rank_values  # measured ranks only, plain ints and floats
            else:
                col = {int(r): float(f.average.get(metric)) for r, f in self.window.rank_facts.items()
                       if f.average.get(metric) is not None}
            self._memo[key] = col
        return self._memo[key]

    def cohort(self, metrics: Sequence[str]) -> tuple[int, ...]:
        """Ranks (ascending) whose window average carries every one of `metrics`."""
        key = ("cohort", tuple(metrics))
        if key not in self._memo:
            ranks = set(self.column(metrics[0]))
            for m in metrics[1:]:
                ranks.intersection_update(self.column(m))
            self._memo[key] = tuple(sorted(ranks))
        return self._memo[key]

    @property
    def step_basis(self) -> str:
        """The step duration the rules that do not need input wait divide by (their cohort's
        Step Time): `step_time` (Input Wait + Traced Step Time) when every rank that measured its
        traced step also measured its input wait, else `traced_step_time` for every rank.

        Step Time needs Input Wait, and a loop that feeds its steps without a DataLoader (a
        generator, tensors it makes, a memory-mapped `get_batch`) under marked steps measures
        none: with Step Time as their only basis, the compute, H2D, residual, straggler,
        collective-bound and drift rules lost every rank for a phase none of them needs
        (issue 30). One basis for all ranks, never a mix: a rank's traced step beside another
        rank's Step Time would compare unlike durations."""
        key = ("step_basis",)
        if key not in self._memo:
            with_input = self.column(METRIC_STEP_TIME)
            traced = self.column(METRIC_TRACED_STEP_TIME)
            full = bool(with_input) and all(r in with_input for r in traced)
            self._memo[key] = METRIC_STEP_TIME if full else METRIC_TRACED_STEP_TIME
        return self._memo[key]

    def values(self, rank: int) -> StepTimeValues:
        return self.window.rank_facts[rank].average

    def share(self, metric: str, basis: str | None = None) -> ShareFacts | None:
        """median(metric) / median(step duration) over the ranks carrying both; None if undefined.

        The step duration is `basis`, by default `step_basis`: Input Wait's own share is always
        taken of Step Time (`basis=METRIC_STEP_TIME`), which it is part of."""
        basis = basis or self.step_basis
        key = ("share", metric, basis)
        if key not in self._memo:
            self._memo[key] = self._share(metric, basis)
        return self._memo[key]

    def _share(self, metric: str, basis: str) -> ShareFacts | None:
        left_out = set(self.excluded.get(metric, ()))
        cohort = tuple(r for r in self.cohort((metric, basis)) if r not in left_out)
        if not cohort:
            return None
        col, steps = self.column(metric), self.column(basis)
        step_median = float(statistics.median([steps[r] for r in cohort]))
        median = float(statistics.median([col[r] for r in cohort]))
        share = finite_ratio(median, step_median)
        if share is None:
            return None
        worst_rank = max(cohort, key=lambda r: (col[r], -r))
        return ShareFacts(
            metric=metric,
            share=share,
            median_ms=median,
            step_time_median_ms=step_median,
            cohort=cohort,
            worst_rank=worst_rank,
            worst_ms=col[worst_rank],
            excluded=tuple(sorted(left_out)),
            basis=basis,
        )

    def capped(self, severity: str) -> tuple[str, list[str]]:
        """Apply the short-window and FSDP caps; return the severity and the caps that applied."""
        caps: list[str] = []
        if severity == SEVERITY_CRIT:
            if self.step_count < self.policy.crit_min_steps:
                caps.append(CAP_SHORT_WINDOW)
            if self.is_fsdp:
                caps.append(CAP_FSDP)
        return (SEVERITY_WARN if caps else severity), caps

    @property
    def status(self) -> str:
        return STATUS_CONFIRMED if self.step_count >= self.policy.crit_min_steps else STATUS_PROVISIONAL

    def common_evidence(self) -> dict[str, object]:
        return {
            "steps": self.step_count,
            "clock": self.window.clock,
            "training_strategy": self.window.training_strategy,
        }

    def basis_evidence(self, basis: str | None = None) -> dict[str, object]:
        """The step duration a rule divided by, for its evidence (`step_basis`)."""
        return {"step_basis": basis or self.step_basis}

