"""What a selection keeps for a large run: slots allocated as steps arrive, the cell cap's rule
(`tail_step_ids`), and a window that never claims steps the selection did not keep."""
from __future__ import annotations

import pytest

from tests.step_time.test_live_session import _record
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.model import (
    LIVE_TAIL_MAX_CELLS,
    LIVE_WINDOW_STEPS,
    MIN_TAIL_STEPS,
    SUMMARY_MAX_CELLS,
    SUMMARY_WINDOW_STEPS,
    WINDOW_LOOKBACK,
    tail_step_ids,
)
from traceml.processor.step_time.pipeline import (
    PROFILE_SUMMARY,
    LiveStepTimeSession,
    StepTimePipeline,
    StepTimeRequest,
)
from traceml.processor.step_time.sqlite_reader import LiveTail, load_summary_snapshot


def _write(db, ranks, steps, *, skip=()):
    """Every (rank, step) of `ranks` x `steps`, except the (rank, step) pairs in `skip`."""
    with StepTimeStore(db) as store:
        store.write([_record(rank, step) for step in steps for rank in ranks if (rank, step) not in skip])


def test_the_rule_full_lookback_then_fewer_step_ids_then_the_floor():
    full = LIVE_WINDOW_STEPS * WINDOW_LOOKBACK
    assert tail_step_ids(LIVE_WINDOW_STEPS, WINDOW_LOOKBACK, 1, LIVE_TAIL_MAX_CELLS) == full
    assert tail_step_ids(LIVE_WINDOW_STEPS, WINDOW_LOOKBACK, 1_024, LIVE_TAIL_MAX_CELLS) == full
    assert tail_step_ids(LIVE_WINDOW_STEPS, WINDOW_LOOKBACK, 1_025, LIVE_TAIL_MAX_CELLS) == 399
    assert tail_step_ids(LIVE_WINDOW_STEPS, WINDOW_LOOKBACK, 4_096, LIVE_TAIL_MAX_CELLS) == 100
    assert tail_step_ids(LIVE_WINDOW_STEPS, WINDOW_LOOKBACK, 4_097, LIVE_TAIL_MAX_CELLS) == 99
    # The largest run --max-ranks-per-run allows still keeps the 20 steps a crit finding needs.
    assert tail_step_ids(LIVE_WINDOW_STEPS, WINDOW_LOOKBACK, 16_384, LIVE_TAIL_MAX_CELLS) == 25
    assert tail_step_ids(LIVE_WINDOW_STEPS, WINDOW_LOOKBACK, 10**9, LIVE_TAIL_MAX_CELLS) == MIN_TAIL_STEPS
    assert tail_step_ids(1, 1, 10**9, LIVE_TAIL_MAX_CELLS) == 1  # never above window x lookback
    # The summary of a 1,024-rank run keeps 16,384 step ids: a full 10,000-step window.
    assert tail_step_ids(SUMMARY_WINDOW_STEPS, WINDOW_LOOKBACK, 1_024, SUMMARY_MAX_CELLS) == 16_384
    for ranks in (1, 7, 1_025, 16_384, 100_000):  # within the cap wherever the floor allows
        kept = tail_step_ids(LIVE_WINDOW_STEPS, WINDOW_LOOKBACK, ranks, LIVE_TAIL_MAX_CELLS)
        assert kept * ranks <= LIVE_TAIL_MAX_CELLS or kept == MIN_TAIL_STEPS


def test_slots_are_allocated_as_steps_arrive_and_never_pass_the_capacity(tmp_path):
    db = tmp_path / "s.db"
    _write(db, range(3), range(1, 4))
    tail = LiveTail("r", window=5, lookback=2)
    snapshot = tail.read(db).snapshot
    assert tail.capacity == 10 and tail.slots == 3  # not 10 slots for 3 steps
    assert snapshot.grid.values.shape[:2] == (3, 3) and snapshot.tail_steps == 10
    for step in range(4, 40):  # past the ring's size: slots are reused, not added
        _write(db, range(3), [step])
        tail.read(db)
        assert tail.slots <= tail.capacity
    assert tail.slots == 10


def test_a_run_beyond_the_cap_keeps_fewer_step_ids_and_its_window_says_so(tmp_path):
    """3 ranks, cap 12 cells: 4 step ids of the 10 (window 5 x lookback 2)."""
    db = tmp_path / "s.db"
    _write(db, range(3), range(1, 11))
    session = LiveStepTimeSession(db, "r", window=5, lookback=2, max_cells=12)
    window = session.refresh().analysis.window
    assert window.steps == (7, 8, 9, 10) and window.max_steps == 4
    assert session._tail.slots == 4
    uncapped = LiveStepTimeSession(db, "r", window=5, lookback=2).refresh().analysis.window
    assert uncapped.steps == (6, 7, 8, 9, 10) and uncapped.max_steps == 5
    # One-off reads follow the same rule.
    full = StepTimePipeline().run(StepTimeRequest(db, "r", max_steps=5, lookback=2, max_cells=12)).window
    assert full.steps == window.steps and full.max_steps == 4


def test_a_lagging_rank_in_a_cut_tail_shortens_the_window_instead_of_reaching_back(tmp_path):
    """Rank 2 lacks steps 9 and 10. Steps 5 and 6 are common and stored, but outside the
    4 step ids kept: the window is the 2 common steps it kept, not 4 reached for."""
    db = tmp_path / "s.db"
    _write(db, range(3), range(1, 11), skip={(2, 9), (2, 10)})
    window = LiveStepTimeSession(db, "r", window=5, lookback=2, max_cells=12).refresh().analysis.window
    assert window.steps == (7, 8) and window.max_steps == 4
    uncapped = LiveStepTimeSession(db, "r", window=5, lookback=2).refresh().analysis.window
    assert uncapped.steps == (4, 5, 6, 7, 8)


def test_a_rank_joining_shrinks_the_tail_to_the_new_rank_count(tmp_path):
    db = tmp_path / "s.db"
    _write(db, range(3), range(1, 11))
    session = LiveStepTimeSession(db, "r", window=5, lookback=2, max_cells=12)
    assert session.refresh().analysis.window.steps == (7, 8, 9, 10)
    _write(db, range(4), [11])  # rank 3 joins: 12 // 4 = 3 step ids
    window = session.refresh().analysis.window
    assert session._tail.capacity == 3 and window.max_steps == 3
    assert window.steps == (11,)  # rank 3 has only step 11: the only common step kept
    assert session._tail.slots == 3


@pytest.mark.parametrize("max_cells", [30, 12])
def test_a_capped_summary_reads_fewer_step_ids_by_the_same_rule(tmp_path, max_cells):
    db = tmp_path / "s.db"
    _write(db, range(3), range(1, 31))
    snapshot = load_summary_snapshot(db, "r", max_steps=8, lookback=2, max_cells=max_cells)
    kept = tail_step_ids(8, 2, 3, max_cells)
    assert snapshot.tail_steps == kept and sorted(set(r.step for r in snapshot.rows)) == list(range(31 - kept, 31))
    window = StepTimePipeline().run(StepTimeRequest(db, "r", profile=PROFILE_SUMMARY, max_steps=8,
                                                    lookback=2, max_cells=max_cells)).window
    assert window.max_steps == min(8, kept) and window.steps == tuple(range(31 - min(8, kept), 31))


def test_ordinary_runs_keep_the_full_tail_and_window(tmp_path):
    db = tmp_path / "s.db"
    _write(db, range(4), range(1, 131))
    session = LiveStepTimeSession(db, "r")
    window = session.refresh().analysis.window
    assert window.steps == tuple(range(31, 131)) and window.max_steps == LIVE_WINDOW_STEPS
    assert session._tail.capacity == LIVE_WINDOW_STEPS * WINDOW_LOOKBACK and session._tail.slots == 130
    summary = StepTimePipeline().run(StepTimeRequest(db, "r", profile=PROFILE_SUMMARY)).window
    assert summary.steps == tuple(range(1, 131)) and summary.max_steps == SUMMARY_WINDOW_STEPS
