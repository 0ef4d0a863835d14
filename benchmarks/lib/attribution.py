"""What background work costs the steps it lands in: each affected run of steps against its neighbours.

A thread beside training (a sampler draining its queue, the resource sampler's tick)
cannot be charged to one variant of interleaved one-step turns: its work lands in
whichever step runs when it wakes. In one long run of a single variant with the thread
live, its work spans are timed on its own thread; a step that overlaps one (and, with
`after_steps`, the steps right after it, which pay for the caches it evicted) is
compared with the two unaffected steps on either side of that run, milliseconds apart,
in the same machine state. The mean difference per run, times the runs per step, is
the cost per step; a control applies the same estimator at seeded positions with no
work near (it reads 0 when nothing is added). What it cannot see: effects lasting more
than `after_steps` steps.
"""
from __future__ import annotations

import random
import statistics


def overlapping(step_spans: list[tuple[float, float]], work_spans: list[tuple[float, float]]) -> list[bool]:
    """Per step, whether some work span overlaps it (both lists in time order)."""
    marked, k = [], 0
    for start, end in step_spans:
        while k < len(work_spans) and work_spans[k][1] < start:
            k += 1
        marked.append(k < len(work_spans) and work_spans[k][0] <= end)
    return marked


def _runs(affected: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs [first, last] of affected steps."""
    runs, first = [], None
    for i, hit in enumerate(affected):
        if hit and first is None:
            first = i
        elif not hit and first is not None:
            runs.append((first, i - 1))
            first = None
    if first is not None:
        runs.append((first, len(affected) - 1))
    return runs


def _run_costs(durations: list[float], affected: list[bool]) -> tuple[list[float], int]:
    """Each run's steps minus as many of its neighbours' mean, for runs with both neighbours
    unaffected; and how many runs there are in all."""
    runs = _runs(affected)
    costs = []
    for first, last in runs:
        before, after = first - 1, last + 1
        if before < 0 or after >= len(durations) or affected[before] or affected[after]:
            continue
        baseline = (durations[before] + durations[after]) / 2
        costs.append(sum(durations[first:last + 1]) - (last - first + 1) * baseline)
    return costs, len(runs)


def _spread(marked: list[bool], after_steps: int) -> list[bool]:
    affected = list(marked)
    for i, hit in enumerate(marked):
        if hit:
            for j in range(i + 1, min(len(marked), i + 1 + after_steps)):
                affected[j] = True
    return affected


def attributed(durations: list[float], marked: list[bool], after_steps: int = 0, seed: int = 1) -> dict:
    """Cost per step of the work marking `marked` steps (in the unit of `durations`).

    Keys: `per_step` and `per_step_se`; `per_run` and `per_run_se` (one affected run
    against its neighbours); `runs` (paired) and `runs_total`; `share` (affected steps
    over all); `control_per_run`, `control_per_run_se`, `control_runs` (the estimator at
    seeded unaffected positions, runs as long as the median affected one).
    """
    affected = _spread(marked, after_steps)
    costs, runs_total = _run_costs(durations, affected)
    n = len(durations)
    out = {"runs": len(costs), "runs_total": runs_total, "share": sum(affected) / n if n else 0.0}
    if len(costs) >= 2:
        per_run, per_run_se = statistics.fmean(costs), statistics.stdev(costs) / len(costs) ** 0.5
    else:
        per_run, per_run_se = 0.0, float("inf")
    rate = runs_total / n if n else 0.0
    out.update(per_run=per_run, per_run_se=per_run_se, per_step=per_run * rate, per_step_se=per_run_se * rate)
    length = int(statistics.median([last - first + 1 for first, last in _runs(affected)])) if runs_total else 1
    clear = [i for i in range(length + 1, n - 2 * length - 1)
             if not any(affected[i - length - 1:i + 2 * length + 1])]
    chosen = sorted(random.Random(seed).sample(clear, min(len(clear), max(2, runs_total))))
    control = [False] * n
    for i in chosen:
        if not any(control[i - 1:i + length + 1]):
            control[i:i + length] = [True] * length
    c_costs, _ = _run_costs(durations, control)
    if len(c_costs) >= 2:
        out.update(control_per_run=statistics.fmean(c_costs),
                   control_per_run_se=statistics.stdev(c_costs) / len(c_costs) ** 0.5)
    else:
        out.update(control_per_run=0.0, control_per_run_se=float("inf"))
    out["control_runs"] = len(c_costs)
    return out
