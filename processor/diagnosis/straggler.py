"""Rank straggler: one slow rank makes the others wait inside a collective.

Two bases, the better one the window allows:

- **collective wait** (every cohort rank measured `collective_wait`): the rank the
  others waited for waits least, so the culprit is the rank with the least collective
  wait; the victim is the upper-median rank by wait (`sorted[n // 2]`); the gap is
  their wait asymmetry. The culprit's own phases (the measured wait taken out of the
  phase that holds it, backward first) say which of them grew.
- **visible phase** (no collective wait measured): the wait shows up in the phase
  where the collective blocks, backward under DDP, forward plus backward under FSDP;
  the culprit is the rank with the least visible time.

The gap over the victim's Step Time is the score either way.
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
    METRIC_COLLECTIVE_WAIT,
    METRIC_FORWARD,
    METRIC_OPTIMIZER_STEP,
)

BASIS_COLLECTIVE_WAIT = "collective_wait"
BASIS_VISIBLE_PHASE = "visible_phase"
OWN_PHASES: tuple[str, ...] = (METRIC_FORWARD, METRIC_BACKWARD, METRIC_OPTIMIZER_STEP)

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


def wait_in_phases(values: StepTimeValues) -> float:
    """The part of a rank's collective wait that lies inside its timed phases (ms): the
    measured wait fills the time no phase explains first (an explicit collective between
    phases), the rest is inside the phases (DDP's gradient all-reduce, in backward)."""
    wait = float(values.collective_wait or 0.0)
    if values.traced_step_time is None or values.forward is None or values.backward is None:
        return wait
    unexplained = (float(values.traced_step_time) - float(values.h2d or 0.0) - float(values.forward)
                   - float(values.backward) - float(values.optimizer_step or 0.0))
    return max(0.0, wait - max(0.0, unexplained))


def own_phases(values: StepTimeValues) -> dict[str, float | None]:
    """Forward, backward and optimizer without the collective wait inside them (ms): the wait
    in the phases is taken from backward first, then forward. None where a phase is missing."""
    inside = wait_in_phases(values)
    bwd = None if values.backward is None else float(values.backward)
    fwd = None if values.forward is None else float(values.forward)
    if bwd is not None:
        take = min(inside, bwd)
        bwd, inside = bwd - take, inside - take
    if fwd is not None:
        fwd = max(0.0, fwd - inside)
    return {METRIC_FORWARD: fwd, METRIC_BACKWARD: bwd,
            METRIC_OPTIMIZER_STEP: float(values.optimizer_step or 0.0)}


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


def _wait_excesses(culprit: StepTimeValues, victim: StepTimeValues) -> tuple[dict, dict]:
    """Candidate excesses on the collective-wait basis, and the per-phase excess of own time."""
    mine, theirs = own_phases(culprit), own_phases(victim)
    per_phase = {p: (None if mine[p] is None or theirs[p] is None else mine[p] - theirs[p]) for p in OWN_PHASES}
    compute = None if any(v is None for v in per_phase.values()) else sum(per_phase.values())
    out = {
        COMPONENT_INPUT_WAIT: (None if culprit.input_wait is None or victim.input_wait is None
                               else float(culprit.input_wait) - float(victim.input_wait)),
        COMPONENT_H2D: float(culprit.h2d or 0.0) - float(victim.h2d or 0.0),
        COMPONENT_COMPUTE: compute,
    }
    return out, per_phase


def rank_straggler(ctx: RuleContext) -> DiagnosisIssue | None:
    phases = visible_phases(ctx)
    basis = ctx.step_basis
    cohort = ctx.cohort((*phases, basis))
    if len(cohort) < 2:
        return None
    waits = ctx.column(METRIC_COLLECTIVE_WAIT)
    by_wait = all(r in waits for r in cohort)
    columns = [ctx.column(p) for p in phases]
    visible = {r: sum(col[r] for col in columns) for r in cohort}
    basis_of = waits if by_wait else visible
    ordered = sorted((basis_of[r], r) for r in cohort)
    culprit = _Candidate(ordered[0][1], visible[ordered[0][1]], ctx.values(ordered[0][1]))
    middle = ordered[len(ordered) // 2]
    victim = _Candidate(middle[1], visible[middle[1]], ctx.values(middle[1]))
    victim_step = ctx.column(basis)[victim.rank]
    if victim.rank == culprit.rank:
        return None
    gap = middle[0] - ordered[0][0]
    score = finite_ratio(gap, victim_step)
    if score is None:
        return None
    uncapped = ctx.policy.severity_for(score)
    if uncapped is None:
        return None
    severity, caps = ctx.capped(uncapped)

    per_phase: dict | None = None
    if by_wait:
        excess, per_phase = _wait_excesses(culprit.values, victim.values)
    else:
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
    grown = None
    if per_phase is not None:
        known = [(v, p) for p, v in per_phase.items() if v is not None]
        grown = max(known)[1] if known and max(known)[0] > 0 else None
    if component == COMPONENT_UNATTRIBUTED:
        cause = "no measured phase explains it (synchronisation or unattributed work)"
    elif component == COMPONENT_COMPUTE and grown is not None:
        cause = f"rank {culprit.rank} computes longer: its {grown} grew ({per_phase[grown]:.1f} ms)"
    else:
        cause = f"rank {culprit.rank} {_CAUSE_WORDING[component]} ({excess[component]:.1f} ms)"
    where = "waiting in collectives" if by_wait else f"in {phase_label}"
    summary = (
        f"rank {culprit.rank} holds the others back: rank {victim.rank} spends {gap:.1f} ms more "
        f"{where} ({score:.0%} of its step); {cause}"
    )
    evidence = {
        **ctx.common_evidence(),
        "wait_basis": BASIS_COLLECTIVE_WAIT if by_wait else BASIS_VISIBLE_PHASE,
        "visible_phase": phase_label,
        "culprit_visible_ms": culprit.visible,
        "victim_visible_ms": victim.visible,
        "culprit_collective_wait_ms": waits.get(culprit.rank),
        "victim_collective_wait_ms": waits.get(victim.rank),
        "wait_asymmetry_ms": (waits[victim.rank] - waits[culprit.rank]
                              if culprit.rank in waits and victim.rank in waits else None),
        "phase_excess_ms": per_phase,
        "grown_phase": grown if component == COMPONENT_COMPUTE else (
            component if component in (COMPONENT_INPUT_WAIT, COMPONENT_H2D) else None),
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
        **ctx.basis_evidence(basis),
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
