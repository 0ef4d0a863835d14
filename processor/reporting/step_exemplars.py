"""Which step a re-exported series stands for, and the counters that carry it on /metrics.

A dashboard point or an alert on step time says "slow"; the exemplar says "this step":
the trace and span id of the window's worst step, so a click leads to that step's span
(and its phase spans) in the user's trace backend. Per Step Time metric the worst step is
the (rank, step) cell of the window with the largest value (for step time, the slowest
step any rank took); its ids are the ones the step span carried (stored at intake).

OpenMetrics allows exemplars on counters and histogram buckets only, and Prometheus
refuses a whole scrape that puts one on a gauge. So the window's gauges carry the
exemplar on the OTLP push only, and two counters carry it on /metrics:
`traceml.run.steps` (aligned steps counted) and `traceml.run.metric.time` (per metric,
the per-step median over ranks summed over those steps; `rate(time) / rate(steps)` is
the mean per step over any range). They are counted here from the live windows: each
refresh adds the aligned steps newer than the last one counted, so a step that left the
window between two refreshes (more than a window's worth of steps between two reads)
is not counted; the counters then run low, never double. A third counter,
`traceml.run.badput.time` per ledger cause, adds for each counted step the badput
ledger's rank-seconds per step over the window (`diagnosis.ledger`), and carries the
worst step too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from traceml.processor.step_time.analysis import rank_step_matrix
from traceml.processor.step_time.model import StepTimeWindow
from traceml.schema import vocabulary as v

EXEMPLAR_METRICS: tuple[str, ...] = (v.METRIC_STEP_TIME, v.METRIC_INPUT_WAIT, v.METRIC_H2D, v.METRIC_FORWARD,
                                     v.METRIC_BACKWARD, v.METRIC_OPTIMIZER_STEP, v.METRIC_COLLECTIVE_WAIT)
"""The Step Time metrics whose series stand for a step: step time and the phases."""


@dataclass(frozen=True, slots=True)
class WorstStep:
    """The window's worst (rank, step) cell of one metric: its value (ms) and end time."""

    rank: int
    step: int
    value_ms: float
    end_time: float | None  # unix seconds (the aligned step's median end); None when unknown


def worst_steps(window: StepTimeWindow, metrics=EXEMPLAR_METRICS) -> dict[str, WorstStep]:
    """Per metric measured in the window, its largest (rank, step) cell (ties: the earliest step,
    then the lowest rank); one numpy pass over the window's own arrays per metric."""
    # A rank whose steps do not line up with the window's aligned steps (a rank that joined
    # late, say) has no cell of an aligned step to offer.
    facts = [f for r in sorted(window.rank_facts) if len((f := window.rank_facts[r]).steps) == len(window.steps)]
    if not facts or not window.steps:
        return {}
    out: dict[str, WorstStep] = {}
    for metric in metrics:
        matrix = rank_step_matrix(facts, metric)  # (steps, ranks), NaN = unmeasured
        if matrix.size == 0 or matrix.shape[0] != len(window.steps) or np.isnan(matrix).all():
            continue
        flat = int(np.nanargmax(matrix))
        i, r = divmod(flat, matrix.shape[1])
        end = window.step_end_times[i] if i < len(window.step_end_times) else math.nan
        out[metric] = WorstStep(facts[r].rank, int(window.steps[i]), float(matrix[i, r]),
                                None if end != end else float(end))
    return out


@dataclass(frozen=True)
class StepTotals:
    """The two counters of one run: aligned steps counted, and per metric the summed per-step
    median (ms), through `last_step`."""

    last_step: int | None = None
    steps: int = 0
    metric_ms: Mapping[str, float] = field(default_factory=dict)
    lost_s: Mapping[str, float] = field(default_factory=dict)  # badput cause -> rank-seconds


def advance(totals: StepTotals, window: StepTimeWindow, metrics=EXEMPLAR_METRICS, ledger=None) -> StepTotals:
    """`totals` with the window's aligned steps newer than `totals.last_step` added; with the
    window's badput `ledger` (`diagnosis.ledger.WindowLedger`), each new step adds each cause's
    rank-seconds per step over the window (the ledger's figure, spread evenly: not a per-step
    measurement)."""
    if not window.steps:
        return totals
    last = -1 if totals.last_step is None else totals.last_step
    new = [i for i, step in enumerate(window.steps) if step > last]
    if not new:
        return totals
    sums = dict(totals.metric_ms)
    for metric in metrics:
        stats = window.metrics.get(metric)
        if stats is None:
            continue
        series = stats.series
        added = [series[i] for i in new]
        known = [x for x in added if x is not None and math.isfinite(x)]
        if known:
            sums[metric] = sums.get(metric, 0.0) + float(sum(known))
    lost = dict(totals.lost_s)
    if ledger is not None and ledger.steps:
        for cause, loss in ledger.causes.items():
            if loss.rank_seconds is not None and math.isfinite(loss.rank_seconds):
                lost[cause] = lost.get(cause, 0.0) + loss.rank_seconds / ledger.steps * len(new)
    return StepTotals(last_step=int(window.steps[new[-1]]), steps=totals.steps + len(new), metric_ms=sums,
                      lost_s=lost)


__all__ = ["EXEMPLAR_METRICS", "StepTotals", "WorstStep", "advance", "worst_steps"]
