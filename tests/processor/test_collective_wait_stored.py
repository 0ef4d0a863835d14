"""Collective wait on the wire -> SQLite -> analysis -> diagnosis (issue 19), and old databases.

Spans are built with the real OTLP protobufs (`otlp_payloads`), decoded by the
processor's decoder and written by its store; nothing in between is mocked.
"""
from __future__ import annotations

import sqlite3

from harness.older_layouts import downgrade
from harness.otlp_payloads import steps_request
from traceml.processor.decode import Decoder
from traceml.processor.sqlite_layout import LEGACY_PACKED_FIELDS, SCHEMA_USER_VERSION, metric_columns
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.pipeline import PROFILE_SUMMARY, StepTimePipeline, StepTimeRequest
from traceml.schema import vocabulary as v

BASE = {v.RAW_DATALOADER_NEXT: 5.0, v.RAW_FORWARD: 30.0, v.RAW_BACKWARD: 105.0,
        v.RAW_OPTIMIZER_STEP: 10.0, v.RAW_STEP_TIME: 150.0}


def _events(wait: float | None) -> dict:
    events = dict(BASE)
    if wait is not None:
        events[v.RAW_COLLECTIVE_WAIT] = wait
    return events


def _store(path, run: str, waits: dict, steps=range(1, 25)) -> None:
    records = []
    for rank, wait in waits.items():
        records += Decoder().decode_traces(
            steps_request(run, rank, steps, _events(wait), world_size=len(waits))).step_records
    with StepTimeStore(path) as store:
        result = store.write(records, receive_time=1_700_000_000.0)
    assert result.unknown_events == 0  # collective_wait is a known event now


def _summary(path, run):
    return StepTimePipeline().run(StepTimeRequest(path, run, profile=PROFILE_SUMMARY))


def test_spans_carrying_collective_wait_are_stored_and_name_the_rank_waited_for(tmp_path):
    db = tmp_path / "t.db"
    _store(db, "run", {0: 60.0, 1: 60.0, 2: 0.5})  # rank 2 slow in backward; 0 and 1 wait for it
    cpu, gpu, count = metric_columns(v.METRIC_COLLECTIVE_WAIT)
    with sqlite3.connect(db) as conn:
        rows = conn.execute(f"SELECT global_rank, {cpu}, {gpu}, {count} FROM step_time_samples "
                            "WHERE step = 1 ORDER BY global_rank").fetchall()
    assert rows == [(0, 60.0, None, 1), (1, 60.0, None, 1), (2, 0.5, None, 1)]
    analysis = _summary(db, "run")
    assert analysis.window.metrics["collective_wait"].rank_values == {0: 60.0, 1: 60.0, 2: 0.5}
    issue = analysis.diagnosis.primary
    assert (issue.kind, issue.culprit_rank, issue.victim_rank) == ("COMPUTE_STRAGGLER", 2, 0)
    assert issue.evidence["wait_basis"] == "collective_wait"
    assert issue.evidence["grown_phase"] == "backward"
    assert issue.evidence["wait_asymmetry_ms"] == 59.5


def test_a_run_without_collective_wait_keeps_it_unmeasured_not_zero(tmp_path):
    db = tmp_path / "t.db"
    _store(db, "run", {0: None, 1: None})
    analysis = _summary(db, "run")
    assert analysis.window.coverage["collective_wait"] == (0, 2)
    assert all(f.average.collective_wait is None for f in analysis.window.rank_facts.values())
    assert analysis.diagnosis.primary.evidence.get("wait_basis") in (None, "visible_phase")


def _make_version2(db) -> None:
    """Turn a current file into what a processor before user_version 3 wrote: no collective
    columns, the shorter `packed` BLOB."""
    with sqlite3.connect(db) as conn:
        downgrade(conn, 2)  # no collective columns (nor what came after)
        legacy_values = 8 * (LEGACY_PACKED_FIELDS - 3)
        for row_id, packed in conn.execute("SELECT id, packed FROM step_time_samples").fetchall():
            old = packed[:legacy_values] + packed[-24:]  # drop the collective cpu/gpu pair
            conn.execute("UPDATE step_time_samples SET packed = ? WHERE id = ?", (old, row_id))


def test_an_old_database_is_read_as_is_and_migrated_by_the_writer(tmp_path):
    db = tmp_path / "old.db"
    _store(db, "run", {0: None, 1: None})
    _make_version2(db)
    before = _summary(db, "run")  # read-only readers widen the short rows
    assert before.window.step_count == 24  # no row skipped as unreadable
    assert before.window.metrics["backward"].rank_values == {0: 105.0, 1: 105.0}
    assert before.window.coverage["collective_wait"] == (0, 2)

    _store(db, "run", {0: 40.0, 1: 1.0}, steps=range(25, 49))  # the writer migrates, then appends
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_USER_VERSION
        columns = {r[1] for r in conn.execute("PRAGMA table_info(step_time_samples)")}
        assert set(metric_columns(v.METRIC_COLLECTIVE_WAIT)) <= columns
    after = _summary(db, "run")
    assert after.window.step_count == 48  # old and new rows in one window
    # Occurrence-driven: observed on 24 of 48 steps, the rest count 0 -> averages 20 and 0.5.
    assert after.window.metrics["collective_wait"].rank_values == {0: 20.0, 1: 0.5}
