"""Hand-built `StepTimeWindow`s for rule tests: per-rank averages in, window out.

Statistics here are a plain-Python reference (statistics.median, max), not the
analyzer: diagnosis and presenters are tested on facts we state by hand.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Mapping

from traceml.processor.step_time.analysis import window_shares
from traceml.processor.step_time.model import (
    RankIdentity,
    StepTimeMetric,
    StepTimeRankFacts,
    StepTimeStepFacts,
    StepTimeValues,
    StepTimeWindow,
)

METRIC_FIELDS = tuple(f.name for f in dataclasses.fields(StepTimeValues))
_UNSET = object()


def rank_values(
    *,
    iw: float | None = 5.0,
    h2d: float | None = 5.0,
    fwd: float | None = 30.0,
    bwd: float | None = 45.0,
    opt: float | None = 10.0,
    traced: float | None = 95.0,
    clock: str = "gpu",
    cw: float | None = None,
) -> StepTimeValues:
    """One rank's averages with compute, residual and Step Time derived as the contract says."""
    compute = None
    if fwd is not None and bwd is not None and opt is not None:
        compute = fwd + bwd + opt
    residual = None
    if traced is not None and compute is not None:
        residual = max(0.0, traced - (h2d or 0.0) - compute - (cw or 0.0))
    step = None if iw is None or traced is None else iw + traced
    cpu_step = None if step is None else 2 * step
    return StepTimeValues(
        input_wait=iw, h2d=h2d, forward=fwd, backward=bwd, optimizer_step=opt,
        traced_step_time=traced, compute=compute, residual=residual, step_time=step,
        step_time_cpu=cpu_step if clock == "gpu" else step,
        step_time_gpu=step if clock == "gpu" else None,
        traced_step_time_cpu=None if traced is None else (2 * traced if clock == "gpu" else traced),
        traced_step_time_gpu=traced if clock == "gpu" else None,
        dataloader_fetch_cpu=None if iw is None else 2 * iw,
        collective_wait=cw,
    )


def _metric(name: str, values: Mapping[int, float], n_steps: int) -> StepTimeMetric:
    if not values:
        return StepTimeMetric(name, (None,) * n_steps, {}, None, None, None, None, None, None, None)
    median = statistics.median(values.values())
    rep = min(values, key=lambda r: (abs(values[r] - median), values[r], r))
    worst = worst_rank = skew = None  # a single rank has no cross-rank worst or skew
    if len(values) >= 2:
        worst_rank = max(values, key=lambda r: (values[r], -r))
        worst = values[worst_rank]
        skew = (worst - median) / median if median > 0 else None
    return StepTimeMetric(
        name=name,
        series=(median,) * n_steps,
        rank_values=dict(values),
        median=median,
        average=statistics.fmean(values.values()),
        worst=worst,
        worst_rank=worst_rank,
        skew=skew,
        representative_rank=rep,
        representative_value=values[rep],
    )


def window(
    ranks: Mapping[int, StepTimeValues | None],
    *,
    steps: int = 30,
    strategy: str = "ddp",
    clock: str | None = "gpu",
    run_id: str = "run-test",
) -> StepTimeWindow:
    """A window of `steps` identical aligned steps; a rank mapped to None is expected but silent
    (kept in rank_facts with no values and no steps, as the analyzer keeps it)."""
    step_ids = tuple(range(1, steps + 1))
    expected = tuple(sorted(ranks))
    facts = {}
    for r, avg in sorted(ranks.items()):
        facts[r] = StepTimeRankFacts(
            rank=r,
            identity=RankIdentity(global_rank=r, local_rank=r, node_rank=0, world_size=len(expected),
                                  local_world_size=len(expected), hostname="host-a"),
            average=avg or StepTimeValues(),
            steps=() if avg is None else tuple(StepTimeStepFacts(step=s, values=avg) for s in step_ids),
        )
    metrics = {}
    coverage = {}
    for name in METRIC_FIELDS:
        vals = {r: f.average.get(name) for r, f in facts.items() if f.average.get(name) is not None}
        metrics[name] = _metric(name, vals, steps)
        coverage[name] = (len(vals), len(expected))
    shares = window_shares(metrics)
    return StepTimeWindow(
        run_id=run_id,
        clock=clock if steps else None,
        steps=step_ids,
        expected_ranks=expected,
        rank_facts=facts,
        metrics=metrics,
        coverage=coverage,
        shares=shares,
        training_strategy=strategy,
    )
