"""LiveStepTimeSession: freshness states, exact-object reuse, incremental reads that match full reads."""
from __future__ import annotations

import random
import sqlite3
import threading
import time

import pytest

from tests.step_time.scenarios import build_scenario, scenario_records
from traceml.processor.diagnosis import diagnose
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.model import RankIdentity, RawEventValue, StepTimeIngestRecord
from traceml.processor.step_time.pipeline import LiveStepTimeSession, StepTimePipeline, StepTimeRequest
from traceml.schema import vocabulary as v


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingDiagnose:
    def __init__(self):
        self.calls = 0

    def __call__(self, window, resources=None):
        self.calls += 1
        return diagnose(window, resources=resources)


def _record(rank, step, forward=30.0, run="r", strategy="ddp"):
    events = {v.RAW_DATALOADER_NEXT: RawEventValue(5.0, None, 1),
              v.RAW_FORWARD: RawEventValue(forward, None, 1),
              v.RAW_BACKWARD: RawEventValue(45.0, None, 1),
              v.RAW_OPTIMIZER_STEP: RawEventValue(10.0, None, 1),
              v.RAW_STEP_TIME: RawEventValue(95.0, None, 1)}
    return StepTimeIngestRecord(run, RankIdentity(rank, world_size=2), step, 1.0 * step,
                                1.0 * step + 0.5, events, strategy)


def test_cold_until_a_usable_window_then_live(tmp_path):
    db = tmp_path / "s.db"
    session = LiveStepTimeSession(db, "r", clock=FakeClock())
    missing = session.refresh()
    assert missing.freshness == "cold" and missing.error and missing.analysis.window.is_empty
    store = StepTimeStore(db)
    assert session.refresh().freshness == "cold"  # database exists, run has no rows yet
    store.write([_record(0, 1), _record(1, 1)])
    result = session.refresh()
    assert result.freshness == "live" and result.age_s == 0.0 and result.error is None
    assert result.analysis.window.steps == (1,)
    store.close()


def test_unchanged_cursor_returns_the_exact_same_analysis_without_analysing(tmp_path):
    db = build_scenario("complete_gpu", tmp_path / "c.db")
    counting = CountingDiagnose()
    session = LiveStepTimeSession(db, "complete_gpu", diagnose=counting)
    first = session.refresh()
    second = session.refresh()
    assert second.analysis is first.analysis
    assert second.freshness == "live"
    assert session.analyses == 1 and counting.calls == 1


def test_new_rows_are_read_incrementally_and_replacements_are_seen(tmp_path):
    db = tmp_path / "s.db"
    store = StepTimeStore(db)
    store.write([_record(r, s) for s in range(1, 6) for r in (0, 1)])
    session = LiveStepTimeSession(db, "r")
    first = session.refresh().analysis
    store.write([_record(0, 6), _record(1, 6)])
    second = session.refresh().analysis
    assert second is not first and second.window.steps[-1] == 6
    store.write([_record(1, 3, forward=130.0)])  # latest wins for (rank 1, step 3)
    third = session.refresh().analysis
    assert third.window.rank_facts[1].average.forward == (30.0 * 5 + 130.0) / 6
    assert third.cursor.latest_row_id > second.cursor.latest_row_id
    store.close()


def test_strategy_or_rank_universe_change_invalidates_reuse(tmp_path):
    db = tmp_path / "s.db"
    store = StepTimeStore(db)
    store.write([_record(r, s) for s in range(1, 4) for r in (0, 1)])
    session = LiveStepTimeSession(db, "r")
    first = session.refresh().analysis
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE step_time_runs SET training_strategy = 'fsdp' WHERE run_id = 'r'")
    conn.close()
    second = session.refresh().analysis
    assert second is not first and second.window.training_strategy == "fsdp"
    assert second.cursor == first.cursor  # no timing row changed
    store.mark_rank_finished("r", 2, {"steps": 0})  # a rank the universe did not hold
    third = session.refresh().analysis
    assert third is not second and third.window.expected_ranks == (0, 1, 2)
    assert third.window.steps == (1, 2, 3)  # rank 2 sent no rows: it does not participate
    assert third.window.coverage["forward"] == (2, 3)
    store.close()


def test_failed_reads_bridge_then_expire_on_the_monotonic_clock(tmp_path):
    db = build_scenario("single_rank_cpu", tmp_path / "b.db")
    clock = FakeClock()
    session = LiveStepTimeSession(db, "single_rank_cpu", clock=clock, bridge_ttl_s=30.0)
    good = session.refresh()
    assert good.freshness == "live"
    moved = tmp_path / "moved.db"
    db.rename(moved)
    clock.now += 10.0
    bridged = session.refresh()
    assert bridged.freshness == "bridged" and bridged.analysis is good.analysis
    assert bridged.age_s == 10.0 and "FileNotFoundError" in bridged.error
    clock.now += 20.5
    expired = session.refresh()
    assert expired.freshness == "expired" and expired.analysis.window.is_empty
    assert expired.age_s == 30.5
    moved.rename(db)
    back = session.refresh()
    assert back.freshness == "live" and back.analysis.window.step_count == 30


def test_an_empty_read_after_a_good_one_bridges(tmp_path):
    db = tmp_path / "s.db"
    store = StepTimeStore(db)
    store.write([_record(0, 1)])
    clock = FakeClock()
    session = LiveStepTimeSession(db, "r", clock=clock)
    good = session.refresh()
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("DELETE FROM step_time_samples")
    conn.close()
    clock.now += 1.0
    result = session.refresh()
    assert result.freshness == "bridged" and result.analysis is good.analysis
    store.close()


@pytest.mark.parametrize("max_cells", [None, 9, 24])
@pytest.mark.slow
def test_incremental_ring_cache_matches_a_fresh_full_read(tmp_path, max_cells):
    """Random arrivals, gaps, replacements and ring wrap-around (capacity 5 x 2 = 10 steps;
    with a cell cap of 9 or 24 cells for the 3 ranks, 3 or 8 step ids)."""
    rng = random.Random(11)
    db = tmp_path / "s.db"
    store = StepTimeStore(db)
    cap = {} if max_cells is None else {"max_cells": max_cells}
    session = LiveStepTimeSession(db, "r", window=5, lookback=2, **cap)
    pipeline = StepTimePipeline()
    step = 0
    for _ in range(40):
        records = []
        for _ in range(rng.randint(0, 3)):
            step += 1
            for rank in range(3):
                if rng.random() < 0.85:
                    records.append(_record(rank, step, forward=rng.choice([10.0, 20.0, 30.0])))
        if step and rng.random() < 0.4:
            old = rng.randint(max(1, step - 12), step)
            records.append(_record(rng.randrange(3), old, forward=rng.uniform(1, 50)))
        if rng.random() < 0.1:
            records.append(_record(rng.randrange(3), step + rng.randint(1, 15), forward=7.0))
        if records:
            store.write(records)
        result = session.refresh()
        full = pipeline.run(StepTimeRequest(db, "r", max_steps=5, lookback=2, max_cells=max_cells)).window
        # An empty window (no common step kept) shows the last good one, bridged.
        assert result.freshness == ("bridged" if full.is_empty else "live")
        live = session._current.window  # the analysis of this read
        assert live.steps == full.steps and live.expected_ranks == full.expected_ranks
        assert live.max_steps == full.max_steps == min(5, session._tail.capacity)
        assert session._tail.slots <= session._tail.capacity
        assert {r: f.average for r, f in live.rank_facts.items()} == \
               {r: f.average for r, f in full.rank_facts.items()}
        assert [s for s in live.metrics["forward"].series] == list(full.metrics["forward"].series)
    store.close()


def test_concurrent_refreshes_while_writing_never_fail(tmp_path):
    db = tmp_path / "s.db"
    store = StepTimeStore(db)
    store.write(scenario_records("complete_gpu")[:20])
    session = LiveStepTimeSession(db, "complete_gpu")
    errors, results = [], []

    def reader():
        for _ in range(30):
            try:
                results.append(session.refresh())
            except Exception as exc:  # pragma: no cover - reported by the assert
                errors.append(exc)

    records = scenario_records("complete_gpu")
    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for start in range(20, len(records), 10):
        store.write(records[start:start + 10])
    for t in threads:
        t.join()
    final = session.refresh()
    store.close()
    assert not errors
    assert all(r.freshness == "live" for r in results)
    assert final.analysis.window.steps == tuple(range(1, 101))


def test_expiry_follows_time_monotonic_not_wall_time(tmp_path, monkeypatch):
    db = build_scenario("single_rank_cpu", tmp_path / "m.db")
    fake_monotonic = FakeClock()
    monkeypatch.setattr(time, "monotonic", fake_monotonic)
    session = LiveStepTimeSession(db, "single_rank_cpu")
    assert session.refresh().freshness == "live"
    db.rename(tmp_path / "away.db")
    wall = time.time()
    monkeypatch.setattr(time, "time", lambda: wall + 3600.0)  # a wall-clock jump of an hour
    assert session.refresh().freshness == "bridged"
    fake_monotonic.now += 31.0
    assert session.refresh().freshness == "expired"


def test_a_refresh_is_one_read_transaction_of_two_index_bounded_statements(tmp_path, monkeypatch):
    import traceml.processor.step_time.sqlite_reader as repo

    db = build_scenario("complete_gpu", tmp_path / "t.db")
    statements: list[str] = []
    plans: list[str] = []
    real_connect = repo.connect_reader

    def traced_connect(path):
        conn = real_connect(path)
        conn.set_trace_callback(statements.append)
        return conn

    monkeypatch.setattr(repo, "connect_reader", traced_connect)
    session = LiveStepTimeSession(db, "complete_gpu")
    session.refresh()  # cold: header, rank universe (first time), tail
    with StepTimeStore(db) as store:
        store.write([r for r in scenario_records("complete_gpu")][:2])  # a resend: no new ids
        store.write([_record(0, 101, run="complete_gpu"), _record(1, 101, run="complete_gpu")])
    statements.clear()
    session.refresh()
    selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert statements[0] == "BEGIN" and statements[-1] == "COMMIT"
    assert len(selects) == 2  # header, then only the rows newer than the cursor
    statements.clear()
    session.refresh()
    assert [s for s in statements if s.lstrip().upper().startswith("SELECT")] == selects[:1]

    conn = sqlite3.connect(db)
    for sql, args in ((repo._HEADER_SQL, ("complete_gpu",)), (repo._NEW_ROWS_SQL, ("complete_gpu", 5, 3)),
                      (repo._TAIL_SQL, ("complete_gpu", 3)), (repo._LIVE_TAIL_SQL, ("complete_gpu", 3))):
        plans += [row[-1] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, args)]
    conn.close()
    assert not [p for p in plans if p.startswith("SCAN step_time_samples")], plans
