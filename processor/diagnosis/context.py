"""What every rule reads from a window: rule cohorts, cohort shares, severity caps.

A rule only looks at ranks that carry every metric it needs (its cohort); it
never invents values for a rank that did not measure them.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from traceml.processor.diagnosis.policy import DiagnosisPolicy
from traceml.processor.step_time.model import StepTimeValues, StepTimeWindow
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


@dataclass(frozen=True)
class RuleContext:
    window: StepTimeWindow
    policy: DiagnosisPolicy

    @property
    def step_count(self) -> int:
        return self.window.step_count

    @property
    def is_fsdp(self) -> bool:
        return (self.window.training_strategy or "").lower() == STRATEGY_FSDP

    def cohort(self, metrics: Sequence[str]) -> dict[int, StepTimeValues]:
        """Ranks (ascending) whose window average carries every one of `metrics`."""
        out: dict[int, StepTimeValues] = {}
        for rank in sorted(self.window.rank_facts):
            average = self.window.rank_facts[rank].average
            if all(average.get(m) is not None for m in metrics):
                out[int(rank)] = average
        return out

    def share(self, metric: str) -> ShareFacts | None:
        """median(metric) / median(step_time) over the ranks carrying both; None if undefined."""
        cohort = self.cohort((metric, METRIC_STEP_TIME))
        if not cohort:
            return None
        values = {rank: float(v.get(metric)) for rank, v in cohort.items()}
        step_median = float(statistics.median(float(v.get(METRIC_STEP_TIME)) for v in cohort.values()))
        if step_median <= 0.0:
            return None
        median = float(statistics.median(values.values()))
        worst_rank = max(values, key=lambda r: (values[r], -r))
        return ShareFacts(
            metric=metric,
            share=median / step_median,
            median_ms=median,
            step_time_median_ms=step_median,
            cohort=tuple(cohort),
            worst_rank=worst_rank,
            worst_ms=values[worst_rank],
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


def ratio_map(values: Mapping[str, float | None]) -> dict[str, float | None]:
    return {k: (None if v is None else float(v)) for k, v in values.items()}
