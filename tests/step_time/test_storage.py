"""SQLite normalisation at write: canonical columns, idempotency, latest wins, runs never mix."""
import json
import math
import sqlite3
import threading

import pytest

from traceml.processor.step_time.model import (
    RankIdentity,
    RawEventValue,
    StepMemoryIngestRecord,
    StepTimeIngestRecord,
)
from traceml.processor.storage import StepTimeStore
from traceml.schema import vocabulary as v


def _record(run="run-a", rank=0, step=1, forward=30.0, *, gpu=None, extra=None, strategy="ddp"):
    events = {
        v.RAW_DATALOADER_NEXT: RawEventValue(5.0, None, 1),
        v.RAW_FORWARD: RawEventValue(forward, gpu, 1),
        v.RAW_BACKWARD: RawEventValue(45.0, None, 1),
        v.RAW_STEP_TIME: RawEventValue(95.0, None, 1),
    }
    events.update(extra or {})
    return StepTimeIngestRecord(
        run_id=run, identity=RankIdentity(rank, local_rank=rank, node_rank=0, world_size=2,
                                          local_world_size=2, hostname="h0"),
        step=step, start_time=1000.0 + step, sample_time=1000.1 + step, events=events,
        training_strategy=strategy)


def _rows(path, sql, args=()):
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def test_write_normalises_raw_events_into_canonical_columns(tmp_path):
    db = tmp_path / "t.db"
    with StepTimeStore(db) as store:
        result = store.write([_record(gpu=15.0)])
    assert (result.accepted, result.duplicates, dict(result.rejected)) == (1, 0, {})
    (row,) = _rows(db, "SELECT forward_cpu_ms, forward_gpu_ms, forward_count, input_wait_cpu_ms,"
                       " h2d_cpu_ms, traced_step_time_cpu_ms, payload FROM step_time_samples")
    assert row[:6] == (30.0, 15.0, 1, 5.0, None, 95.0)
    assert v.RAW_FORWARD in json.loads(row[6])
    assert _rows(db, "PRAGMA journal_mode")[0][0] == "wal"


def test_identical_resend_is_a_duplicate_and_a_different_row_replaces_with_a_new_id(tmp_path):
    db = tmp_path / "t.db"
    with StepTimeStore(db) as store:
        store.write([_record(step=1), _record(step=2)])
        (first_id,) = _rows(db, "SELECT id FROM step_time_samples WHERE step = 1")[0]
        again = store.write([_record(step=1)])
        assert (again.accepted, again.duplicates, again.replaced) == (0, 1, 0)
        changed = store.write([_record(step=1, forward=31.0)])
        assert (changed.accepted, changed.duplicates, changed.replaced) == (1, 0, 1)
        record = store.run_record("run-a")
    rows = _rows(db, "SELECT id, forward_cpu_ms FROM step_time_samples WHERE step = 1")
    assert len(rows) == 1 and rows[0][1] == 31.0 and rows[0][0] > first_id
    assert record.latest_row_id == rows[0][0] and record.latest_step == 2


def test_latest_wins_inside_one_batch_and_counts_add_up(tmp_path):
    with StepTimeStore(tmp_path / "t.db") as store:
        result = store.write([_record(step=1), _record(step=1), _record(step=1, forward=40.0)])
    assert result.accepted + result.duplicates + result.rejected_total == 3
    assert result.duplicates == 1
    assert _rows(tmp_path / "t.db", "SELECT forward_cpu_ms FROM step_time_samples") == [(40.0,)]


def test_bad_values_are_dropped_or_floored_with_counted_reasons(tmp_path):
    bad = {
        v.RAW_H2D: RawEventValue(float("nan"), None, 1),
        v.RAW_OPTIMIZER_STEP: RawEventValue(-5.0, float("inf"), -1),
        "_traceml_internal:mystery": RawEventValue(1.0, None, 1),
    }
    with StepTimeStore(tmp_path / "t.db") as store:
        result = store.write([_record(extra=bad), _record(step=2, forward=-0.001)])
    assert result.accepted == 2
    assert dict(result.value_issues) == {
        "non_finite_value": 2, "negative_value": 1, "bad_count": 1, "unknown_event": 1,
        "negative_floored": 1}
    rows = _rows(tmp_path / "t.db", "SELECT step, h2d_cpu_ms, optimizer_step_cpu_ms, h2d_count,"
                 " forward_cpu_ms, payload FROM step_time_samples ORDER BY step")
    assert rows[0][1:5] == (None, None, 1, 30.0)
    assert "_traceml_internal:mystery" in json.loads(rows[0][5])  # kept for audit
    assert rows[1][4] == 0.0


def test_invalid_records_are_rejected_whole_and_valid_ones_kept(tmp_path):
    records = [_record(run=""), _record(rank=-1), _record(step=-3), _record(step=4)]
    records.append(StepTimeIngestRecord("run-a", RankIdentity(0), 5, math.nan, 1.0, {}))
    with StepTimeStore(tmp_path / "t.db") as store:
        result = store.write(records)
    assert result.accepted == 1
    assert dict(result.rejected) == {"missing_run_id": 1, "bad_rank": 1, "bad_step": 1,
                                     "bad_time": 1}


def test_runs_never_mix_and_strategy_and_ranks_are_recorded(tmp_path):
    with StepTimeStore(tmp_path / "t.db") as store:
        store.write([_record(run="a", rank=r, step=s) for r in (0, 1) for s in (1, 2)])
        store.write([_record(run="b", rank=0, step=1, strategy="fsdp")])
        assert store.runs() == ["a", "b"]
        assert store.run_record("b").training_strategy == "fsdp"
        assert store.run_record("a").latest_step == 2
    assert _rows(tmp_path / "t.db", "SELECT count(*) FROM step_time_samples WHERE run_id='a'") == [(4,)]
    assert _rows(tmp_path / "t.db", "SELECT run_id, global_rank FROM step_time_ranks ORDER BY 1, 2") \
        == [("a", 0), ("a", 1), ("b", 0)]


def test_memory_records_are_idempotent_and_keep_none(tmp_path):
    mem = StepMemoryIngestRecord("a", 0, 1, "cuda:0", 1024, None, 1001.0)
    with StepTimeStore(tmp_path / "t.db") as store:
        first = store.write([], [mem])
        second = store.write([], [mem])
        bad = store.write([], [StepMemoryIngestRecord("a", 0, 2, "cuda:0", -1, 5, 1.0)])
    assert (first.accepted, second.duplicates, dict(bad.rejected)) == (1, 1, {"bad_memory_value": 1})
    assert _rows(tmp_path / "t.db", "SELECT peak_allocated_bytes, peak_reserved_bytes"
                 " FROM step_memory_samples") == [(1024, None)]


def test_finished_ranks_and_drops(tmp_path):
    with StepTimeStore(tmp_path / "t.db") as store:
        store.mark_rank_finished("a", 1, {"steps": 10})
        store.record_drops("a", 1, {"timing": 3})
        store.record_drops("a", 1, {"timing": 2, "memory": 1})
        assert store.finished_ranks("a") == {1: {"steps": 10}}
        assert store.drops("a") == {1: {"timing": 3, "memory": 1}}
        with pytest.raises(ValueError):
            store.mark_rank_finished("", 0, {})


def test_concurrent_writers_share_one_store(tmp_path):
    store = StepTimeStore(tmp_path / "t.db")
    errors = []

    def writer(rank):
        try:
            for step in range(50):
                store.write([_record(rank=rank, step=step)])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    assert not errors
    assert _rows(tmp_path / "t.db", "SELECT count(*) FROM step_time_samples") == [(200,)]
