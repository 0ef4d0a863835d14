"""`diagnose(window)`: gates, every rule, and the issue order.

Order: severity (crit, warn, info), then score (highest first, no score last),
then straggler kinds before the others, then kind name for a stable tie-break.
`StepTimeDiagnosis.primary` is therefore `issues[0]`.
"""
from __future__ import annotations

from dataclasses import replace

from traceml.processor.diagnosis.context import RuleContext
from traceml.processor.diagnosis.policy import DEFAULT_POLICY, DiagnosisPolicy
from traceml.processor.diagnosis.drift import step_time_drift
from traceml.processor.diagnosis.rules import (
    balanced,
    collective_bound,
    compute_bound,
    h2d_bound,
    incomplete_data,
    input_bound,
    residual_heavy,
    warmup,
)
from traceml.processor.diagnosis.resource_rules import (
    host_cpu_evidence,
    host_cpu_sentence,
    low_gpu_utilization,
    memory_creep,
)
from traceml.processor.diagnosis.straggler import rank_straggler
from traceml.processor.step_time.model import DiagnosisIssue, StepTimeDiagnosis, StepTimeWindow
from traceml.schema.diagnosis import (
    H2D_BOUND,
    H2D_STRAGGLER,
    INPUT_BOUND,
    INPUT_STRAGGLER,
    STRAGGLER_KINDS,
    severity_rank,
)
from traceml.schema.vocabulary import METRIC_H2D, METRIC_INPUT_WAIT

RULES = (input_bound, h2d_bound, residual_heavy, collective_bound, compute_bound, step_time_drift,
         memory_creep, incomplete_data)
"""The rules after the straggler rule, which runs first: what a straggler explains (its
culprit's input wait for INPUT_STRAGGLER, its H2D for H2D_STRAGGLER) is left out of the
share rule for that metric, so one slow loader is not also reported as the job's problem."""

_EXPLAINED_METRIC = {INPUT_STRAGGLER: METRIC_INPUT_WAIT, H2D_STRAGGLER: METRIC_H2D}
_EXPLAIN_IDLE_GPU = frozenset({INPUT_BOUND, H2D_BOUND, INPUT_STRAGGLER, H2D_STRAGGLER})
"""Findings that already explain why a GPU idles: LOW_GPU_UTILIZATION is for what they do not."""


def issue_order_key(issue: DiagnosisIssue) -> tuple:
    return (
        -severity_rank(issue.severity),
        issue.score is None,
        -(issue.score or 0.0),
        issue.kind not in STRAGGLER_KINDS,
        issue.kind,
    )


def diagnose(window: StepTimeWindow, policy: DiagnosisPolicy = DEFAULT_POLICY, *,
             resources=None) -> StepTimeDiagnosis:
    """Diagnose one analysed window, with the run's `ResourceWindow` over it when one was read.
    Pure: same window, resources and policy, same issues."""
    ctx = RuleContext(window=window, policy=policy, resources=resources)
    gate = warmup(ctx)
    if gate is not None:
        return StepTimeDiagnosis(issues=(gate,))
    straggler = rank_straggler(ctx)
    issues = [] if straggler is None else [straggler]
    explained = None if straggler is None else _EXPLAINED_METRIC.get(straggler.kind)
    if explained is not None:
        ctx = RuleContext(window=window, policy=policy, resources=resources,
                          excluded={explained: (straggler.culprit_rank,)})
    issues += [issue for rule in RULES if (issue := rule(ctx)) is not None]
    if not any(issue.kind in _EXPLAIN_IDLE_GPU for issue in issues):
        idle = low_gpu_utilization(ctx)
        if idle is not None:
            issues.append(idle)
    issues = [_with_host_cpu(ctx, issue) for issue in issues]
    if not issues:
        return StepTimeDiagnosis(issues=(balanced(ctx),))
    return StepTimeDiagnosis(issues=tuple(sorted(issues, key=issue_order_key)))


def _with_host_cpu(ctx: RuleContext, issue: DiagnosisIssue) -> DiagnosisIssue:
    """An input finding says whether its ranks' hosts had CPUs to spare (when that was measured)."""
    if issue.kind == INPUT_BOUND:
        ranks = issue.evidence.get("cohort_ranks") or ()
    elif issue.kind == INPUT_STRAGGLER and issue.culprit_rank is not None:
        ranks = (issue.culprit_rank,)
    else:
        return issue
    host_cpu = host_cpu_evidence(ctx, ranks)
    if host_cpu is None:
        return issue
    return replace(issue, summary=issue.summary + host_cpu_sentence(host_cpu),
                   evidence={**issue.evidence, "host_cpu": host_cpu})
