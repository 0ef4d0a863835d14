"""A run is over when every rank it has sent `traceml.run.end`: one rule, live and after a restart."""
from __future__ import annotations

import sqlite3

import pytest

from traceml.processor.runs import RunState, run_is_over, stored_run_is_over


@pytest.mark.parametrize("ranks,world_size,finished,over", [
    ({0, 1}, 2, {0, 1}, True),  # every rank of the world ended
    ({0, 1}, 2, {0}, False),  # one end marker missing
    ({0}, 2, {0}, False),  # rank 1 of the world never reported
    ({0, 1, 2}, None, {0, 1, 2}, True),  # no declared world: the ranks seen
    ({0, 1, 2}, None, {0, 2}, False),
    (set(), None, set(), False),  # nothing known yet
])
def test_every_rank_of_the_run_must_end(ranks, world_size, finished, over):
    assert run_is_over(ranks, world_size, finished) is over


def test_a_rank_of_the_world_that_never_reported_is_not_replaced_by_one_outside_it():
    # Two ranks ended, as many as the world declares, but rank 1 never sent anything:
    # counting ranks would call this run over.
    assert not run_is_over({0, 5}, 2, {0, 5})


def test_a_running_rank_outside_the_declared_world_keeps_the_run_open():
    # Ranks 0 and 1 (the declared world of 2) ended; rank 2 reported without a world
    # size and is still running.
    assert not run_is_over({0, 1, 2}, 2, {0, 1})
    assert run_is_over({0, 1, 2}, 2, {0, 1, 2})


def test_live_state_and_stored_ranks_use_the_same_rule():
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE step_time_ranks (run_id TEXT, global_rank INTEGER, world_size INTEGER,"
                 " finished_time REAL)")
    cases = {
        "all-ended": [(0, 2, 1.0), (1, 2, 1.0)],
        "one-open": [(0, 2, 1.0), (1, 2, None)],
        "world-rank-missing": [(0, 2, 1.0), (5, None, 1.0)],
        "outside-world-open": [(0, 2, 1.0), (1, 2, 1.0), (2, None, None)],
    }
    for run_id, rows in cases.items():
        conn.executemany("INSERT INTO step_time_ranks VALUES (?, ?, ?, ?)", [(run_id, *row) for row in rows])
    for run_id, rows in cases.items():
        state = RunState(run_id, 0.0, 0.0, ranks={r for r, _, _ in rows},
                         world_size=max((w or 0 for _, w, _ in rows), default=0) or None,
                         finished={r for r, _, f in rows if f is not None})
        assert stored_run_is_over(conn, run_id) is state.all_finished() is (run_id == "all-ended")
