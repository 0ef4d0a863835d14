"""The Step Time database as it lies on disk: what the write side and the read side share.

The writer (`sqlite_writer`, fed row tuples by `normalise`) creates these tables
and fills the `packed` BLOB; every reader (`step_time/sqlite_reader.py` and
`resources/reader.py` for the analyses, `store_read` for every other fact: runs,
rank endings, memory peaks, drops) opens the file through `connect_readonly`,
names the tables by the constants below and decodes `packed` with them. Neither
side imports the other; no other module runs SQL (tests/processor/test_sql_owners.py).

This module runs no query, creates nothing and judges no value: creating the
schema is the writer's, whether a file may be written at all `sqlite_guard`'s,
what a value may be is the decoders' (`decode`).
"""
from __future__ import annotations

import re
import sqlite3
import struct
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from traceml.schema.vocabulary import CANONICAL_METRICS, METRIC_COLLECTIVE_WAIT

SCHEMA_USER_VERSION = 7
"""`PRAGMA user_version` of a database laid out as below (`LAYOUT_CHANGES` lists what each
version added, so `sqlite_guard` can recognise every older layout exactly).

7: the `trace_id` / `span_id` columns of `step_time_samples` / `step_time_attempt_samples`
(the step span's OpenTelemetry ids, so a re-exported series can name its worst step as an
exemplar; NULL for rows written before and for foreign steps without a span) and the
`fleet_culprits` table (each summarised run's confirmed culprits, by host and GPU, with the
ledger's lost time: the repeat-offender history across runs). Columns are added and the
table created in place.

6: the `step_time_sources` table (which foreign mapping a rank's steps came through, the
phases it cannot measure, what it left unplaced; a new table, so a version-5 file is
brought up to date by creating it).

5: the file carries `APPLICATION_ID` (the tables are version 4's). A file of an older
version has none: it is recognised as ours by its exact tables and columns, and the
writer keeps a copy of it before bringing it up to date.

4: the `resource_samples` table (process, host and GPU metrics; a new table, so a
version-3 file is brought up to date by creating it).

3: the `collective_wait_*` columns of `step_time_samples` / `step_time_attempt_samples`
and a `packed` BLOB two values longer (`LEGACY_PACKED_METRICS`: rows written before keep
their shorter BLOB, which every reader widens with a missing collective wait).

2: `step_time_ranks.outcome` / `exit_code` (how a rank said its process ended),
`step_time_runs.attempt` and the `*_attempt_samples` tables (elastic restarts). A
version-1 file is brought up to date by the writer (`ADDED_COLUMNS`, new tables);
readers of an older file find those absent and treat them as unknown / attempt 0."""

APPLICATION_ID = int.from_bytes(b"TrML", "big")
"""`PRAGMA application_id` (the 32-bit field at offset 68 of the SQLite header) of every
database this processor creates, set in the same transaction as its tables: what says
"traceml-processor's" before any table is looked at. Other programs set their own (or
leave 0); a file carrying another one is never written."""

BUSY_TIMEOUT_S = 5.0
"""How long any connection, reader or writer, waits on another's lock before SQLITE_BUSY."""


# The tables (`DDL` below creates them under these names; readers name them through these).
SAMPLES_TABLE = "step_time_samples"
"""One row per (run, rank, step) of the run's current attempt: timings, identity, `packed`."""
MEMORY_TABLE = "step_memory_samples"
"""Peak memory per (run, rank, step, device) of the current attempt."""
RUNS_TABLE = "step_time_runs"
"""One row per run: strategy, rank-universe version, stored cursor, activity times, attempt."""
RANKS_TABLE = "step_time_ranks"
"""One row per (run, rank): identity and the end marker's facts."""
ATTEMPT_SAMPLES_TABLE = "step_time_attempt_samples"
ATTEMPT_MEMORY_TABLE = "step_memory_attempt_samples"
"""The rows of earlier attempts of an elastically restarted run."""
RESOURCES_TABLE = "resource_samples"
"""Process, host and GPU samples (a rank's own, or a foreign sender's joined by host)."""
DROPS_TABLE = "step_time_drops"
CULPRITS_TABLE = "fleet_culprits"
"""One row per (run, culprit rank): the host and GPU a summarised run's confirmed straggler ran
on and the rank-time the ledger says the others lost waiting for it (`processor/fleet.py`)."""
SOURCES_TABLE = "step_time_sources"
"""Per (run, rank, mapping): the foreign mapping (`processor/mapping`) a rank's steps came
through; a rank with no row sent TraceML's own spans."""
"""Telemetry each rank reported dropped, per queue."""


def metric_columns(metric: str) -> tuple[str, str, str]:
    """Canonical metric -> its (cpu ms, gpu ms, count) column names."""
    return f"{metric}_cpu_ms", f"{metric}_gpu_ms", f"{metric}_count"


METRIC_VALUE_COLUMNS: tuple[str, ...] = tuple(
    column for metric in CANONICAL_METRICS for column in metric_columns(metric)
)
"""Typed value columns of `step_time_samples`, three per canonical metric (cpu, gpu, count)."""

PACKED_METRICS: tuple[str, ...] = CANONICAL_METRICS
"""Order of the metrics inside `packed`."""
LEGACY_PACKED_METRICS: tuple[str, ...] = PACKED_METRICS[:PACKED_METRICS.index(METRIC_COLLECTIVE_WAIT)]
"""The metrics of a `packed` BLOB written before user_version 3 (no collective wait): the same
order, so such a row is the new layout with the appended metrics missing (NaN)."""
LEGACY_PACKED_FIELDS = 2 * len(LEGACY_PACKED_METRICS) + 3
PACKED_VALUES = 2 * len(PACKED_METRICS)
PACKED_SAMPLE_TIME, PACKED_RANK, PACKED_STEP = PACKED_VALUES, PACKED_VALUES + 1, PACKED_VALUES + 2
PACKED_FIELDS = PACKED_VALUES + 3
PACKED_FORMAT = struct.Struct(f"<{PACKED_FIELDS}d")
"""`packed` = little-endian float64 [m0 cpu, m0 gpu, m1 cpu, ..., sample_time, global_rank,
step]; NaN = missing.

The same values as the typed columns (plus the row's rank and step, exact in
float64), in one BLOB: the analysis read path turns a whole selection into one
numpy array with a single `frombuffer`, instead of building one Python object per
value. Only the writer fills it; a reader must still expect a row some other tool
wrote (missing, short or out-of-range `packed`).
"""

SAMPLE_COLUMNS: tuple[str, ...] = (
    "run_id", "global_rank", "local_rank", "node_rank", "world_size", "local_world_size",
    "hostname", "step", "start_time", "sample_time", "receive_time", "training_strategy",
    *METRIC_VALUE_COLUMNS, "trace_id", "span_id", "payload", "packed", "digest",
)
"""Column order of one `step_time_samples` row tuple (`id` is SQLite's)."""

MEMORY_COLUMNS: tuple[str, ...] = (
    "run_id", "global_rank", "step", "device", "peak_allocated_bytes", "peak_reserved_bytes",
    "sample_time", "receive_time",
)
"""Column order of one `step_memory_samples` row tuple."""

RESOURCE_COLUMNS: tuple[str, ...] = (
    "run_id", "global_rank", "host", "device", "metric", "sample_time", "value", "source", "pid",
    "receive_time",
)
"""Column order of one `resource_samples` row tuple."""

_METRIC_DDL = ",\n    ".join(
    f"{c} {'INTEGER' if c.endswith('_count') else 'REAL'}" for c in METRIC_VALUE_COLUMNS
)
_SAMPLE_COLUMNS_DDL = f"""run_id TEXT NOT NULL,
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
    trace_id BLOB,
    span_id BLOB,
    payload TEXT NOT NULL,
    packed BLOB,
    digest TEXT NOT NULL"""
_MEMORY_COLUMNS_DDL = """run_id TEXT NOT NULL,
    global_rank INTEGER NOT NULL,
    step INTEGER NOT NULL,
    device TEXT NOT NULL,
    peak_allocated_bytes INTEGER,
    peak_reserved_bytes INTEGER,
    sample_time REAL,
    receive_time REAL NOT NULL"""

DDL = f"""
CREATE TABLE IF NOT EXISTS {SAMPLES_TABLE} (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    {_SAMPLE_COLUMNS_DDL},
    UNIQUE (run_id, global_rank, step)
);
-- Live tail: latest steps of a run (range on step) and rows newer than a cursor (rowid).
CREATE INDEX IF NOT EXISTS step_time_samples_run_step ON {SAMPLES_TABLE} (run_id, step);
CREATE INDEX IF NOT EXISTS step_time_samples_run ON {SAMPLES_TABLE} (run_id);

CREATE TABLE IF NOT EXISTS {MEMORY_TABLE} (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    {_MEMORY_COLUMNS_DDL},
    UNIQUE (run_id, global_rank, step, device)
);
-- The resource analysis reads the window's steps of every rank (a range on step).
CREATE INDEX IF NOT EXISTS step_memory_samples_run_step ON {MEMORY_TABLE} (run_id, step);

-- One row per run: strategy, rank-universe version (bumped when a rank appears or its
-- identity changes) and the stored cursor (latest row id, latest step).
CREATE TABLE IF NOT EXISTS {RUNS_TABLE} (
    run_id TEXT PRIMARY KEY,
    training_strategy TEXT,
    ranks_version INTEGER NOT NULL DEFAULT 0,
    latest_row_id INTEGER NOT NULL DEFAULT 0,
    latest_step INTEGER,
    first_receive_time REAL NOT NULL,
    last_receive_time REAL NOT NULL,
    last_sample_time REAL,
    attempt INTEGER NOT NULL DEFAULT 0
);

-- The persisted rank universe of a run, with identity and end-of-run facts.
CREATE TABLE IF NOT EXISTS {RANKS_TABLE} (
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
    outcome TEXT,
    exit_code INTEGER,
    PRIMARY KEY (run_id, global_rank)
);

-- Elastic restarts: `step_time_samples` / `step_memory_samples` hold the run's current
-- attempt (`step_time_runs.attempt`) only, so no reader mixes attempts into a window.
-- When a later attempt's first row arrives, the earlier attempt's rows move here with
-- their attempt number (nothing is overwritten), as do rows arriving late from it.
CREATE TABLE IF NOT EXISTS {ATTEMPT_SAMPLES_TABLE} (
    attempt INTEGER NOT NULL,
    {_SAMPLE_COLUMNS_DDL},
    UNIQUE (run_id, attempt, global_rank, step)
);
CREATE TABLE IF NOT EXISTS {ATTEMPT_MEMORY_TABLE} (
    attempt INTEGER NOT NULL,
    {_MEMORY_COLUMNS_DDL},
    UNIQUE (run_id, attempt, global_rank, step, device)
);

-- Resource samples (`schema.resources.STORED_METRICS`): a rank's own (run and rank set), or a
-- foreign sender's on a host where a run has ranks (hostmetrics, DCGM: run and rank NULL),
-- joined to the run by host, device and time when read. `device` '' for process and host.
CREATE TABLE IF NOT EXISTS {RESOURCES_TABLE} (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT,
    global_rank INTEGER,
    host TEXT NOT NULL,
    device TEXT NOT NULL,
    metric TEXT NOT NULL,
    sample_time REAL NOT NULL,
    value REAL NOT NULL,
    source TEXT NOT NULL,
    pid INTEGER,
    receive_time REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS resource_samples_run_time ON {RESOURCES_TABLE} (run_id, sample_time);
CREATE INDEX IF NOT EXISTS resource_samples_host_time ON {RESOURCES_TABLE} (host, sample_time);

-- Telemetry a rank reported dropped (cumulative per queue; the largest report is kept).
CREATE TABLE IF NOT EXISTS {DROPS_TABLE} (
    run_id TEXT NOT NULL,
    global_rank INTEGER NOT NULL,
    queue TEXT NOT NULL,
    dropped INTEGER NOT NULL,
    PRIMARY KEY (run_id, global_rank, queue)
);

-- Foreign mappings: which one a rank's steps came through (`mapping`), the phases it can never
-- measure (JSON list), what it left unplaced in them (JSON object: label -> count), its steps.
CREATE TABLE IF NOT EXISTS {SOURCES_TABLE} (
    run_id TEXT NOT NULL,
    global_rank INTEGER NOT NULL,
    mapping TEXT NOT NULL,
    unmeasured TEXT NOT NULL,
    unplaced TEXT NOT NULL,
    steps INTEGER NOT NULL,
    PRIMARY KEY (run_id, global_rank, mapping)
);

-- Repeat offenders: a summarised run's confirmed culprits (`device` '' when no GPU id was known),
-- with the badput ledger's lost time; rewritten when the run is summarised again.
CREATE TABLE IF NOT EXISTS {CULPRITS_TABLE} (
    run_id TEXT NOT NULL,
    global_rank INTEGER NOT NULL,
    kind TEXT NOT NULL,
    host TEXT NOT NULL,
    device TEXT NOT NULL,
    ended_time REAL NOT NULL,
    lost_rank_seconds REAL,
    lost_device_hours REAL,
    PRIMARY KEY (run_id, global_rank)
);
CREATE INDEX IF NOT EXISTS fleet_culprits_host ON {CULPRITS_TABLE} (host, ended_time);
"""

@dataclass(frozen=True)
class LayoutChange:
    """What one step of the layout's history added to the version-1 tables: columns (table,
    column, type) and whole tables (with their indexes, as `DDL` creates them)."""

    version: int
    """The `user_version` written with this change."""
    columns: tuple[tuple[str, str, str], ...] = ()
    tables: tuple[str, ...] = ()


LAYOUT_CHANGES: tuple[LayoutChange, ...] = (
    LayoutChange(2, columns=((RANKS_TABLE, "outcome", "TEXT"), (RANKS_TABLE, "exit_code", "INTEGER"))),
    # Still version 2: the attempts came in a later release that kept the number.
    LayoutChange(2, columns=((RUNS_TABLE, "attempt", "INTEGER NOT NULL DEFAULT 0"),),
                 tables=(ATTEMPT_SAMPLES_TABLE, ATTEMPT_MEMORY_TABLE)),
    LayoutChange(3, columns=tuple((table, column, "INTEGER" if column.endswith("_count") else "REAL")
                                  for table in (SAMPLES_TABLE, ATTEMPT_SAMPLES_TABLE)
                                  for column in metric_columns(METRIC_COLLECTIVE_WAIT))),
    LayoutChange(4, tables=(RESOURCES_TABLE,)),
    LayoutChange(5),  # APPLICATION_ID: no table changed
    LayoutChange(6, tables=(SOURCES_TABLE,)),
    LayoutChange(7, columns=tuple((table, column, "BLOB") for table in (SAMPLES_TABLE, ATTEMPT_SAMPLES_TABLE)
                                  for column in ("trace_id", "span_id")),
                 tables=(CULPRITS_TABLE,)),
)
"""The layout's history, oldest first: `DDL` less every change from one on is the layout
that version wrote (version 1: `DDL` less all of them). The last entry's version is
`SCHEMA_USER_VERSION`. A table added later is in `DDL` with its columns of today, so a
change that adds columns to a table also added later lists them for that table too."""

FIRST_USER_VERSION = 1
"""The `user_version` of the first layout (every release wrote one)."""

ADDED_COLUMNS: tuple[tuple[str, str, str], ...] = tuple(
    column for change in LAYOUT_CHANGES for column in change.columns)
"""(table, column, type) added to `DDL` after version 1: a database written before has none of
them, and the writer adds them (`ALTER TABLE ... ADD COLUMN`, no rewrite)."""

SCHEMA_OBJECTS: frozenset[str] = frozenset(re.findall(r"CREATE (?:TABLE|INDEX) IF NOT EXISTS (\w+)", DDL))
"""Names of the tables and indexes `DDL` creates: a file holding any other (bar SQLite's own
`sqlite_*`) belongs to another application, and `sqlite_guard` refuses to write to it."""


def connect_readonly(path: str | Path) -> sqlite3.Connection:
    """Every reader's connection to a Step Time database.

    Opened `mode=ro`, so a reader never creates, migrates or locks the file for
    writing: pointing one at a live processor's database is safe. Autocommit
    (no implicit transactions): a reader that needs one consistent view across
    statements says `BEGIN` / `COMMIT` itself. Not tied to the opening thread;
    callers use it from one thread at a time and close it soon.

    Raises `FileNotFoundError` when nothing is at `path` (SQLite would say only
    "unable to open database file"), `sqlite3.Error` for anything else.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no Step Time database at {path}")
    return sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S,
                           isolation_level=None, check_same_thread=False)


__all__ = [
    "ADDED_COLUMNS", "APPLICATION_ID", "ATTEMPT_MEMORY_TABLE", "ATTEMPT_SAMPLES_TABLE", "BUSY_TIMEOUT_S", "CULPRITS_TABLE", "DDL",
    "DROPS_TABLE", "FIRST_USER_VERSION", "LAYOUT_CHANGES", "LayoutChange", "MEMORY_TABLE", "RANKS_TABLE", "RESOURCES_TABLE", "RUNS_TABLE", "SAMPLES_TABLE", "SOURCES_TABLE", "RESOURCE_COLUMNS", "LEGACY_PACKED_FIELDS", "LEGACY_PACKED_METRICS", "MEMORY_COLUMNS", "METRIC_VALUE_COLUMNS", "PACKED_FIELDS",
    "PACKED_FORMAT", "PACKED_METRICS", "PACKED_RANK", "PACKED_SAMPLE_TIME", "PACKED_STEP",
    "PACKED_VALUES", "SAMPLE_COLUMNS", "SCHEMA_OBJECTS", "SCHEMA_USER_VERSION", "connect_readonly", "metric_columns",
]
