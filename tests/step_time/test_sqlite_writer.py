"""The SQLite writer: canonical columns, idempotency, latest wins, runs never mix.

Records here are shaped as the decoder hands them over (it alone judges values;
`tests/processor/test_decode.py` holds its refusals).
"""
import json
import sqlite3
import threading

from harness.stored_rows import finished_ranks, reported_drops, stored_run, stored_run_ids

from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.model import (
    RankIdentity,
    RawEventValue,
    StepMemoryIngestRecord,
    StepTimeIngestRecord,
)
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
    assert (result.accepted, result.duplicates, result.replaced) == (1, 0, 0)
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
        record = stored_run(db, "run-a")
    rows = _rows(db, "SELECT id, forward_cpu_ms FROM step_time_samples WHERE step = 1")
    assert len(rows) == 1 and rows[0][1] == 31.0 and rows[0][0] > first_id
    assert record.latest_row_id == rows[0][0] and record.latest_step == 2


def test_latest_wins_inside_one_batch_and_counts_add_up(tmp_path):
    with StepTimeStore(tmp_path / "t.db") as store:
        result = store.write([_record(step=1), _record(step=1), _record(step=1, forward=40.0)])
    assert result.accepted + result.duplicates == 3
    assert result.duplicates == 1
    assert _rows(tmp_path / "t.db", "SELECT forward_cpu_ms FROM step_time_samples") == [(40.0,)]


def test_unknown_event_names_stay_in_the_payload_only_and_are_counted(tmp_path):
    extra = {"_traceml_internal:mystery": RawEventValue(1.0, None, 1)}
    with StepTimeStore(tmp_path / "t.db") as store:
        result = store.write([_record(extra=extra), _record(step=2)])
    assert (result.accepted, result.unknown_events) == (2, 1)
    rows = _rows(tmp_path / "t.db", "SELECT forward_cpu_ms, payload FROM step_time_samples ORDER BY step")
    assert rows[0][0] == 30.0
    assert "_traceml_internal:mystery" in json.loads(rows[0][1])  # kept for audit


def test_unmeasured_values_stay_missing_and_a_measured_zero_stays_zero(tmp_path):
    events = {v.RAW_FORWARD: RawEventValue(None, 12.0, None), v.RAW_H2D: RawEventValue(0.0, None, 1)}
    with StepTimeStore(tmp_path / "t.db") as store:
        store.write([_record(extra=events)])
    assert _rows(tmp_path / "t.db", "SELECT forward_cpu_ms, forward_gpu_ms, forward_count, h2d_cpu_ms,"
                 " h2d_gpu_ms, optimizer_step_cpu_ms FROM step_time_samples") == [(None, 12.0, None, 0.0, None, None)]


def test_runs_never_mix_and_strategy_and_ranks_are_recorded(tmp_path):
    with StepTimeStore(tmp_path / "t.db") as store:
        store.write([_record(run="a", rank=r, step=s) for r in (0, 1) for s in (1, 2)])
        store.write([_record(run="b", rank=0, step=1, strategy="fsdp")])
    db = tmp_path / "t.db"
    assert stored_run_ids(db) == ["a", "b"]
    assert stored_run(db, "b").training_strategy == "fsdp"
    assert stored_run(db, "a").latest_step == 2
    assert _rows(tmp_path / "t.db", "SELECT count(*) FROM step_time_samples WHERE run_id='a'") == [(4,)]
    assert _rows(tmp_path / "t.db", "SELECT run_id, global_rank FROM step_time_ranks ORDER BY 1, 2") \
        == [("a", 0), ("a", 1), ("b", 0)]


def test_memory_records_are_idempotent_and_keep_none(tmp_path):
    mem = StepMemoryIngestRecord("a", 0, 1, "cuda:0", 1024, None, 1001.0)
    with StepTimeStore(tmp_path / "t.db") as store:
        first = store.write([], [mem])
        second = store.write([], [mem])
        no_device = store.write([], [StepMemoryIngestRecord("a", 0, 2, "", 5, 6, 1002.0)])
    assert (first.accepted, second.duplicates, no_device.accepted) == (1, 1, 1)
    assert _rows(tmp_path / "t.db", "SELECT device, peak_allocated_bytes, peak_reserved_bytes"
                 " FROM step_memory_samples ORDER BY step") == [("cuda:0", 1024, None), ("unknown", 5, 6)]


def test_finished_ranks_and_drops(tmp_path):
    with StepTimeStore(tmp_path / "t.db") as store:
        store.mark_rank_finished("a", 1, {"steps": 10})
        store.record_drops("a", 1, {"timing": 3})
        store.record_drops("a", 1, {"timing": 2, "memory": 1})
    assert finished_ranks(tmp_path / "t.db", "a") == {1: {"steps": 10}}
    assert reported_drops(tmp_path / "t.db", "a") == {1: {"timing": 3, "memory": 1}}


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
