"""NO_STEPS: a run that ended with no step stored for any rank, and why.

The window rules cannot tell an empty run from one that is warming up: both
have fewer than 2 aligned steps, and WARMUP ("0 aligned step(s), 2 needed")
sends a user who never marked a step, or whose script died on import, off to
wait. So the summary (which knows the run is over, and how each rank ended)
replaces that gate with this finding. The live view keeps WARMUP: a run
still starting has no steps yet either.

The reason, first that applies (`schema.diagnosis.NO_STEPS_REASONS`):
- `script_failed`: a rank failed (exception, non-zero exit code) before any step;
- `interrupted`: a rank was interrupted (Ctrl-C, a forwarded signal) before any step;
- `telemetry_lost`: ranks completed steps (their end markers say so) but none reached the store;
- `no_step_marked`: the ranks finished cleanly with 0 steps completed: nothing marked a step;
  when every such rank's end marker says `traceml.steps.boundary` = `none` (no
  `trace_step`, no integration, no optimizer update), the finding says no optimizer
  was seen either (an inference or evaluation loop) and lists them in `no_optimizer_seen`;
- `nothing_received`: no rank said anything: nothing reached the processor.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from traceml.processor.endings import RankEnding
from traceml.processor.step_time.model import DiagnosisIssue, StepTimeAnalysis, StepTimeDiagnosis
from traceml.schema.diagnosis import (
    NO_STEPS,
    NO_STEPS_FAILED,
    NO_STEPS_INTERRUPTED,
    NO_STEPS_NONE_MARKED,
    NO_STEPS_NOTHING_RECEIVED,
    NO_STEPS_TELEMETRY_LOST,
    SEVERITY_WARN,
    STATUS_EMPTY,
)
from traceml.schema.endings import OUTCOME_FAILED, OUTCOME_INTERRUPTED, OUTCOME_LOST
from traceml.schema.vocabulary import STEP_BOUNDARY_NONE

_NAMED = 8

_WHAT_TO_DO = {
    NO_STEPS_FAILED: "the script failed before its first step: fix the error in that rank's output "
                     "(traceml run prints the last lines of a failed rank's log under --live)",
    NO_STEPS_INTERRUPTED: "the run was stopped before its first step; run it longer",
    NO_STEPS_TELEMETRY_LOST: "the ranks completed steps that never reached the processor: check the "
                             "endpoint the ranks export to and the processor's log",
    NO_STEPS_NONE_MARKED: "nothing marked a step: wrap the loop body in `with traceml.trace_step(model):`, "
                          "or train with a Hugging Face Trainer or Lightning (found automatically); "
                          "under traceml run an optimizer.step() also marks one",
    NO_STEPS_NOTHING_RECEIVED: "no rank reported: check that the ranks export OTLP to this processor "
                               "(OTEL_EXPORTER_OTLP_ENDPOINT) and that TRACEML_DISABLE is not set",
}
_NO_OPTIMIZER_TO_DO = ("no optimizer.step() was seen either, so there is no training step to time "
                       "(an inference or evaluation loop?); to time its iterations, wrap the loop body "
                       "in `with traceml.trace_step(model):`")


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(f"r{r}" for r in ranks[:_NAMED])
    return shown + (", ..." if len(ranks) > _NAMED else "")


def no_steps_issue(endings: Mapping[int, RankEnding], steps_completed: Mapping[int, int | None],
                   export_failures: Mapping[int, int | None] | None = None,
                   step_boundaries: Mapping[int, str | None] | None = None) -> DiagnosisIssue:
    """The finding for a run with no stored step, from how its ranks ended, what they counted and
    how their steps were delimited (`traceml.steps.boundary` on the end markers)."""
    failed = sorted(r for r, e in endings.items() if e.outcome == OUTCOME_FAILED)
    interrupted = sorted(r for r, e in endings.items() if e.outcome == OUTCOME_INTERRUPTED)
    completed = {r: n for r, n in steps_completed.items() if n}
    reported = sorted(r for r, e in endings.items() if e.outcome != OUTCOME_LOST)
    if failed:
        codes = sorted({endings[r].exit_code for r in failed if endings[r].exit_code is not None})
        code = f" with exit code {', '.join(map(str, codes))}" if codes else ""
        reason, why = NO_STEPS_FAILED, f"rank(s) {_ranks(failed)} failed{code} before any step was stored"
    elif interrupted:
        reason, why = NO_STEPS_INTERRUPTED, f"rank(s) {_ranks(interrupted)} were interrupted before any step"
    elif completed:
        total = sum(completed.values())
        reason, why = (NO_STEPS_TELEMETRY_LOST,
                       f"rank(s) {_ranks(sorted(completed))} completed {total} step(s), none of which was stored")
    elif reported:
        reason, why = NO_STEPS_NONE_MARKED, f"{len(reported)} rank(s) ended with 0 steps completed"
    else:
        reason, why = NO_STEPS_NOTHING_RECEIVED, "no rank sent a step or an end marker"
    what_to_do = _WHAT_TO_DO[reason]
    unbounded = sorted(r for r, b in (step_boundaries or {}).items() if b == STEP_BOUNDARY_NONE)
    if reason == NO_STEPS_NONE_MARKED and unbounded and set(reported) <= set(unbounded):
        why += ", no step marked and no optimizer seen"
        what_to_do = _NO_OPTIMIZER_TO_DO
    evidence = {
        "reason": reason,
        "ranks_failed": failed,
        "ranks_interrupted": interrupted,
        "steps_completed": {str(r): n for r, n in sorted(steps_completed.items()) if n is not None},
        "export_failures": {str(r): n for r, n in sorted((export_failures or {}).items()) if n},
        "no_optimizer_seen": unbounded,
        "what_to_do": what_to_do,
    }
    return DiagnosisIssue(kind=NO_STEPS, severity=SEVERITY_WARN, status=STATUS_EMPTY, score=None,
                          summary=f"no steps: {why}; {what_to_do}", evidence=evidence)


def with_no_steps(analysis: StepTimeAnalysis, issue: DiagnosisIssue) -> StepTimeAnalysis:
    """The analysis with NO_STEPS as its only issue (nothing else can be said without a step)."""
    return replace(analysis, diagnosis=StepTimeDiagnosis(issues=(issue,)))
