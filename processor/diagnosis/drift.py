"""Drift over time: a rank, or the whole job, slower than its own earlier steps.

Cross-rank rules compare ranks with each other, so a job whose every rank slows
down alike (thermal throttling, a growing dataloader cache miss, a leak) looks
balanced. This rule compares each series with its own past, inside the window:

- the series is Step Time per aligned step, per rank and, for the job, the median
  over the ranks at each step;
- one change point splits it: the step index that minimises the two segments'
  squared error (each segment at least `drift_min_segment` steps);
- drift = median(after) / median(before) - 1; warn at `drift_warn`, crit at
  `drift_crit` (then the usual caps). Only a slowdown counts: getting faster
  after warm-up is not a problem.

The job finding comes first: when the job median drifts, the ranks drift alike
and one issue (no culprit) says so. Otherwise the rank that drifted most is
named. The evidence says the step where it began and which phase grew.
"""
from __future__ import annotations

import numpy as np

from traceml.processor.diagnosis.context import RuleContext
from traceml.processor.step_time.analysis import rank_step_matrix
from traceml.processor.step_time.model import DiagnosisIssue
from traceml.schema.diagnosis import SEVERITY_CRIT, SEVERITY_WARN, STEP_TIME_DRIFT
from traceml.schema.vocabulary import (
    METRIC_BACKWARD,
    METRIC_COLLECTIVE_WAIT,
    METRIC_FORWARD,
    METRIC_H2D,
    METRIC_INPUT_WAIT,
    METRIC_OPTIMIZER_STEP,
    METRIC_RESIDUAL,
    METRIC_STEP_TIME,
)

GROWTH_PHASES: tuple[str, ...] = (METRIC_INPUT_WAIT, METRIC_H2D, METRIC_FORWARD, METRIC_BACKWARD,
                                  METRIC_OPTIMIZER_STEP, METRIC_COLLECTIVE_WAIT, METRIC_RESIDUAL)


def change_points(matrix: np.ndarray, min_segment: int) -> np.ndarray:
    """Per column of a (steps, series) array without NaN: the index k (min_segment <= k <=
    steps - min_segment) splitting it into x[:k], x[k:] with the least total squared error."""
    t = matrix.shape[0]
    c1 = np.vstack([np.zeros((1, matrix.shape[1])), np.cumsum(matrix, axis=0)])
    c2 = np.vstack([np.zeros((1, matrix.shape[1])), np.cumsum(matrix * matrix, axis=0)])
    k = np.arange(min_segment, t - min_segment + 1)[:, None]
    left = c2[k[:, 0]] - c1[k[:, 0]] ** 2 / k
    right = (c2[t] - c2[k[:, 0]]) - (c1[t] - c1[k[:, 0]]) ** 2 / (t - k)
    return k[np.argmin(left + right, axis=0), 0]


def _drift(series: np.ndarray, split: int) -> float | None:
    before, after = float(np.median(series[:split])), float(np.median(series[split:]))
    if before <= 0:
        return None
    return after / before - 1.0


def step_time_drift(ctx: RuleContext) -> DiagnosisIssue | None:
    policy = ctx.policy
    steps = ctx.window.steps
    if len(steps) < 2 * policy.drift_min_segment:
        return None
    basis = ctx.step_basis
    cohort = ctx.cohort((basis,))
    if not cohort:
        return None
    facts = [ctx.window.rank_facts[r] for r in cohort]
    matrix = rank_step_matrix(facts, basis)
    if matrix.shape[0] != len(steps) or np.isnan(matrix).any():
        return None
    job = np.median(matrix, axis=1)
    series = np.column_stack([job, matrix])  # column 0: the job, then each rank
    splits = change_points(series, policy.drift_min_segment)
    drifts = [_drift(series[:, i], int(splits[i])) for i in range(series.shape[1])]
    column = 0
    if drifts[0] is None or not policy.at_least(drifts[0], policy.drift_warn):
        ranked = [(d, -i) for i, d in enumerate(drifts) if i and d is not None]
        if not ranked:
            return None
        best, neg = max(ranked)
        column = -neg
        if not policy.at_least(best, policy.drift_warn):
            return None
    drift, split = float(drifts[column]), int(splits[column])
    uncapped = SEVERITY_CRIT if policy.at_least(drift, policy.drift_crit) else SEVERITY_WARN
    severity, caps = ctx.capped(uncapped)
    rank = None if column == 0 else cohort[column - 1]
    subjects = facts if rank is None else [ctx.window.rank_facts[rank]]
    growth: dict[str, float | None] = {}
    for phase in GROWTH_PHASES:
        values = rank_step_matrix(subjects, phase)
        per_step = np.median(values, axis=1) if not np.isnan(values).any() else None
        growth[phase] = (None if per_step is None
                         else float(np.median(per_step[split:]) - np.median(per_step[:split])))
    known = [(v, p) for p, v in growth.items() if v is not None]
    grown = max(known)[1] if known and max(known)[0] > 0 else None
    drifting = [cohort[i - 1] for i, d in enumerate(drifts) if i and d is not None
                and policy.at_least(d, policy.drift_warn)]
    before = float(np.median(series[:split, column]))
    after = float(np.median(series[split:, column]))
    who = "the job (every rank alike)" if rank is None else f"rank {rank}"
    summary = (f"{who} became {drift:.0%} slower from step {steps[split]} on "
               f"({before:.1f} -> {after:.1f} ms median {'step' if basis == METRIC_STEP_TIME else 'traced step'})"
               + (f"; {grown} grew most ({growth[grown]:+.1f} ms)" if grown else ""))
    evidence = {
        **ctx.common_evidence(),
        "scope": "job" if rank is None else "rank",
        "onset_step": steps[split],
        "steps_before": split,
        "steps_after": len(steps) - split,
        "before_ms": before,
        "after_ms": after,
        "drift": drift,
        "phase_growth_ms": growth,
        "grown_phase": grown,
        "drifting_ranks": drifting,
        "cohort_ranks": list(cohort),
        "warn_threshold": policy.drift_warn,
        "crit_threshold": policy.drift_crit,
        "min_segment": policy.drift_min_segment,
        "uncapped_severity": uncapped,
        "severity_caps": caps,
        **ctx.basis_evidence(basis),
    }
    return DiagnosisIssue(kind=STEP_TIME_DRIFT, severity=severity, status=ctx.status, score=drift,
                          summary=summary, culprit_rank=rank, evidence=evidence)


__all__ = ["GROWTH_PHASES", "change_points", "step_time_drift"]
