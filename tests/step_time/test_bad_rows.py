"""Bad input never crashes a refresh: each case follows its documented rule with a counted reason.

Rules (processor/storage.py and step_time/sqlite.py docstrings):
- unknown raw event names: kept in the audit payload only, counted `unknown_event`;
- NaN/inf/negative durations at write: dropped to missing (tiny negatives floored), counted;
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
from collections import Counter

import pytest

from traceml.processor.step_time.model import RankIdentity, RawEventValue, StepTimeIngestRecord
from traceml.processor.step_time.pipeline import LiveStepTimeSession, StepTimePipeline, StepTimeRequest
from traceml.processor.step_time.sqlite import load_summary_snapshot
from traceml.processor.storage import (
    PACKED_FIELDS,
    SAMPLE_COLUMNS,
    StepTimeStore,
    metric_columns,
    normalise_step_record,
    pack_values,
)
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
    row = list(normalise_step_record(_record(rank, step), 0.0, Counter()))
    if payload is not None:
        row[SAMPLE_COLUMNS.index("payload")] = payload
    if packed != b"keep":
        row[SAMPLE_COLUMNS.index("packed")] = packed
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(f"INSERT INTO step_time_samples ({','.join(SAMPLE_COLUMNS)})"
                     f" VALUES ({','.join('?' * len(SAMPLE_COLUMNS))})", row)
    conn.close()


def _live(path):
    session = LiveStepTimeSession(path, RUN)
    return session, session.refresh()


def test_unknown_event_names_are_kept_for_audit_and_ignored_by_analysis(db):
    with StepTimeStore(db) as store:
        result = store.write([_record(r, 11, **{"_traceml_internal:new_thing": RawEventValue(9.0, None, 1)})
                              for r in (0, 1)])
    assert result.accepted == 2 and result.value_issues == {"unknown_event": 2}
    _, live = _live(db)
    assert live.freshness == "live" and live.analysis.window.steps[-1] == 11
    assert live.analysis.window.rank_facts[0].average.traced_step_time == 95.0


def test_nan_and_negative_durations_are_dropped_and_counted_at_write(db):
    with StepTimeStore(db) as store:
        result = store.write([
            _record(0, 11, **{v.RAW_FORWARD: RawEventValue(math.nan, None, 1)}),
            _record(1, 11, **{v.RAW_FORWARD: RawEventValue(-4.0, None, 1)}),
            _record(0, 12, **{v.RAW_H2D: RawEventValue(math.inf, None, 1)}),
            _record(1, 12),
        ])
    assert result.accepted == 4
    assert result.value_issues == {"non_finite_value": 2, "negative_value": 1}
    _, live = _live(db)
    window = live.analysis.window
    assert live.freshness == "live" and window.steps[-1] == 12
    # forward missing on one aligned step of each rank -> unavailable, not averaged over fewer steps
    assert window.rank_facts[0].average.forward is None
    assert window.rank_facts[1].average.forward is None
    assert window.rank_facts[1].average.h2d == 5.0


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


def test_negative_and_infinite_stored_values_are_dropped_on_read(db):
    columns = {metric_columns(m)[0]: 30.0 for m in CANONICAL_METRICS}
    columns["forward_cpu_ms"] = -3.0
    columns["h2d_cpu_ms"] = math.inf
    _insert_foreign(db, 0, 11, packed=pack_values(columns, 11.5, 0, 11))
    _insert_foreign(db, 1, 11)
    snapshot = load_summary_snapshot(db, RUN)
    assert snapshot.rejected == {"negative_value": 1, "non_finite_value": 1}
    analysis = StepTimePipeline().run(StepTimeRequest(db, RUN, profile="summary"))
    assert analysis.window.steps[-1] == 11
    assert analysis.window.rank_facts[0].average.forward is None
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
