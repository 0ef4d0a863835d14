"""The phases of a capture's steps, from an analysis window: the digest's `phase_gap` input.

The ranks' profiler summaries say which operators took the time; the step spans the same ranks
exported say which phase it went to. When the window holds every captured step of both ranks
(the capture's steps were stored and aligned by the time its digest is made), this gives each
phase's mean over those steps on each rank; when it does not, None, and the digest says the
phase times were not in the store rather than using other steps. Pure: reads a window, no store.
"""
from __future__ import annotations

from traceml.processor.step_time.model import StepTimeWindow
from traceml.schema.capture import RankCaptureSummary

CAPTURE_PHASES: tuple[str, ...] = ("input_wait", "h2d", "forward", "backward", "optimizer_step", "residual",
                                   "collective_wait")
"""The window's per-step metrics a digest compares (collective wait lies inside its phase)."""


def captured_phase_means(window: StepTimeWindow | None, culprit: RankCaptureSummary,
                         reference: RankCaptureSummary) -> dict[str, tuple[float, float]] | None:
    """phase -> (culprit mean ms, reference mean ms) over each rank's captured steps, for the
    phases measured on every one of them; None when the window lacks any captured step."""
    if window is None:
        return None
    per_rank = []
    for summary in (culprit, reference):
        facts = window.rank_facts.get(summary.rank)
        if facts is None:
            return None
        wanted = range(summary.first_step, summary.first_step + len(summary.step_ms))
        by_step = {s.step: s.values for s in facts.steps if s.step in wanted}
        if len(by_step) != len(wanted):
            return None
        per_rank.append(list(by_step.values()))
    out: dict[str, tuple[float, float]] = {}
    for phase in CAPTURE_PHASES:
        means = []
        for values in per_rank:
            known = [v.get(phase) for v in values]
            if any(x is None for x in known):
                break
            means.append(sum(known) / len(known))
        if len(means) == 2:
            out[phase] = (means[0], means[1])
    return out or None
