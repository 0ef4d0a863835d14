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
from traceml.schema.vocabulary import METRIC_STEP_TIME, STRATEGY_FSDP


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

    def values(self, rank: int) -> StepTimeValues:
        return self.window.rank_facts[rank].average

    def share(self, metric: str) -> ShareFacts | None:
        """median(metric) / median(step_time) over the ranks carrying both; None if undefined."""
        key = ("share", metric)
        if key not in self._memo:
            self._memo[key] = self._share(metric)
        return self._memo[key]

    def _share(self, metric: str) -> ShareFacts | None:
        left_out = set(self.excluded.get(metric, ()))
        cohort = tuple(r for r in self.cohort((metric, METRIC_STEP_TIME)) if r not in left_out)
        if not cohort:
            return None
        col, steps = self.column(metric), self.column(METRIC_STEP_TIME)
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

