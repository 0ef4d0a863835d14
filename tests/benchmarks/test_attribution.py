"""benchmarks/lib/attribution.py: background work's cost read from the steps it lands in."""
from __future__ import annotations

import random

import pytest

from benchmarks.lib.attribution import attributed, overlapping


def _steps(n: int, every: int, hit: float, after: float, seed: int = 0):
    """Steps of 10 units with a little noise; every `every`-th one pays `hit`, the next one `after`."""
    noise = random.Random(seed)
    durations = [10.0 + noise.gauss(0, 0.01) for _ in range(n)]
    marked = [False] * n
    for i in range(every, n - 2, every):
        marked[i] = True
        durations[i] += hit
        durations[i + 1] += after
    return durations, marked


def test_the_cost_of_a_run_includes_the_step_after_when_asked_and_the_control_reads_nothing():
    durations, marked = _steps(4000, 20, hit=2.0, after=1.0)
    found = attributed(durations, marked, after_steps=1)
    assert found["per_run"] == pytest.approx(3.0, abs=0.01)
    assert found["runs_total"] == found["runs"] == sum(marked)
    assert found["per_step"] == pytest.approx(3.0 * sum(marked) / 4000, abs=0.001)
    assert found["share"] == pytest.approx(2 * sum(marked) / 4000)
    assert abs(found["control_per_run"]) < 0.01 and found["control_runs"] >= 2
    # Without the step after, its after-effect raises the baseline and hides part of the cost.
    assert attributed(durations, marked)["per_run"] == pytest.approx(1.5, abs=0.01)


def test_steps_are_marked_by_any_overlapping_work_span():
    steps = [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0)]
    assert overlapping(steps, [(0.5, 0.6), (2.9, 3.2)]) == [True, False, True, True]
    assert overlapping(steps, []) == [False] * 4


def test_too_few_runs_give_an_infinite_interval_not_a_figure():
    found = attributed([10.0] * 10, [False] * 4 + [True] + [False] * 5)
    assert found["runs"] == 1 and found["per_run_se"] == float("inf")
