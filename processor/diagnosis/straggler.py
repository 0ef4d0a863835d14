"""Rank straggler: one slow rank makes the others wait inside a collective.

The wait shows up in the *visible* phase, where the collective blocks: backward
under DDP (gradient all-reduce), forward plus backward under FSDP (parameter
all-gathers as well). The rank that arrives last waits least, so the culprit is
the rank with the least visible time; the victim is the upper-median rank
(`sorted[n // 2]`), a typical rank that waited. The gap between them, over the
victim's Step Time, is the score.
"""
from __future__ import annotations

from dataclasses import dataclass

from traceml.processor.diagnosis.context import RuleContext
from traceml.processor.step_time.model import DiagnosisIssue, StepTimeValues, finite_ratio
from traceml.schema.diagnosis import (
    COMPONENT_COMPUTE,
    COMPONENT_H2D,
    COMPONENT_INPUT_WAIT,
    COMPONENT_UNATTRIBUTED,
    COMPUTE_STRAGGLER,
    H2D_STRAGGLER,
    INPUT_STRAGGLER,
    STRAGGLER,
)
from traceml.schema.vocabulary import (
    METRIC_BACKWARD,
    METRIC_FORWARD,
    METRIC_STEP_TIME,
)

_KIND_BY_COMPONENT = {
    COMPONENT_INPUT_WAIT: INPUT_STRAGGLER,
    COMPONENT_H2D: H2D_STRAGGLER,
    COMPONENT_COMPUTE: COMPUTE_STRAGGLER,
}

_CAUSE_WORDING = {
    COMPONENT_INPUT_WAIT: "waits longer on input",
    COMPONENT_H2D: "spends longer in host-to-device copies",
    COMPONENT_COMPUTE: "computes longer outside the collective",
}


@dataclass(frozen=True)
class _Candidate:
    rank: int
    visible: float
    values: StepTimeValues


def visible_phases(ctx: RuleContext) -> tuple[str, ...]:
    return (METRIC_FORWARD, METRIC_BACKWARD) if ctx.is_fsdp else (METRIC_BACKWARD,)


def _excesses(ctx: RuleContext, culprit: StepTimeValues, victim: StepTimeValues) -> dict[str, float | None]:
    """How much longer the culprit spent than the victim in each candidate cause (ms).

    H2D and optimizer are occurrence-driven: absent means no work, so they count as 0.
    Compute excess is the compute outside the visible phase (forward + optimizer
    under DDP); under FSDP forward is itself visible, so no compute cause is tried.
    """
    out: dict[str, float | None] = {
        COMPONENT_INPUT_WAIT: (
            None if culprit.input_wait is None or victim.input_wait is None
            else float(culprit.input_wait) - float(victim.input_wait)
        ),
        COMPONENT_H2D: float(culprit.h2d or 0.0) - float(victim.h2d or 0.0),
        COMPONENT_COMPUTE: None,
    }
    if not ctx.is_fsdp and culprit.forward is not None and victim.forward is not None:
        out[COMPONENT_COMPUTE] = (
            float(culprit.forward) + float(culprit.optimizer_step or 0.0)
            - float(victim.forward) - float(victim.optimizer_step or 0.0)
        )
    return out


def rank_straggler(ctx: RuleContext) -> DiagnosisIssue | None:
    phases = visible_phases(ctx)
    cohort = ctx.cohort((*phases, METRIC_STEP_TIME))
    if len(cohort) < 2:
        return None
    columns = [ctx.column(p) for p in phases]
    ordered = sorted(((sum(col[r] for col in columns), r) for r in cohort))
    culprit = _Candidate(ordered[0][1], ordered[0][0], ctx.values(ordered[0][1]))
    middle = ordered[len(ordered) // 2]
    victim = _Candidate(middle[1], middle[0], ctx.values(middle[1]))
    victim_step = ctx.column(METRIC_STEP_TIME)[victim.rank]
    if victim.rank == culprit.rank:
        return None
    gap = victim.visible - culprit.visible
    score = finite_ratio(gap, victim_step)
    if score is None:
        return None
    uncapped = ctx.policy.severity_for(score)
    if uncapped is None:
        return None
    severity, caps = ctx.capped(uncapped)

    excess = _excesses(ctx, culprit.values, victim.values)
    coverage = {c: (None if e is None else finite_ratio(e, gap)) for c, e in excess.items()}
    component = COMPONENT_UNATTRIBUTED
    for candidate in (COMPONENT_INPUT_WAIT, COMPONENT_H2D, COMPONENT_COMPUTE):
        covered = coverage[candidate]
        if covered is not None and ctx.policy.at_least(covered, ctx.policy.straggler_attribution):
            component = candidate
            break
    kind = _KIND_BY_COMPONENT.get(component, STRAGGLER)

    phase_label = "+".join(phases)
    if component == COMPONENT_UNATTRIBUTED:
        cause = "no measured phase explains it (synchronisation or unattributed work)"
    else:
        cause = f"rank {culprit.rank} {_CAUSE_WORDING[component]} ({excess[component]:.1f} ms)"
    summary = (
        f"rank {culprit.rank} holds the others back: rank {victim.rank} spends {gap:.1f} ms more in "
        f"{phase_label} ({score:.0%} of its step); {cause}"
    )
    evidence = {
        **ctx.common_evidence(),
        "visible_phase": phase_label,
        "culprit_visible_ms": culprit.visible,
        "victim_visible_ms": victim.visible,
        "gap_ms": gap,
        "victim_step_time_ms": victim_step,
        "excess_ms": excess,
        "gap_coverage": coverage,
        "attribution_threshold": ctx.policy.straggler_attribution,
        "cohort_ranks": list(cohort),
        "warn_threshold": ctx.policy.warn_share,
        "crit_threshold": ctx.policy.crit_share,
        "uncapped_severity": uncapped,
        "severity_caps": caps,
    }
    return DiagnosisIssue(
        kind=kind,
        severity=severity,
        status=ctx.status,
        score=score,
        summary=summary,
        culprit_rank=culprit.rank,
        victim_rank=victim.rank,
        component=component,
        evidence=evidence,
    )
