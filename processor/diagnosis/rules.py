"""Share rules (input, H2D, residual), compute-bound, and the gate issues.

Each rule returns one `DiagnosisIssue` or None; ordering happens in `api.py`.
"""
from __future__ import annotations

import numpy as np

from traceml.processor.diagnosis.context import RuleContext, ShareFacts
from traceml.processor.step_time.analysis import rank_step_matrix
from traceml.processor.step_time.model import CLOCK_GPU, DiagnosisIssue, finite_ratio
from traceml.schema.diagnosis import (
    BALANCED,
    COLLECTIVE_BOUND,
    COMPUTE_BOUND,
    H2D_BOUND,
    INCOMPLETE_DATA,
    INPUT_BOUND,
    RESIDUAL_HEAVY,
    SEVERITY_CRIT,
    SEVERITY_INFO,
    SEVERITY_WARN,
    STATUS_BALANCED,
    STATUS_INCOMPLETE,
    STATUS_WARMUP,
    WARMUP,
)
from traceml.schema.vocabulary import (
    METRIC_COLLECTIVE_WAIT,
    METRIC_BACKWARD,
    METRIC_COMPUTE,
    METRIC_FORWARD,
    METRIC_H2D,
    METRIC_INPUT_WAIT,
    METRIC_RESIDUAL,
    METRIC_STEP_TIME,
    METRIC_TRACED_STEP_TIME,
    REQUIRED_METRICS,
)

OVERHEAD_METRICS: tuple[str, ...] = (METRIC_INPUT_WAIT, METRIC_H2D, METRIC_RESIDUAL, METRIC_COLLECTIVE_WAIT)
"""Shares that, at or above the warn threshold, rule out COMPUTE_BOUND (collective wait
included: under DDP it lies inside backward, so it would pass for compute)."""

_STEP_WORD = {METRIC_STEP_TIME: "step", METRIC_TRACED_STEP_TIME: "traced step"}
"""How a summary names the step duration it divided by (`RuleContext.step_basis`)."""

_SHARE_WORDING = {
    INPUT_BOUND: "waiting on input",
    H2D_BOUND: "in host-to-device copies",
    RESIDUAL_HEAVY: "outside every timed phase (unattributed)",
}


def _share_issue(ctx: RuleContext, kind: str, facts: ShareFacts | None) -> DiagnosisIssue | None:
    if facts is None:
        return None
    uncapped = ctx.policy.severity_for(facts.share)
    if uncapped is None:
        return None
    if facts.median_ms < ctx.policy.phase_floor_ms:
        return None
    severity, caps = ctx.capped(uncapped)
    evidence = {
        **ctx.common_evidence(),
        "metric": facts.metric,
        "share": facts.share,
        "median_ms": facts.median_ms,
        "step_time_median_ms": facts.step_time_median_ms,
        "worst_rank": facts.worst_rank,
        "worst_ms": facts.worst_ms,
        "cohort_ranks": list(facts.cohort),
        "excluded_ranks": list(facts.excluded),
        "warn_threshold": ctx.policy.warn_share,
        "crit_threshold": ctx.policy.crit_share,
        "uncapped_severity": uncapped,
        "severity_caps": caps,
        **ctx.basis_evidence(facts.basis),
    }
    summary = (
        f"{facts.share:.0%} of the median {_STEP_WORD[facts.basis]} ({facts.median_ms:.1f} of "
        f"{facts.step_time_median_ms:.1f} ms) is spent {_SHARE_WORDING[kind]}"
    )
    return DiagnosisIssue(kind=kind, severity=severity, status=ctx.status, score=facts.share,
                          summary=summary, evidence=evidence)


def overhead_share(ctx: RuleContext, metric: str) -> ShareFacts | None:
    """A metric's share for the rules: Input Wait's of Step Time (which holds it; None where
    Input Wait was not measured), every other metric's of the window's step basis."""
    return ctx.share(metric, METRIC_STEP_TIME if metric == METRIC_INPUT_WAIT else None)


def input_bound(ctx: RuleContext) -> DiagnosisIssue | None:
    return _share_issue(ctx, INPUT_BOUND, overhead_share(ctx, METRIC_INPUT_WAIT))


def h2d_bound(ctx: RuleContext) -> DiagnosisIssue | None:
    """GPU clock only: on the CPU clock an asynchronous copy's launch time says nothing."""
    if ctx.window.clock != CLOCK_GPU:
        return None
    return _share_issue(ctx, H2D_BOUND, ctx.share(METRIC_H2D))


def residual_heavy(ctx: RuleContext) -> DiagnosisIssue | None:
    return _share_issue(ctx, RESIDUAL_HEAVY, ctx.share(METRIC_RESIDUAL))


def compute_bound(ctx: RuleContext) -> DiagnosisIssue | None:
    """Information, not a problem: nearly all of the step is compute and no overhead stands out."""
    facts = ctx.share(METRIC_COMPUTE)
    if facts is None or not ctx.policy.at_least(facts.share, ctx.policy.compute_bound_share):
        return None
    overhead: dict[str, float | None] = {}
    for metric in OVERHEAD_METRICS:
        other = overhead_share(ctx, metric)
        overhead[metric] = None if other is None else other.share
        if other is not None and ctx.policy.at_least(other.share, ctx.policy.warn_share):
            return None
    evidence = {
        **ctx.common_evidence(),
        "metric": METRIC_COMPUTE,
        "share": facts.share,
        "median_ms": facts.median_ms,
        "step_time_median_ms": facts.step_time_median_ms,
        "cohort_ranks": list(facts.cohort),
        "threshold": ctx.policy.compute_bound_share,
        "overhead_shares": overhead,
        **ctx.basis_evidence(facts.basis),
    }
    summary = f"compute is {facts.share:.0%} of the median {_STEP_WORD[facts.basis]}; no overhead reaches {ctx.policy.warn_share:.0%}"
    return DiagnosisIssue(kind=COMPUTE_BOUND, severity=SEVERITY_INFO, status=ctx.status, score=None,
                          summary=summary, evidence=evidence)


def collective_bound(ctx: RuleContext) -> DiagnosisIssue | None:
    """Every rank waits a large share of its step in collectives: communication, not a straggler.

    Judged, step by step, on the rank that waited *least* in that step: whatever another
    rank waited beyond it is waiting for a later rank (a straggler's doing, or jitter that
    makes a different rank late each step), the least wait is what even the rank nobody
    waited for spent in collectives, so no late rank explains it. Score = the smaller of the
    median over the window's steps of that least share (wait / Step Time), which outlier steps
    cannot move, and the same shares weighted by time (the least-waiting rank's waits summed
    over the steps over its step times summed), which a run of two halves cannot move: with
    half its steps at 0.35 and half at 0.02 the median lands on either side of the threshold
    run by run, the time-weighted share does not. Where per-step values are missing, the
    window averages stand in (the rank with the least average share).
    """
    basis = ctx.step_basis
    cohort = ctx.cohort((METRIC_COLLECTIVE_WAIT, basis))
    if not cohort:
        return None
    waits, steps = ctx.column(METRIC_COLLECTIVE_WAIT), ctx.column(basis)
    shares = {r: finite_ratio(waits[r], steps[r]) for r in cohort}
    if any(v is None for v in shares.values()):
        return None
    least = min(cohort, key=lambda r: (shares[r], r))
    per_step = _least_shares(ctx, cohort, basis)
    median_share, weighted_share = per_step if per_step is not None else (shares[least], shares[least])
    score = min(median_share, weighted_share)
    policy = ctx.policy
    if policy.at_least(score, policy.collective_crit_share):
        uncapped = SEVERITY_CRIT
    elif policy.at_least(score, policy.collective_warn_share):
        uncapped = SEVERITY_WARN
    else:
        return None
    severity, caps = ctx.capped(uncapped)
    most = max(cohort, key=lambda r: (shares[r], -r))
    evidence = {
        **ctx.common_evidence(),
        "metric": METRIC_COLLECTIVE_WAIT,
        "share": score,
        "share_statistic": "the smaller of the median and the time-weighted least share over steps",
        "median_least_share": median_share,
        "time_weighted_least_share": weighted_share,
        "least_wait_rank": least,
        "least_wait_ms": waits[least],
        "least_wait_step_time_ms": steps[least],
        "most_wait_rank": most,
        "most_wait_share": shares[most],
        "rank_shares": {str(r): shares[r] for r in cohort},
        "cohort_ranks": list(cohort),
        "warn_threshold": policy.collective_warn_share,
        "crit_threshold": policy.collective_crit_share,
        "uncapped_severity": uncapped,
        "severity_caps": caps,
        **ctx.basis_evidence(basis),
    }
    summary = (f"every rank waits in collectives for at least {score:.0%} of its step, even the rank "
               f"nobody waited for (median step; rank {least} on average: {waits[least]:.1f} of "
               f"{steps[least]:.1f} ms), more than a late rank explains: communication-bound")
    return DiagnosisIssue(kind=COLLECTIVE_BOUND, severity=severity, status=ctx.status, score=score,
                          summary=summary, evidence=evidence)


def _least_shares(ctx: RuleContext, cohort: tuple[int, ...], basis: str) -> tuple[float, float] | None:
    """Per aligned step, the smallest collective-wait share among `cohort`: (its median over the
    steps, the time-weighted one: those ranks' waits summed over their step times summed)."""
    facts = [ctx.window.rank_facts[r] for r in cohort]
    waits, steps = rank_step_matrix(facts, METRIC_COLLECTIVE_WAIT), rank_step_matrix(facts, basis)
    if not waits.size or waits.shape != steps.shape or np.isnan(waits).any() or np.isnan(steps).any() \
            or (steps <= 0).any():
        return None
    shares = waits / steps
    least = np.argmin(shares, axis=1)
    rows = np.arange(shares.shape[0])
    weighted = finite_ratio(float(waits[rows, least].sum()), float(steps[rows, least].sum()))
    median = float(np.median(shares[rows, least]))
    return median, (median if weighted is None else weighted)


def warmup(ctx: RuleContext) -> DiagnosisIssue | None:
    if ctx.step_count >= ctx.policy.min_steps:
        return None
    evidence = {**ctx.common_evidence(), "min_steps": ctx.policy.min_steps}
    summary = f"warming up: {ctx.step_count} aligned step(s), {ctx.policy.min_steps} needed"
    return DiagnosisIssue(kind=WARMUP, severity=SEVERITY_INFO, status=STATUS_WARMUP, score=None,
                          summary=summary, evidence=evidence)


def signal_coverage(ctx: RuleContext) -> dict[str, tuple[int, int]]:
    """(measured ranks, expected ranks) per required signal, as the analyzer counted them."""
    expected = len(ctx.window.expected_ranks)
    out: dict[str, tuple[int, int]] = {}
    for metric in REQUIRED_METRICS:
        coverage = ctx.window.coverage.get(metric)
        if coverage is None:
            measured = sum(1 for f in ctx.window.rank_facts.values() if f.average.get(metric) is not None)
            coverage = (measured, expected)
        out[metric] = (int(coverage[0]), int(coverage[1]))
    return out


UNREACHABLE: dict[str, str] = {
    METRIC_INPUT_WAIT: "the input-bound share, an input straggler's attribution and Step Time "
                       "(the other rules divide by the traced step)",
    METRIC_FORWARD: "compute, residual and a compute straggler",
    METRIC_BACKWARD: "compute, residual and the visible-phase straggler",
    METRIC_TRACED_STEP_TIME: "every share, straggler and drift (no step duration)",
}
"""What a required signal measured by no rank leaves out of reach (docs/DIAGNOSIS.md)."""

REMEDY: dict[str, str] = {
    METRIC_INPUT_WAIT: "time the batch fetch: `with traceml.timed_input(): batch = get_batch()` "
                       "(or iterate `traceml.wrap_dataloader(batches)`)",
    METRIC_FORWARD: "time the model: `traceml.wrap_forward(model)` (or `with traceml.trace_step(model):`)",
    METRIC_BACKWARD: "time backward: `with traceml.timed_backward(): loss.backward()`",
    METRIC_TRACED_STEP_TIME: "mark each step: `with traceml.trace_step(model):`",
}
"""The one-line fix for each signal, said once, in the INCOMPLETE_DATA finding."""


def incomplete_data(ctx: RuleContext) -> DiagnosisIssue | None:
    """A required signal measured by no rank: say which findings that puts out of reach and the
    one-line fix. The rules that do not need it have run on what was measured and stand beside
    this issue; it is not a verdict on the run."""
    coverage = signal_coverage(ctx)
    missing = [m for m, (measured, expected) in coverage.items() if measured == 0 and expected > 0]
    if not missing:
        return None
    evidence = {
        **ctx.common_evidence(),
        "missing_signals": missing,
        "signal_coverage": {m: f"{measured}/{expected}" for m, (measured, expected) in coverage.items()},
        "unreachable": {m: UNREACHABLE[m] for m in missing},
        "what_to_do": {m: REMEDY[m] for m in missing},
    }
    summary = "; ".join(f"no rank measured {m}, so {UNREACHABLE[m]} cannot be judged: {REMEDY[m]}"
                        for m in missing)
    return DiagnosisIssue(kind=INCOMPLETE_DATA, severity=SEVERITY_WARN, status=STATUS_INCOMPLETE,
                          score=None, summary=summary, evidence=evidence)


def balanced(ctx: RuleContext) -> DiagnosisIssue:
    shares = {}
    for metric in (*OVERHEAD_METRICS, METRIC_COMPUTE):
        facts = overhead_share(ctx, metric)
        shares[metric] = None if facts is None else facts.share
    evidence = {**ctx.common_evidence(), "shares": shares, **ctx.basis_evidence()}
    return DiagnosisIssue(kind=BALANCED, severity=SEVERITY_INFO, status=STATUS_BALANCED, score=None,
                          summary="no bottleneck or straggler crosses a threshold", evidence=evidence)
