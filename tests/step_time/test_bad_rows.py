"""Bad input never crashes a refresh: each case follows its documented rule with a counted reason.

Rules (processor/normalise.py, sqlite_writer.py and step_time/sqlite_reader.py docstrings):
- unknown raw event names: kept in the audit payload only, counted as unknown events;
- NaN/inf/negative/over-a-day durations never reach the writer: the decoder rejects
  their span whole (tests/processor/test_decode.py), so the rules below are for rows
  some other tool wrote;
- a row written by some other tool with an unparsable payload: the payload is never
  parsed on the read path, so the row's typed values are used;
- a row whose packed values are missing or malformed: skipped, counted `unreadable_values`;
- negative or infinite values inside a stored row: dropped to missing, counted;
- a duplicate (rank, step): identical -> counted duplicate; different -> latest wins.
"""
from __future__ import annotations

import math
import sqlite3
import struct

import pytest
from harness.stored_rows import insert_foreign_row, pack_values

from traceml.processor.step_time.model import RankIdentity, RawEventValue, StepTimeIngestRecord
from traceml.processor.step_time.pipeline import LiveStepTimeSession, StepTimePipeline, StepTimeRequest
from traceml.processor.step_time.sqlite_reader import load_summary_snapshot
from traceml.processor.normalise import normalise_step_record
from traceml.processor.sqlite_layout import PACKED_FIELDS, SAMPLE_COLUMNS, metric_columns
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.schema import vocabulary as v
from traceml.schema.vocabulary import CANONICAL_METRICS

RUN = "bad"


def _record(rank, step, **overrides):
    events = {v.RAW_DATALOADER_NEXT: RawEventValue(5.0, None, 1),
              v.RAW_H2D: RawEventValue(5.0, None, 1),
              v.RAW_FORWARD: RawEventValue(30.0, None, 1),
              v.RAW_BACKWARD: RawEventValue(45.0, None, 1),
              v.RAW_OPTIMIZER_STEP: RawEventValue(10.0, None, 1),
              v.RAW_STEP_TIME: RawEventValue(95.0, None, 1)}
    events.update(overrides)
    return StepTimeIngestRecord(RUN, RankIdentity(rank, world_size=2), step, float(step),
                                step + 0.5, events, "ddp")


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "bad.db"
    with StepTimeStore(path) as store:
        store.write([_record(r, s) for s in range(1, 11) for r in (0, 1)])
    return path


def _insert_foreign(path, rank, step, *, payload=None, packed=b"keep"):
    """Insert a row the way a foreign or broken writer might, bypassing StepTimeStore."""
    row = list(normalise_step_record(_record(rank, step), 0.0)[0])
    if payload is not None:
        row[SAMPLE_COLUMNS.index("payload")] = payload
    if packed != b"keep":
        row[SAMPLE_COLUMNS.index("packed")] = packed
    insert_foreign_row(path, tuple(row))


def _live(path):
    session = LiveStepTimeSession(path, RUN)
    return session, session.refresh()


def test_unknown_event_names_are_kept_for_audit_and_ignored_by_analysis(db):
    with StepTimeStore(db) as store:
        result = store.write([_record(r, 11, **{"_traceml_internal:new_thing": RawEventValue(9.0, None, 1)})
                              for r in (0, 1)])
    assert result.accepted == 2 and result.unknown_events == 2
    _, live = _live(db)
    assert live.freshness == "live" and live.analysis.window.steps[-1] == 11
    assert live.analysis.window.rank_facts[0].average.traced_step_time == 95.0


def test_unparsable_payload_is_never_parsed_on_the_read_path(db):
    _insert_foreign(db, 0, 11, payload="{not json")
    _insert_foreign(db, 1, 11, payload="\x00\xff")
    _, live = _live(db)
    assert live.freshness == "live" and live.analysis.window.steps[-1] == 11
    assert live.analysis.window.rank_facts[1].average.forward == 30.0


@pytest.mark.parametrize("packed", [
    None, b"short", "text instead of bytes",
    struct.pack(f"<{PACKED_FIELDS}d", *([1.0] * (PACKED_FIELDS - 1) + [math.nan])),  # no step
])
def test_rows_with_unreadable_values_are_skipped_and_counted(db, packed):
    _insert_foreign(db, 0, 11, packed=packed)
    _insert_foreign(db, 1, 11)
    session, live = _live(db)
    assert live.freshness == "live"
    assert live.analysis.window.steps[-1] == 10  # rank 0's step 11 was skipped: not common
    snapshot = load_summary_snapshot(db, RUN)
    assert snapshot.rejected == {"unreadable_values": 1}


def test_negative_infinite_and_over_a_day_stored_values_are_dropped_on_read(db):
    columns = {metric_columns(m)[0]: 30.0 for m in CANONICAL_METRICS}
    columns["forward_cpu_ms"] = -3.0
    columns["h2d_cpu_ms"] = math.inf
    columns["backward_cpu_ms"] = 86_400_001.0
    _insert_foreign(db, 0, 11, packed=pack_values(columns, 11.5, 0, 11))
    _insert_foreign(db, 1, 11)
    snapshot = load_summary_snapshot(db, RUN)
    assert snapshot.rejected == {"negative_value": 1, "non_finite_value": 1, "absurd_value": 1}
    analysis = StepTimePipeline().run(StepTimeRequest(db, RUN, profile="summary"))
    assert analysis.window.steps[-1] == 11
    assert analysis.window.rank_facts[0].average.forward is None
    assert analysis.window.rank_facts[0].average.backward is None
    assert analysis.window.rank_facts[0].average.h2d == pytest.approx(5.0 * 10 / 11)  # absent -> 0


def test_duplicate_rank_step_follows_latest_wins_and_live_reads_see_it(db):
    session, first = _live(db)
    with StepTimeStore(db) as store:
        same = store.write([_record(0, 10)])
        changed = store.write([_record(0, 10, **{v.RAW_FORWARD: RawEventValue(40.0, None, 1)})])
    assert (same.accepted, same.duplicates) == (0, 1)
    assert (changed.accepted, changed.replaced) == (1, 1)
    second = session.refresh()
    assert second.analysis is not first.analysis
    assert second.analysis.window.rank_facts[0].average.forward == pytest.approx(31.0)
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT count(*) FROM step_time_samples WHERE global_rank = 0 AND step = 10"
                        ).fetchone() == (1,)
    conn.close()


def test_a_corrupt_database_file_bridges_instead_of_crashing(db, tmp_path):
    session, good = _live(db)
    db.write_bytes(b"this is not a database" * 100)
    for suffix in ("-wal", "-shm"):
        (db.parent / (db.name + suffix)).unlink(missing_ok=True)
    result = session.refresh()
    assert result.freshness == "bridged" and result.analysis is good.analysis
    assert "DatabaseError" in result.error


def test_rows_of_a_rank_missing_from_the_rank_table_join_the_universe(db):
    session, first = _live(db)
    assert first.analysis.window.expected_ranks == (0, 1)
    for rank in (0, 1, 5):  # rank 5 never registered through the store
        _insert_foreign(db, rank, 11)
    result = session.refresh()
    assert result.freshness == "live"
    assert result.analysis.window.expected_ranks == (0, 1, 5)
    assert result.analysis.window.steps == (11,)
