"""The ingest hot paths take shortcuts; each shortcut must give what the general path gives.

- decode reads `double_value` / `int_value` without `WhichOneof` when the read is
  non-zero and in range: zero, wrong types, negatives and over-cap values must still
  take the checked path with the same reasons;
- normalise writes the audit JSON directly for plain rows: it must equal
  `json.dumps(..., sort_keys=True, separators=(",", ":"))`;
- the store inserts first and deletes only when a key existed: new, identical and
  changed rows mixed in one batch must count and store as before.
"""
from __future__ import annotations

import json
import sqlite3

import pytest
from harness.stored_rows import stored_run
from harness.otlp_payloads import step_span, trace_request

from traceml.processor.decode import Decoder
from traceml.processor.normalise import normalise_step_record
from traceml.processor.sqlite_layout import SAMPLE_COLUMNS
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.model import RankIdentity, RawEventValue, StepTimeIngestRecord
from traceml.schema import vocabulary as v

CPU = v.event_attribute(v.RAW_FORWARD, v.EVENT_FIELD_CPU)  # seconds
COUNT = v.event_attribute(v.RAW_FORWARD, v.EVENT_FIELD_COUNT)
LEGACY_CPU = v.legacy_event_attribute(v.RAW_FORWARD, "cpu_ms")  # milliseconds


def _decode(**extra):
    span = step_span(3, 0, extra=extra)
    return Decoder().decode_traces(trace_request("run-f", 0, [span]))


@pytest.mark.parametrize("key, cpu, count, expected", [
    (CPU, 0.0, 0, RawEventValue(0.0, None, 0)),   # zero reads like an unset member: checked path
    (CPU, 5, 1, RawEventValue(5000.0, None, 1)),  # an int where a double belongs: seconds, stored in ms
    (LEGACY_CPU, 5, 1, RawEventValue(5.0, None, 1)),  # ... and an older exporter's milliseconds
])
def test_values_the_fast_read_cannot_prove_take_the_checked_path(key, cpu, count, expected):
    batch = _decode(**{key: cpu, COUNT: count})
    (record,) = batch.step_records
    assert record.events[v.RAW_FORWARD] == expected
    assert not batch.rejected


@pytest.mark.parametrize("extra, reason", [
    ({CPU: "5.0"}, "wrong_attribute_type"),
    ({CPU: -1.0}, "negative_value"),
    ({CPU: float("nan")}, "non_finite_value"),
    ({CPU: 1e12}, "absurd_value"),
    ({CPU: 86_400.001}, "absurd_value"),           # just over one day, in seconds
    ({LEGACY_CPU: 86_400_001.0}, "absurd_value"),  # the same cap in an older exporter's milliseconds
    ({COUNT: 2.0}, "wrong_attribute_type"),        # a double where an int belongs
    ({COUNT: -2}, "negative_value"),
    ({COUNT: 10**12}, "absurd_value"),
    ({v.ATTR_STEP: 3.0}, "wrong_attribute_type"),
    ({v.ATTR_STEP: -1}, "negative_value"),
    ({v.ATTR_RANK: "0"}, "wrong_attribute_type"),
])
def test_unusual_values_are_rejected_with_the_precise_reason(extra, reason):
    batch = _decode(**extra)
    assert batch.step_records == []
    assert dict(batch.rejected) == {reason: 1}


def _record(step=1, events=None, strategy="ddp", identity=None):
    events = events if events is not None else {
        v.RAW_FORWARD: RawEventValue(30.25, None, 1),
        v.RAW_BACKWARD: RawEventValue(45.0, 44.5, 2),
        v.RAW_STEP_TIME: RawEventValue(95.0, None, 1),
    }
    return StepTimeIngestRecord("run-f", identity or RankIdentity(0, 0, 0, 2, 2, "h"), step,
                                1000.0 + step, 1000.5 + step, events, strategy)


@pytest.mark.parametrize("events", [
    None,
    {v.RAW_FORWARD: RawEventValue(1e-7, 123456.789, 7)},
    {v.RAW_FORWARD: RawEventValue(1.0, None, None)},             # no count attribute
    {v.RAW_FORWARD: RawEventValue(None, 2.5, 1)},                # GPU clock only
    {"_traceml_internal:mystery": RawEventValue(1.0, None, 1), v.RAW_H2D: RawEventValue(2.0, None, 1)},
])
def test_audit_json_is_what_json_dumps_writes(events):
    record = _record(events=events)
    row, _ = normalise_step_record(record, 0.0)
    expected = json.dumps({k: [e.cpu_ms, e.gpu_ms, e.count] for k, e in record.events.items()},
                          sort_keys=True, separators=(",", ":"))
    assert row[SAMPLE_COLUMNS.index("payload")] == expected


def test_digest_sees_every_sender_field_and_ignores_receive_time():
    base = normalise_step_record(_record(), 1.0)[0][-1]
    assert normalise_step_record(_record(), 2.0)[0][-1] == base
    variants = [
        _record(strategy="fsdp"),
        _record(identity=RankIdentity(0, 1, 0, 2, 2, "h")),
        _record(identity=RankIdentity(0, 0, 0, 2, 2, "other-host")),
        _record(events={v.RAW_FORWARD: RawEventValue(30.25, None, 2)}),
        StepTimeIngestRecord("run-f", RankIdentity(0, 0, 0, 2, 2, "h"), 1, 999.0, 1001.5,
                             _record().events, "ddp"),
    ]
    digests = {normalise_step_record(r, 1.0)[0][-1] for r in variants}
    assert len(digests) == len(variants) and base not in digests


def test_mixed_batch_of_new_identical_and_changed_rows(tmp_path):
    db = tmp_path / "f.db"
    with StepTimeStore(db) as store:
        first = store.write([_record(step=s) for s in (1, 2, 3)])
        assert (first.accepted, first.duplicates, first.replaced) == (3, 0, 0)
        changed = _record(step=2, events={v.RAW_FORWARD: RawEventValue(31.0, None, 1)})
        mixed = store.write([_record(step=1), changed, _record(step=4), _record(step=3)])
        assert (mixed.accepted, mixed.duplicates, mixed.replaced) == (2, 2, 1)
        again = store.write([_record(step=1), changed, _record(step=4)])
        assert (again.accepted, again.duplicates, again.replaced) == (0, 3, 0)
    latest = stored_run(db, "run-f").latest_row_id
    conn = sqlite3.connect(db)
    rows = dict(conn.execute("SELECT step, forward_cpu_ms FROM step_time_samples").fetchall())
    ids = dict(conn.execute("SELECT step, id FROM step_time_samples").fetchall())
    conn.close()
    assert rows == {1: 30.25, 2: 31.0, 3: 30.25, 4: 30.25}
    assert ids[2] > ids[3] and latest == max(ids.values())  # the replacement got a new, higher id
