"""SQLite normalisation: the write side of the processor's Step Time store.

Receivers hand decoded records to `StepTimeStore.write`; this module is the
normalisation boundary. Raw event names (`_traceml_internal:*`) become canonical
metric columns here (`forward_cpu_ms`, `forward_gpu_ms`, `forward_count`, ...),
so the read side never decodes JSON. The raw events are kept as JSON text in
`payload` (JSON: raw event name -> [cpu_ms, gpu_ms, count]) for audit and for
event names this version does not know.

Rules applied at write (each counted in `WriteResult` and logged once per reason):

- A record without a run id, with a negative or non-integer rank or step, or a
  non-finite timestamp is rejected whole (`WriteResult.rejected[reason]`).
- A value that is NaN/inf (`non_finite_value`), negative beyond timer noise
  (`negative_value`) or longer than a day (`absurd_value`) is dropped to missing;
  the rest of the row is kept (`WriteResult.value_issues[reason]`). A negative
  value within `NEGATIVE_FLOOR_MS` of zero is timer noise and floored to 0.0
  (`negative_floored`). `None` stays missing; a measured 0.0 stays 0.0.
- Unknown raw event names stay in `payload` only (`unknown_event`).
- Re-sent identical (run, rank, step) rows add nothing (`duplicates`); a
  different row for the same key replaces the stored one (latest wins) and gets
  a new, higher row id so live readers that tail by id see the change.

One writer connection behind a lock; every `write` commits before it returns.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import sqlite3
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from traceml.processor.step_time.model import (
    RawEventValue,
    StepMemoryIngestRecord,
    StepTimeIngestRecord,
)
from traceml.schema.vocabulary import CANONICAL_METRICS, RAW_EVENT_TO_METRIC

LOG = logging.getLogger(__name__)

SCHEMA_USER_VERSION = 1

NEGATIVE_FLOOR_MS = 0.01
"""Negative durations this close to zero are timer noise: floored to 0.0."""
ABSURD_MS = 86_400_000.0
"""A phase longer than a day is a broken clock, not a measurement."""

# Rejection / value-issue reasons (stable strings: receivers and tests use them).
REJECT_MISSING_RUN_ID = "missing_run_id"
REJECT_BAD_RANK = "bad_rank"
REJECT_BAD_STEP = "bad_step"
REJECT_BAD_TIME = "bad_time"
REJECT_BAD_EVENTS = "bad_events"
REJECT_BAD_MEMORY = "bad_memory_value"
VALUE_NON_FINITE = "non_finite_value"
VALUE_NEGATIVE = "negative_value"
VALUE_NEGATIVE_FLOORED = "negative_floored"
VALUE_ABSURD = "absurd_value"
VALUE_BAD_COUNT = "bad_count"
VALUE_UNKNOWN_EVENT = "unknown_event"


def metric_columns(metric: str) -> tuple[str, str, str]:
    """Canonical metric -> its (cpu ms, gpu ms, count) column names."""
    return f"{metric}_cpu_ms", f"{metric}_gpu_ms", f"{metric}_count"


METRIC_VALUE_COLUMNS: tuple[str, ...] = tuple(
    column for metric in CANONICAL_METRICS for column in metric_columns(metric)
)
_RAW_EVENT_SLOT: Mapping[str, int] = {
    raw: 3 * CANONICAL_METRICS.index(metric) for raw, metric in RAW_EVENT_TO_METRIC.items()
}  # raw event -> index of its cpu column in METRIC_VALUE_COLUMNS (gpu +1, count +2)
_PACKED_SLOTS: tuple[int, ...] = tuple(
    i for k in range(len(CANONICAL_METRICS)) for i in (3 * k, 3 * k + 1)
)
_NAN = float("nan")

PACKED_METRICS: tuple[str, ...] = CANONICAL_METRICS
"""Order of the metrics inside `packed`."""
PACKED_VALUES = 2 * len(PACKED_METRICS)
PACKED_SAMPLE_TIME, PACKED_RANK, PACKED_STEP = PACKED_VALUES, PACKED_VALUES + 1, PACKED_VALUES + 2
PACKED_FIELDS = PACKED_VALUES + 3
PACKED_FORMAT = struct.Struct(f"<{PACKED_FIELDS}d")
"""`packed` = little-endian float64 [m0 cpu, m0 gpu, m1 cpu, ..., sample_time, global_rank,
step]; NaN = missing.

The same cleaned values as the typed columns (plus the row's rank and step, exact
in float64), in one BLOB: the analysis read path turns a whole selection into one
numpy array with a single `frombuffer`, instead of building one Python object per
value (which is what made the original slow). Only `StepTimeStore` writes it.
"""

SAMPLE_COLUMNS: tuple[str, ...] = (
    "run_id", "global_rank", "local_rank", "node_rank", "world_size", "local_world_size",
    "hostname", "step", "start_time", "sample_time", "receive_time", "training_strategy",
    *METRIC_VALUE_COLUMNS, "payload", "packed", "digest",
)

_INSERT_SAMPLE = (
    f"INSERT OR IGNORE INTO step_time_samples ({','.join(SAMPLE_COLUMNS)})"
    f" VALUES ({','.join('?' * len(SAMPLE_COLUMNS))})"
)

_METRIC_DDL = ",\n    ".join(
    f"{c} {'INTEGER' if c.endswith('_count') else 'REAL'}" for c in METRIC_VALUE_COLUMNS
)

DDL = f"""
CREATE TABLE IF NOT EXISTS step_time_samples (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    global_rank INTEGER NOT NULL,
    local_rank INTEGER,
    node_rank INTEGER,
    world_size INTEGER,
    local_world_size INTEGER,
    hostname TEXT,
    step INTEGER NOT NULL,
    start_time REAL,
    sample_time REAL,
    receive_time REAL NOT NULL,
    training_strategy TEXT,
    {_METRIC_DDL},
    payload TEXT NOT NULL,
    packed BLOB,
    digest TEXT NOT NULL,
    UNIQUE (run_id, global_rank, step)
);
-- Live tail: latest steps of a run (range on step) and rows newer than a cursor (rowid).
CREATE INDEX IF NOT EXISTS step_time_samples_run_step ON step_time_samples (run_id, step);
CREATE INDEX IF NOT EXISTS step_time_samples_run ON step_time_samples (run_id);

CREATE TABLE IF NOT EXISTS step_memory_samples (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    global_rank INTEGER NOT NULL,
    step INTEGER NOT NULL,
    device TEXT NOT NULL,
    peak_allocated_bytes INTEGER,
    peak_reserved_bytes INTEGER,
    sample_time REAL,
    receive_time REAL NOT NULL,
    UNIQUE (run_id, global_rank, step, device)
);

-- One row per run: strategy, rank-universe version (bumped when a rank appears or its
-- identity changes) and the stored cursor (latest row id, latest step).
CREATE TABLE IF NOT EXISTS step_time_runs (
    run_id TEXT PRIMARY KEY,
    training_strategy TEXT,
    ranks_version INTEGER NOT NULL DEFAULT 0,
    latest_row_id INTEGER NOT NULL DEFAULT 0,
    latest_step INTEGER,
    first_receive_time REAL NOT NULL,
    last_receive_time REAL NOT NULL,
    last_sample_time REAL
);

-- The persisted rank universe of a run, with identity and end-of-run facts.
CREATE TABLE IF NOT EXISTS step_time_ranks (
    run_id TEXT NOT NULL,
    global_rank INTEGER NOT NULL,
    local_rank INTEGER,
    node_rank INTEGER,
    world_size INTEGER,
    local_world_size INTEGER,
    hostname TEXT,
    first_receive_time REAL NOT NULL,
    finished_time REAL,
    final_counts TEXT,
    PRIMARY KEY (run_id, global_rank)
);

-- Telemetry a rank reported dropped (cumulative per queue; the largest report is kept).
CREATE TABLE IF NOT EXISTS step_time_drops (
    run_id TEXT NOT NULL,
    global_rank INTEGER NOT NULL,
    queue TEXT NOT NULL,
    dropped INTEGER NOT NULL,
    PRIMARY KEY (run_id, global_rank, queue)
);
"""


@dataclass(frozen=True)
class WriteResult:
    """What one `write` call did. `rejected` counts whole records refused, by reason;
    `value_issues` counts single values dropped or floored inside accepted rows."""

    accepted: int
    duplicates: int
    rejected: Mapping[str, int] = field(default_factory=dict)
    replaced: int = 0
    value_issues: Mapping[str, int] = field(default_factory=dict)

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())


@dataclass(frozen=True)
class RunRecord:
    """One run as stored: strategy and cursor."""

    run_id: str
    training_strategy: str | None
    latest_row_id: int
    latest_step: int | None
    last_receive_time: float
    last_sample_time: float | None


def open_connection(path: str | Path, *, readonly: bool = False) -> sqlite3.Connection:
    """A connection with the project's pragmas. Read-only ones never create the file."""
    if readonly:
        conn = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True, timeout=5.0,
                               check_same_thread=False)
    else:
        conn = sqlite3.connect(str(path), timeout=5.0, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 5000")
    return conn


def ensure_schema(conn: sqlite3.Connection) -> None:
    """Create tables and indexes (idempotent) and switch the file to WAL."""
    conn.execute("PRAGMA journal_mode = WAL")
    conn.executescript(DDL)
    conn.execute(f"PRAGMA user_version = {SCHEMA_USER_VERSION}")
    conn.commit()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _clean_ms(value: object, issues: Counter) -> float | None:
    if value.__class__ is float and 0.0 <= value <= ABSURD_MS:  # the common case, first
        return value
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        issues[VALUE_NON_FINITE] += 1
        return None
    value = float(value)
    if not math.isfinite(value):
        issues[VALUE_NON_FINITE] += 1
        return None
    if value < 0.0:
        if value >= -NEGATIVE_FLOOR_MS:
            issues[VALUE_NEGATIVE_FLOORED] += 1
            return 0.0
        issues[VALUE_NEGATIVE] += 1
        return None
    if value > ABSURD_MS:
        issues[VALUE_ABSURD] += 1
        return None
    return value


def _clean_count(value: object, issues: Counter) -> int | None:
    if value.__class__ is int and value >= 0:
        return value
    if value is None:
        return None
    if _is_int(value) and value >= 0:
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value >= 0 and value.is_integer():
        return int(value)
    issues[VALUE_BAD_COUNT] += 1
    return None


def _json_number(value: object) -> object:
    """Keep the raw payload valid JSON even when a value was NaN/inf (audit only)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


def _optional_int(value: object) -> int | None:
    if value.__class__ is int:
        return value if value >= 0 else None
    return int(value) if _is_int(value) and value >= 0 else None


def _event_values(raw) -> tuple:
    """(cpu_ms, gpu_ms, count) of one decoded event value; None for whatever it lacks."""
    return getattr(raw, "cpu_ms", None), getattr(raw, "gpu_ms", None), getattr(raw, "count", None)


def normalise_step_record(
    record: StepTimeIngestRecord, receive_time: float, issues: Counter
) -> tuple | str:
    """One ingest record -> a `step_time_samples` row tuple, or a rejection reason."""
    if not isinstance(record.run_id, str) or not record.run_id:
        return REJECT_MISSING_RUN_ID
    identity = record.identity
    rank = getattr(identity, "global_rank", None)
    if not _is_int(rank) or rank < 0:
        return REJECT_BAD_RANK
    if not _is_int(record.step) or record.step < 0:
        return REJECT_BAD_STEP
    for stamp in (record.start_time, record.sample_time):
        if stamp is not None and not (stamp.__class__ is float and stamp - stamp == 0.0) \
                and not _is_finite_number(stamp):
            return REJECT_BAD_TIME
    if record.events.__class__ is not dict and not isinstance(record.events, Mapping):
        return REJECT_BAD_EVENTS

    flat: list[float | int | None] = [None] * len(METRIC_VALUE_COLUMNS)
    # While every name is known and every value a plain None / finite float / int, the
    # audit JSON is written directly (same text as json.dumps, a fraction of the cost).
    plain: list[tuple[str, str]] | None = []
    slots = _RAW_EVENT_SLOT
    for raw_name, raw in record.events.items():
        if not isinstance(raw_name, str):
            return REJECT_BAD_EVENTS
        if raw.__class__ is RawEventValue:
            cpu, gpu, count = raw.cpu_ms, raw.gpu_ms, raw.count
        else:
            cpu, gpu, count = _event_values(raw)
        k = slots.get(raw_name)
        if k is None:
            issues[VALUE_UNKNOWN_EVENT] += 1
            plain = None
            continue
        if (cpu.__class__ is float and 0.0 <= cpu <= ABSURD_MS
                and (gpu is None or (gpu.__class__ is float and 0.0 <= gpu <= ABSURD_MS))
                and count.__class__ is int and count >= 0):
            flat[k], flat[k + 1], flat[k + 2] = cpu, gpu, count
            if plain is not None:
                plain.append((raw_name, f"{_JSON_EVENT_NAME[raw_name]}:[{_float_repr(cpu)},"
                                        f"{'null' if gpu is None else _float_repr(gpu)},{count}]"))
            continue
        plain = None  # anything unusual goes through the counting cleaners and json.dumps
        flat[k] = _clean_ms(cpu, issues)
        flat[k + 1] = _clean_ms(gpu, issues)
        flat[k + 2] = _clean_count(count, issues)

    if plain is not None:
        plain.sort()
        payload_text = "{" + ",".join([text for _, text in plain]) + "}"
    else:
        # Only this path needs the values as a mapping (the plain path wrote the text).
        payload = {name: list(_event_values(raw)) for name, raw in record.events.items()}
        try:
            payload_text = json.dumps(payload, sort_keys=True, separators=(",", ":"),
                                      allow_nan=False)
        except (TypeError, ValueError):  # NaN/inf or a non-number: keep the audit copy strict JSON
            payload_text = json.dumps({k: [_json_number(x) for x in v] for k, v in payload.items()},
                                      sort_keys=True, separators=(",", ":"), default=repr)
    run_id, raw_strategy = record.run_id, record.training_strategy
    cached = _last_identity
    if cached[0] is identity and cached[1] is run_id and cached[2] is raw_strategy:
        head = cached[3]  # spans of one resource share their identity object
    else:
        head = _identity_head(run_id, identity, raw_strategy)
    start_time = None if record.start_time is None else float(record.start_time)
    sample_time = None if record.sample_time is None else float(record.sample_time)
    step = record.step
    packed = PACKED_FORMAT.pack(*[_NAN if flat[i] is None else flat[i] for i in _PACKED_SLOTS],
                                _NAN if sample_time is None else sample_time, rank, step)
    # The digest covers everything a sender controls: identity and strategy (head), the
    # raw events (payload JSON, which never holds a NUL), the cleaned values, end time,
    # rank and step (packed, exact float64) and the start time. A resend is recognised
    # whatever the receive time; any real difference replaces the row.
    h = _blake2b(payload_text.encode(), digest_size=16)
    h.update(b"\0")
    h.update(packed)
    h.update(_START_TIME.pack(_NAN if start_time is None else start_time))
    h.update(head[-1])
    _, local_rank, node_rank, world_size, local_world_size, hostname, strategy, _ = head
    return (run_id, rank, local_rank, node_rank, world_size, local_world_size, hostname,
            step, start_time, sample_time, receive_time, strategy, *flat, payload_text, packed,
            h.hexdigest())


_START_TIME = struct.Struct("<d")
_last_identity: tuple = (None, None, None, None)  # (identity, run id, raw strategy, head)


def _identity_head(run_id: str, identity: object, raw_strategy: object) -> tuple:
    """(run id, local rank, node rank, world size, local world size, hostname, strategy,
    their repr as bytes for the digest); the last one is remembered for the next span."""
    global _last_identity
    hostname = identity.hostname if isinstance(identity.hostname, str) else None
    strategy = raw_strategy if isinstance(raw_strategy, str) else None
    fields = (run_id, _optional_int(identity.local_rank), _optional_int(identity.node_rank),
              _optional_int(identity.world_size), _optional_int(identity.local_world_size),
              hostname, strategy)
    head = (*fields, repr(fields).encode())
    _last_identity = (identity, run_id, raw_strategy, head)
    return head


_blake2b = hashlib.blake2b
_JSON_EVENT_NAME: Mapping[str, str] = {raw: json.dumps(raw) for raw in RAW_EVENT_TO_METRIC}
_float_repr = float.__repr__  # what json.dumps writes for a finite float


def pack_values(values: Mapping[str, float | None], sample_time: float | None, rank: int,
                step: int) -> bytes:
    """Column name -> cleaned value, into the `packed` BLOB layout (NaN for missing)."""
    flat = []
    for metric in PACKED_METRICS:
        cpu_col, gpu_col, _ = metric_columns(metric)
        for col in (cpu_col, gpu_col):
            value = values.get(col)
            flat.append(_NAN if value is None else float(value))
    flat.append(_NAN if sample_time is None else float(sample_time))
    return PACKED_FORMAT.pack(*flat, rank, step)


class StepTimeStore:
    """The processor's single SQLite writer (WAL). Thread-safe: one connection, one lock."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._conn = open_connection(self.path)
        # WAL + synchronous=NORMAL: a commit is durable against a killed process (the WAL
        # holds it); only an OS crash or power loss may lose the last commits. See
        # docs/processor.md. A modest page cache (16 MiB, default 2 MiB) keeps more of the
        # rank-spread unique index in memory; fewer automatic checkpoints mean fewer
        # fsyncs in the commit path.
        self._conn.execute("PRAGMA synchronous = NORMAL")
        self._conn.execute("PRAGMA cache_size = -16384")  # KiB
        self._conn.execute("PRAGMA wal_autocheckpoint = 4000")  # pages
        ensure_schema(self._conn)
        self._logged_reasons: set[str] = set()
        self._closed = False

    # --- writing ---------------------------------------------------------------------

    def write(
        self,
        step_records: Iterable[StepTimeIngestRecord] = (),
        memory_records: Iterable[StepMemoryIngestRecord] = (),
        *,
        receive_time: float | None = None,
    ) -> WriteResult:
        """Normalise, deduplicate and commit both kinds of records; returns after commit."""
        now = time.time() if receive_time is None else receive_time
        rejected: Counter = Counter()
        issues: Counter = Counter()

        step_rows: dict[tuple[str, int, int], tuple] = {}
        duplicates = 0
        superseded = 0  # a different row for the same key later in this batch (latest wins)
        for record in step_records:
            try:
                row = normalise_step_record(record, now, issues)
            except (AttributeError, TypeError, ValueError):
                row = REJECT_BAD_EVENTS
            if isinstance(row, str):
                rejected[row] += 1
                continue
            key = (row[0], row[1], row[7])
            previous = step_rows.get(key)
            if previous is not None:
                if previous[-1] == row[-1]:
                    duplicates += 1
                else:
                    superseded += 1
            step_rows[key] = row

        memory_rows: dict[tuple[str, int, int, str], tuple] = {}
        for record in memory_records:
            row = self._memory_row(record, now)
            if isinstance(row, str):
                rejected[row] += 1
                continue
            key = (row[0], row[1], row[2], row[3])
            previous = memory_rows.get(key)
            if previous is not None:
                if previous[:7] == row[:7]:
                    duplicates += 1
                else:
                    superseded += 1
            memory_rows[key] = row

        accepted = superseded
        replaced = superseded
        with self._lock:
            self._check_open()
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                if step_rows:
                    rows = list(step_rows.values())
                    # Insert first: when every key is new (the common case) nothing else
                    # runs. Otherwise drop the stored rows whose digest differs (latest
                    # wins, and the re-insert gets a new, higher id) and insert again;
                    # what is still ignored then was an identical resend.
                    before = conn.total_changes
                    conn.executemany(_INSERT_SAMPLE, rows)
                    inserted = conn.total_changes - before
                    if inserted != len(rows):
                        before = conn.total_changes
                        conn.executemany(
                            "DELETE FROM step_time_samples"
                            " WHERE run_id = ? AND global_rank = ? AND step = ? AND digest != ?",
                            [(r[0], r[1], r[7], r[-1]) for r in rows],
                        )
                        deleted = conn.total_changes - before
                        if deleted:
                            replaced += deleted
                            before = conn.total_changes
                            conn.executemany(_INSERT_SAMPLE, rows)
                            inserted += conn.total_changes - before
                    accepted += inserted
                    duplicates += len(rows) - inserted
                    self._update_runs_and_ranks(conn, rows, now)
                if memory_rows:
                    rows = list(memory_rows.values())
                    conn.executemany(
                        "DELETE FROM step_memory_samples WHERE run_id = ? AND global_rank = ?"
                        " AND step = ? AND device = ? AND (peak_allocated_bytes IS NOT ?"
                        " OR peak_reserved_bytes IS NOT ? OR sample_time IS NOT ?)",
                        [(r[0], r[1], r[2], r[3], r[4], r[5], r[6]) for r in rows],
                    )
                    before = conn.total_changes
                    conn.executemany(
                        "INSERT OR IGNORE INTO step_memory_samples (run_id, global_rank, step,"
                        " device, peak_allocated_bytes, peak_reserved_bytes, sample_time,"
                        " receive_time) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        rows,
                    )
                    inserted = conn.total_changes - before
                    accepted += inserted
                    duplicates += len(rows) - inserted
                conn.commit()
            except BaseException:
                conn.rollback()
                raise
        self._log_reasons(rejected, issues)
        return WriteResult(accepted=accepted, duplicates=duplicates, rejected=dict(rejected),
                           replaced=replaced, value_issues=dict(issues))

    @staticmethod
    def _memory_row(record: StepMemoryIngestRecord, now: float) -> tuple | str:
        if not isinstance(record.run_id, str) or not record.run_id:
            return REJECT_MISSING_RUN_ID
        if not _is_int(record.global_rank) or record.global_rank < 0:
            return REJECT_BAD_RANK
        if not _is_int(record.step) or record.step < 0:
            return REJECT_BAD_STEP
        if record.sample_time is not None and not _is_finite_number(record.sample_time):
            return REJECT_BAD_TIME
        for value in (record.peak_allocated_bytes, record.peak_reserved_bytes):
            if value is not None and (not _is_int(value) or value < 0):
                return REJECT_BAD_MEMORY
        device = record.device if isinstance(record.device, str) and record.device else "unknown"
        return (record.run_id, record.global_rank, record.step, device,
                record.peak_allocated_bytes, record.peak_reserved_bytes,
                None if record.sample_time is None else float(record.sample_time), now)

    @staticmethod
    def _update_runs_and_ranks(conn: sqlite3.Connection, rows: Sequence[tuple], now: float) -> None:
        per_run: dict[str, list] = {}
        ranks: dict[tuple[str, int], tuple] = {}
        for r in rows:
            entry = per_run.setdefault(r[0], [None, None, None])  # strategy, max step, max sample
            if r[11] is not None:
                entry[0] = r[11]
            entry[1] = r[7] if entry[1] is None else max(entry[1], r[7])
            if r[9] is not None:
                entry[2] = r[9] if entry[2] is None else max(entry[2], r[9])
            ranks[(r[0], r[1])] = r[:7]
        for run_id, (strategy, max_step, max_sample) in per_run.items():
            conn.execute(
                "INSERT INTO step_time_runs (run_id, training_strategy, latest_row_id, latest_step,"
                " first_receive_time, last_receive_time, last_sample_time)"
                " VALUES (?, ?, 0, ?, ?, ?, ?)"
                " ON CONFLICT (run_id) DO UPDATE SET"
                " training_strategy = coalesce(excluded.training_strategy, training_strategy),"
                " latest_step = max(coalesce(latest_step, excluded.latest_step), excluded.latest_step),"
                " last_receive_time = excluded.last_receive_time,"
                " last_sample_time = max(coalesce(last_sample_time, excluded.last_sample_time),"
                "                        coalesce(excluded.last_sample_time, last_sample_time))",
                (run_id, strategy, max_step, now, now, max_sample),
            )
            conn.execute(
                "UPDATE step_time_runs SET latest_row_id ="
                " (SELECT coalesce(max(id), 0) FROM step_time_samples WHERE run_id = ?)"
                " WHERE run_id = ?",
                (run_id, run_id),
            )
        before = conn.total_changes
        conn.executemany(
            "INSERT INTO step_time_ranks (run_id, global_rank, local_rank, node_rank, world_size,"
            " local_world_size, hostname, first_receive_time) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (run_id, global_rank) DO UPDATE SET"
            " local_rank = coalesce(excluded.local_rank, local_rank),"
            " node_rank = coalesce(excluded.node_rank, node_rank),"
            " world_size = coalesce(excluded.world_size, world_size),"
            " local_world_size = coalesce(excluded.local_world_size, local_world_size),"
            " hostname = coalesce(excluded.hostname, hostname)"
            " WHERE (excluded.local_rank IS NOT NULL AND excluded.local_rank IS NOT local_rank)"
            " OR (excluded.node_rank IS NOT NULL AND excluded.node_rank IS NOT node_rank)"
            " OR (excluded.world_size IS NOT NULL AND excluded.world_size IS NOT world_size)"
            " OR (excluded.local_world_size IS NOT NULL"
            "     AND excluded.local_world_size IS NOT local_world_size)"
            " OR (excluded.hostname IS NOT NULL AND excluded.hostname IS NOT hostname)",
            [(*identity, now) for identity in ranks.values()],
        )
        if conn.total_changes != before:
            changed_runs = {run_id for run_id, _ in ranks}
            conn.executemany(
                "UPDATE step_time_runs SET ranks_version = ranks_version + 1 WHERE run_id = ?",
                [(run_id,) for run_id in changed_runs])

    def mark_rank_finished(self, run_id: str, rank: int, final_counts: Mapping[str, int]) -> None:
        """Record a rank's clean end (the `traceml.run.end` marker) with its final counts."""
        if not isinstance(run_id, str) or not run_id or not _is_int(rank) or rank < 0:
            raise ValueError(f"bad run/rank: {run_id!r}/{rank!r}")
        counts = {str(k): int(v) for k, v in dict(final_counts).items()
                  if _is_int(v) or (isinstance(v, float) and math.isfinite(v))}
        now = time.time()
        with self._lock:
            self._check_open()
            with self._conn:
                self._conn.execute(
                    "INSERT INTO step_time_runs (run_id, first_receive_time, last_receive_time)"
                    " VALUES (?, ?, ?) ON CONFLICT (run_id) DO UPDATE SET"
                    " last_receive_time = excluded.last_receive_time",
                    (run_id, now, now),
                )
                cur = self._conn.execute(
                    "INSERT OR IGNORE INTO step_time_ranks (run_id, global_rank, first_receive_time)"
                    " VALUES (?, ?, ?)", (run_id, rank, now))
                if cur.rowcount:  # a rank the universe did not hold yet
                    self._conn.execute(
                        "UPDATE step_time_runs SET ranks_version = ranks_version + 1"
                        " WHERE run_id = ?", (run_id,))
                self._conn.execute(
                    "UPDATE step_time_ranks SET finished_time = ?, final_counts = ?"
                    " WHERE run_id = ? AND global_rank = ?",
                    (now, json.dumps(counts, sort_keys=True), run_id, rank),
                )

    def record_drops(self, run_id: str, rank: int, counts: Mapping[str, int]) -> None:
        """Store a rank's cumulative dropped-telemetry counters (largest report per queue wins)."""
        if not isinstance(run_id, str) or not run_id or not _is_int(rank) or rank < 0:
            raise ValueError(f"bad run/rank: {run_id!r}/{rank!r}")
        rows = [(run_id, rank, str(queue), int(n)) for queue, n in dict(counts).items()
                if (_is_int(n) or (isinstance(n, float) and math.isfinite(n))) and n >= 0]
        if not rows:
            return
        with self._lock:
            self._check_open()
            with self._conn:
                self._conn.executemany(
                    "INSERT INTO step_time_drops (run_id, global_rank, queue, dropped)"
                    " VALUES (?, ?, ?, ?) ON CONFLICT (run_id, global_rank, queue) DO UPDATE SET"
                    " dropped = max(dropped, excluded.dropped)",
                    rows,
                )

    # --- small reads for the service (the analysis read side is step_time/sqlite.py) ---

    def runs(self) -> list[str]:
        """Run ids known to the store, oldest first."""
        with self._lock:
            self._check_open()
            cur = self._conn.execute(
                "SELECT run_id FROM step_time_runs ORDER BY first_receive_time, run_id")
            return [r[0] for r in cur.fetchall()]

    def run_record(self, run_id: str) -> RunRecord | None:
        with self._lock:
            self._check_open()
            row = self._conn.execute(
                "SELECT run_id, training_strategy, latest_row_id, latest_step, last_receive_time,"
                " last_sample_time FROM step_time_runs WHERE run_id = ?", (run_id,)).fetchone()
        return None if row is None else RunRecord(*row)

    def finished_ranks(self, run_id: str) -> dict[int, dict[str, int]]:
        """Ranks that sent their end-of-run marker -> their final counts."""
        with self._lock:
            self._check_open()
            rows = self._conn.execute(
                "SELECT global_rank, final_counts FROM step_time_ranks"
                " WHERE run_id = ? AND finished_time IS NOT NULL", (run_id,)).fetchall()
        return {rank: json.loads(counts or "{}") for rank, counts in rows}

    def drops(self, run_id: str) -> dict[int, dict[str, int]]:
        """rank -> queue -> dropped records reported."""
        with self._lock:
            self._check_open()
            rows = self._conn.execute(
                "SELECT global_rank, queue, dropped FROM step_time_drops WHERE run_id = ?",
                (run_id,)).fetchall()
        out: dict[int, dict[str, int]] = {}
        for rank, queue, dropped in rows:
            out.setdefault(rank, {})[queue] = dropped
        return out

    # --- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()

    def __enter__(self) -> "StepTimeStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("StepTimeStore is closed")

    def _log_reasons(self, rejected: Counter, issues: Counter) -> None:
        for reason, count in (*rejected.items(), *issues.items()):
            if reason not in self._logged_reasons:
                self._logged_reasons.add(reason)
                LOG.warning("step time store: %d record value(s) %s (logged once per reason)",
                            count, reason)
            else:
                LOG.debug("step time store: %d %s", count, reason)


__all__ = [
    "ABSURD_MS", "METRIC_VALUE_COLUMNS", "NEGATIVE_FLOOR_MS", "PACKED_FIELDS", "PACKED_FORMAT",
    "PACKED_METRICS", "PACKED_RANK", "PACKED_SAMPLE_TIME", "PACKED_STEP", "PACKED_VALUES",
    "RunRecord", "SAMPLE_COLUMNS", "StepTimeStore", "WriteResult", "ensure_schema",
    "metric_columns", "normalise_step_record", "open_connection", "pack_values",
]
