"""Every read of the store besides the two analyses: one named function per question.

The database has one layout (`sqlite_layout`: tables, columns, `connect_readonly`),
one writer (`sqlite_writer`) and two analysis readers (`step_time/sqlite_reader.py`
for the step-time window, `resources/reader.py` for resource samples). Every other
question anyone asks of the store, the launcher's and the web view's included, is
a function here: which runs there are, how far a run got and whether it is over,
its ranks' endings, memory peaks, drops and stored steps. So a column change
touches the layout, the writer, at most one analysis reader and this module, and
tests/processor/test_sql_owners.py fails when SQL appears anywhere else.

Functions that take a path open one short read-only connection and say what went
wrong with two exceptions (`StoreUnavailable`: the file cannot be opened;
`NotAStore`: it holds no runs table, e.g. before the processor created it or
another application's file). Functions that take a connection are for callers
that ask several questions of one view of the file (the run monitor, the summary)
and let `sqlite3.Error` through. Nothing here decides anything: whether a run is
over is `runs.run_is_over`'s rule, applied to `read_rank_ends`.
"""
from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from traceml.processor.reporting.inputs import (
    AttemptSpan,
    AttemptSteps,
    RankMemory,
    RankTelemetry,
    RunSource,
    RunTelemetry,
)
from traceml.processor.fleet import FleetEntry, HostRun
from traceml.processor.sqlite_layout import (
    ATTEMPT_SAMPLES_TABLE,
    CULPRITS_TABLE,
    DROPS_TABLE,
    MEMORY_TABLE,
    RANKS_TABLE,
    RUNS_TABLE,
    SAMPLES_TABLE,
    SOURCES_TABLE,
    connect_readonly,
)
from traceml.schema import vocabulary as v


class StoreReadError(Exception):
    """A path-taking reader could not answer; `str()` is the underlying error's message."""


class StoreUnavailable(StoreReadError):
    """The file cannot be opened (absent, unreadable, not a database SQLite can open)."""


class NotAStore(StoreReadError):
    """The file opened but the read failed: no processor tables (not created yet, another
    application's file) or SQLite could not read them."""


# --- runs ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoredRun:
    """One run as the store lists it."""

    run_id: str
    latest_step: int | None
    last_receive_time: float  # unix seconds, the newest record received


@dataclass(frozen=True, slots=True)
class RunActivity:
    """What tells a run monitor that a run moved: its receive time and row cursor."""

    run_id: str
    last_receive_time: float
    last_sample_time: float | None  # wall clock, the newest stored step's end
    latest_row_id: int


@dataclass
class RankEnds:
    """A run's stored ranks, the largest world size they declared, and the ranks that ended."""

    ranks: set[int] = field(default_factory=set)
    world_size: int | None = None
    finished: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class RunProgress:
    """How far a run got: its newest step's end, and its ranks' end markers."""

    ends: RankEnds
    last_sample_time: float | None  # wall clock, the newest stored step's end


def list_runs(db_path: str | Path, *, limit: int | None = None) -> list[StoredRun]:
    """The database's runs, most recently active first (then by run id, descending), at most `limit`.

    Raises `StoreUnavailable` or `NotAStore`.
    """
    with _reading(db_path) as conn:
        rows = conn.execute(
            f"SELECT run_id, latest_step, last_receive_time FROM {RUNS_TABLE}"
            " ORDER BY last_receive_time DESC, run_id DESC LIMIT ?",
            (-1 if limit is None else limit,)).fetchall()
    return [StoredRun(run_id, latest_step, float(last)) for run_id, latest_step, last in rows]


def read_run_activity(conn: sqlite3.Connection) -> list[RunActivity]:
    """Every stored run's activity markers (the run monitor's poll, a restart's scan)."""
    return [RunActivity(run_id, last_receive, last_sample, latest_row) for run_id, last_receive, last_sample,
            latest_row in conn.execute(
                f"SELECT run_id, last_receive_time, last_sample_time, latest_row_id FROM {RUNS_TABLE}")]


def read_rank_ends(conn: sqlite3.Connection, run_id: str) -> RankEnds:
    """The run's stored ranks, declared world size and end markers (what `runs.run_is_over` judges)."""
    ends = RankEnds()
    for rank, world_size, finished_time in conn.execute(
            f"SELECT global_rank, world_size, finished_time FROM {RANKS_TABLE} WHERE run_id = ?", (run_id,)):
        ends.ranks.add(rank)
        if world_size:
            ends.world_size = max(ends.world_size or 0, world_size)
        if finished_time is not None:
            ends.finished.add(rank)
    return ends


def read_run_progress(db_path: str | Path, run_id: str) -> RunProgress:
    """The run's newest step end and its ranks' end markers, in one read-only connection.

    Raises `StoreUnavailable` or `NotAStore`.
    """
    with _reading(db_path) as conn:
        row = conn.execute(f"SELECT last_sample_time FROM {RUNS_TABLE} WHERE run_id = ?", (run_id,)).fetchone()
        return RunProgress(read_rank_ends(conn, run_id), None if row is None else row[0])


# --- a run's facts beside the analysis (summary, live re-export, web view) ----------------------


def read_rank_memory(conn: sqlite3.Connection, run_id: str, *, latest: bool) -> list[RankMemory]:
    """Per rank: the latest step's peaks (`latest=True`, live metric) or the run's maxima (summary)."""
    if latest:
        rows = conn.execute(
            "SELECT m.global_rank, m.device, m.peak_allocated_bytes, m.peak_reserved_bytes"
            f" FROM {MEMORY_TABLE} AS m"
            f" JOIN (SELECT global_rank, max(step) AS step FROM {MEMORY_TABLE}"
            "       WHERE run_id = ? GROUP BY global_rank) AS last"
            "   ON m.global_rank = last.global_rank AND m.step = last.step"
            " WHERE m.run_id = ? ORDER BY m.global_rank, m.device", (run_id, run_id)).fetchall()
    else:
        rows = conn.execute(
            "SELECT global_rank, min(device), max(peak_allocated_bytes), max(peak_reserved_bytes)"
            f" FROM {MEMORY_TABLE} WHERE run_id = ? GROUP BY global_rank ORDER BY global_rank",
            (run_id,)).fetchall()
    by_rank: dict[int, RankMemory] = {}
    for rank, device, allocated, reserved in rows:
        by_rank.setdefault(rank, RankMemory(rank, device, allocated, reserved))
    return list(by_rank.values())


def read_rank_telemetry(conn: sqlite3.Connection, run_id: str, *, count_stored: bool = True
                        ) -> list[RankTelemetry]:
    """Per known rank: did it send its end marker, what did it report dropped and lost, what is stored.

    `count_stored=False` skips counting the stored steps (a scan of the run's step
    rows), which only the final summary reads; `steps_stored` is then left at 0.
    """
    finished: dict[int, bool] = {}
    final: dict[int, dict] = {}
    said: dict[int, tuple] = {}  # rank -> (outcome, exit code, node rank)
    # `outcome` / `exit_code` came with schema version 2: an older file read as is has neither.
    columns = {row[1] for row in conn.execute(f"PRAGMA table_info({RANKS_TABLE})")}
    ending = "outcome, exit_code" if "exit_code" in columns else "NULL, NULL"
    for rank, finished_time, counts, outcome, exit_code, node_rank in conn.execute(
            f"SELECT global_rank, finished_time, final_counts, {ending}, node_rank FROM {RANKS_TABLE}"
            " WHERE run_id = ?", (run_id,)):
        finished[rank] = finished_time is not None
        said[rank] = (outcome, exit_code, node_rank)
        if finished_time is not None:
            try:
                final[rank] = json.loads(counts or "{}")
            except ValueError:
                final[rank] = {}
    drops: dict[int, dict[str, int]] = {}
    for rank, queue, dropped in conn.execute(
            f"SELECT global_rank, queue, dropped FROM {DROPS_TABLE} WHERE run_id = ?", (run_id,)):
        drops.setdefault(rank, {})[queue] = int(dropped)
    stored = _steps_per_rank(conn, run_id) if count_stored else {}
    ranks = sorted(set(finished) | set(drops))
    return [RankTelemetry(rank, finished.get(rank, False), drops.get(rank, {}),
                          export_failures=_count(final.get(rank), v.ATTR_RUN_END_EXPORT_FAILURES),
                          steps_completed=_count(final.get(rank), v.ATTR_STEPS_COMPLETED),
                          steps_stored=int(stored.get(rank, 0)),
                          outcome=said.get(rank, (None,))[0], exit_code=said.get(rank, (None, None))[1],
                          node_rank=said.get(rank, (None, None, None))[2],
                          step_boundary=_word(final.get(rank), v.ATTR_STEP_BOUNDARY, v.STEP_BOUNDARIES))
            for rank in ranks]


def read_attempts(conn: sqlite3.Connection, run_id: str) -> tuple[int | None, list[AttemptSteps]]:
    """The run's current attempt (the one its window analyses) and the steps stored per rank of
    every attempt, earlier ones from the attempt tables (schema 2; an older file: attempt 0 only)."""
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    per: dict[int, dict[int, int]] = {}
    current = None
    if ATTEMPT_SAMPLES_TABLE in tables:
        row = conn.execute(f"SELECT attempt FROM {RUNS_TABLE} WHERE run_id = ?", (run_id,)).fetchone()
        current = None if row is None else int(row[0])
        for attempt, rank, count in conn.execute(
                f"SELECT attempt, global_rank, COUNT(*) FROM {ATTEMPT_SAMPLES_TABLE} WHERE run_id = ?"
                " GROUP BY attempt, global_rank", (run_id,)):
            per.setdefault(int(attempt), {})[int(rank)] = int(count)
    for rank, count in _steps_per_rank(conn, run_id).items():
        per.setdefault(current or 0, {})[int(rank)] = int(count)
    if current is None and per:
        current = 0
    return current, [AttemptSteps(a, dict(sorted(ranks.items()))) for a, ranks in sorted(per.items())]


def read_restarts(conn: sqlite3.Connection, run_id: str
                  ) -> tuple[list[AttemptSpan], dict[int, tuple[int, float]]]:
    """The run's attempts, oldest first (`AttemptSpan`: ranks, step ids, first start, last end),
    and per earlier attempt the (rank, step) cells and summed step seconds (end - start) of its
    steps at or after the next attempt's first step id: what the badput ledger counts as done
    again (`diagnosis.ledger.restart_loss`). A file older than the attempt tables: one attempt."""
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    row = (conn.execute(f"SELECT attempt FROM {RUNS_TABLE} WHERE run_id = ?", (run_id,)).fetchone()
           if ATTEMPT_SAMPLES_TABLE in tables else None)
    current = 0 if row is None else int(row[0])
    spans: dict[int, AttemptSpan] = {}
    sources = [(SAMPLES_TABLE, "?", "", (current, run_id))]
    if ATTEMPT_SAMPLES_TABLE in tables:
        sources.insert(0, (ATTEMPT_SAMPLES_TABLE, "attempt", " GROUP BY attempt", (run_id,)))
    for table, attempt_column, group, params in sources:
        for attempt, ranks, first, last, start, end in conn.execute(
                f"SELECT {attempt_column}, COUNT(DISTINCT global_rank), MIN(step), MAX(step), MIN(start_time),"
                f" MAX(sample_time) FROM {table} WHERE run_id = ?{group}", params):
            if first is None or int(attempt) in spans:
                continue
            spans[int(attempt)] = AttemptSpan(int(attempt), int(ranks), int(first), int(last),
                                              None if start is None else float(start),
                                              None if end is None else float(end))
    ordered = [spans[a] for a in sorted(spans)]
    redone: dict[int, tuple[int, float]] = {}
    for earlier, later in zip(ordered, ordered[1:]):
        cells, seconds = conn.execute(
            f"SELECT COUNT(*), TOTAL(MAX(sample_time - start_time, 0)) FROM {ATTEMPT_SAMPLES_TABLE}"
            " WHERE run_id = ? AND attempt = ? AND step >= ?",
            (run_id, earlier.attempt, later.first_step)).fetchone()
        redone[earlier.attempt] = (int(cells), float(seconds or 0.0))
    return ordered, redone


def read_run_restarts(db_path: str | Path, run_id: str
                      ) -> tuple[list[AttemptSpan], dict[int, tuple[int, float]]] | None:
    """`read_restarts` in one short read-only connection; None when the store cannot be read."""
    if not Path(db_path).exists():
        return None
    try:
        conn = connect_readonly(db_path)
    except (sqlite3.Error, OSError):
        return None
    try:
        return read_restarts(conn, run_id)
    except sqlite3.Error:
        return None
    finally:
        conn.close()


def read_first_step_stored(conn: sqlite3.Connection, run_id: str) -> int | None:
    """The lowest step stored for any rank of the run (one index seek on (run_id, step)); None: no step."""
    row = conn.execute(f"SELECT MIN(step) FROM {SAMPLES_TABLE} WHERE run_id = ?", (run_id,)).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def read_input_before_forward_ranks(conn: sqlite3.Connection, run_id: str) -> list[int]:
    """Ranks whose every stored step with an input wait measured it as the time before forward
    (`input_wait_count` 0: a step inferred from an optimizer update with no DataLoader `next()`
    timed, `docs/instrumentation.md`); a scan of the run's rows, for the final summary."""
    rows = conn.execute(
        f"SELECT global_rank FROM {SAMPLES_TABLE} WHERE run_id = ? GROUP BY global_rank"
        " HAVING COUNT(input_wait_count) > 0 AND MAX(input_wait_count) = 0 ORDER BY global_rank",
        (run_id,)).fetchall()
    return [int(rank) for (rank,) in rows]


def read_sources(conn: sqlite3.Connection, run_id: str) -> list[RunSource]:
    """The foreign mappings the run's ranks came through (`step_time_sources`), by rank then
    mapping; none for a database written before the table existed."""
    try:
        rows = conn.execute(
            f"SELECT global_rank, mapping, unmeasured, unplaced, steps FROM {SOURCES_TABLE} WHERE run_id = ?"
            " ORDER BY global_rank, mapping", (run_id,)).fetchall()
    except sqlite3.OperationalError:
        return []
    return [RunSource(int(rank), str(mapping), tuple(json.loads(unmeasured)),
                      {str(k): int(n) for k, n in json.loads(unplaced).items()}, int(steps))
            for rank, mapping, unmeasured, unplaced, steps in rows]


def read_run_facts(db_path: str | Path, run_id: str, *, latest_memory: bool,
                   count_stored: bool = True) -> tuple[list[RankMemory], RunTelemetry]:
    """The readers above in one short read-only connection; nothing known before the tables exist."""
    if not Path(db_path).exists():
        return [], RunTelemetry()
    conn = connect_readonly(db_path)
    try:
        attempt, attempts = read_attempts(conn, run_id) if count_stored else (None, [])
        before_forward = read_input_before_forward_ranks(conn, run_id) if count_stored else []
        spans, redone = read_restarts(conn, run_id) if count_stored else ((), {})
        return (read_rank_memory(conn, run_id, latest=latest_memory),
                RunTelemetry(ranks=read_rank_telemetry(conn, run_id, count_stored=count_stored),
                             first_step_stored=read_first_step_stored(conn, run_id),
                             attempt=attempt, attempts=attempts,
                             input_before_forward_ranks=before_forward,
                             attempt_spans=tuple(spans), redone_steps=redone if count_stored else None,
                             sources=tuple(read_sources(conn, run_id))))
    except sqlite3.OperationalError:
        return [], RunTelemetry()
    finally:
        conn.close()


def read_step_memory(conn: sqlite3.Connection, run_id: str, ranks: Sequence[int],
                     first_step: int, last_step: int) -> dict[int, dict[int, int | None]]:
    """Per-step peak allocated bytes of `ranks` over [first_step, last_step] (largest device per
    step): rank -> step -> bytes, only ranks with at least one known peak."""
    if not ranks:
        return {}
    wanted = set(ranks)
    by_rank: dict[int, dict[int, int | None]] = {}
    rows = conn.execute(
        f"SELECT global_rank, step, max(peak_allocated_bytes) FROM {MEMORY_TABLE}"
        " WHERE run_id = ? AND step BETWEEN ? AND ? GROUP BY global_rank, step",
        (run_id, first_step, last_step))
    for rank, step, allocated in rows:
        if rank in wanted:
            by_rank.setdefault(int(rank), {})[int(step)] = None if allocated is None else int(allocated)
    return {r: s for r, s in by_rank.items() if any(value is not None for value in s.values())}


# --- helpers -------------------------------------------------------------------------------------


def _steps_per_rank(conn: sqlite3.Connection, run_id: str) -> dict[int, int]:
    """Steps stored per rank of the run's current attempt ((run_id, global_rank, step) is UNIQUE)."""
    return dict(conn.execute(
        f"SELECT global_rank, COUNT(*) FROM {SAMPLES_TABLE} WHERE run_id = ? GROUP BY global_rank",
        (run_id,)).fetchall())


def _word(counts: dict | None, key: str, allowed: tuple[str, ...]) -> str | None:
    """A word from a rank's end marker (kept with its counts); None when absent or not allowed."""
    value = None if counts is None else counts.get(key)
    return value if isinstance(value, str) and value in allowed else None


def _count(counts: dict | None, key: str) -> int | None:
    """A final count from a rank's end marker; None when the marker or the count is absent."""
    value = None if counts is None else counts.get(key)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


# --- repeat offenders and exemplars ---------------------------------------------------------------


def read_host_runs(conn: sqlite3.Connection, host: str, *, before_run: str, limit: int) -> list[HostRun]:
    """The host's stored runs other than `before_run` that began no later than it, newest first, at
    most `limit`: whether a recorded culprit of each ran on the host, its GPU ids and lost time."""
    if limit <= 0:
        return []
    rows = conn.execute(
        f"SELECT r.run_id, r.first_receive_time FROM {RUNS_TABLE} r"
        f" WHERE r.run_id != ? AND EXISTS (SELECT 1 FROM {RANKS_TABLE} k WHERE k.run_id = r.run_id"
        " AND k.hostname = ?) AND r.first_receive_time <= coalesce((SELECT first_receive_time FROM"
        f" {RUNS_TABLE} WHERE run_id = ?), r.first_receive_time)"
        " ORDER BY r.first_receive_time DESC, r.run_id DESC LIMIT ?",
        (before_run, host, before_run, limit)).fetchall()
    runs = []
    for run_id, first_seen in rows:
        culprits = conn.execute(
            f"SELECT device, lost_rank_seconds, lost_device_hours FROM {CULPRITS_TABLE}"
            " WHERE run_id = ? AND host = ?", (run_id, host)).fetchall()
        runs.append(HostRun(
            run_id, float(first_seen), bool(culprits), tuple(sorted({c[0] for c in culprits if c[0]})),
            _sum_known(c[1] for c in culprits), _sum_known(c[2] for c in culprits)))
    return runs


def read_fleet(db_path: str | Path, *, since: float, latest_runs: int = 3) -> list[FleetEntry]:
    """Hosts, and GPUs of them, that were a recorded culprit since `since` (unix seconds): runs flagged,
    runs seen on the host, lost time; most runs flagged first, then most time lost.

    Raises `StoreUnavailable` or `NotAStore` (a file of a layout before the culprits table too)."""
    with _reading(db_path) as conn:
        rows = conn.execute(
            f"SELECT host, device, run_id, ended_time, lost_rank_seconds, lost_device_hours FROM {CULPRITS_TABLE}"
            " WHERE ended_time >= ? ORDER BY ended_time DESC", (since,)).fetchall()
        hosts = sorted({row[0] for row in rows})
        seen = {host: conn.execute(
            f"SELECT count(DISTINCT k.run_id) FROM {RANKS_TABLE} k JOIN {RUNS_TABLE} r ON r.run_id = k.run_id"
            " WHERE k.hostname = ? AND r.last_receive_time >= ?", (host, since)).fetchone()[0] for host in hosts}
    groups: dict[tuple[str, str], list[tuple]] = {}
    for row in rows:
        groups.setdefault((row[0], ""), []).append(row)
        if row[1]:
            groups.setdefault((row[0], row[1]), []).append(row)
    entries = []
    for (host, device), members in groups.items():
        by_run: dict[str, tuple] = {}
        for member in members:  # newest first: a run's culprits on the host count once
            by_run.setdefault(member[2], member)
        flagged = len(by_run)
        entries.append(FleetEntry(
            host=host, device=device, runs_flagged=flagged,
            runs_seen=max(int(seen.get(host) or 0), flagged) if not device else flagged,
            lost_rank_seconds=_sum_known(m[4] for m in members),
            lost_device_hours=_sum_known(m[5] for m in members),
            last_flagged=float(members[0][3]), latest_runs=tuple(list(by_run)[:latest_runs])))
    entries.sort(key=lambda e: (-e.runs_flagged, -(e.lost_rank_seconds or 0.0), e.host, e.device))
    return entries


def read_step_span(conn: sqlite3.Connection, run_id: str, rank: int, step: int) -> tuple[bytes, bytes] | None:
    """The stored (trace id, span id) of one step of one rank, or None when it came without them."""
    row = conn.execute(f"SELECT trace_id, span_id FROM {SAMPLES_TABLE} WHERE run_id = ? AND global_rank = ?"
                       " AND step = ?", (run_id, rank, step)).fetchone()
    if row is None or not isinstance(row[0], bytes) or not isinstance(row[1], bytes):
        return None
    return row[0], row[1]


def _sum_known(values) -> float | None:
    known = [float(value) for value in values if value is not None]
    return sum(known) if known else None


class _reading:
    """`with _reading(path) as conn`: one read-only connection, errors as `StoreReadError`s."""

    def __init__(self, db_path: str | Path):
        self._path = db_path
        self._conn: sqlite3.Connection | None = None

    def __enter__(self) -> sqlite3.Connection:
        try:
            self._conn = connect_readonly(self._path)
        except (sqlite3.Error, OSError) as exc:
            raise StoreUnavailable(str(exc)) from exc
        return self._conn

    def __exit__(self, kind, exc, tb) -> bool:
        self._conn.close()
        if isinstance(exc, sqlite3.Error):
            raise NotAStore(str(exc)) from exc
        return False


__all__ = [
    "NotAStore", "RankEnds", "RunActivity", "RunProgress", "StoreReadError", "StoreUnavailable", "StoredRun",
    "list_runs", "read_attempts", "read_fleet", "read_host_runs", "read_step_span", "read_first_step_stored", "read_rank_ends", "read_rank_memory",
    "read_rank_telemetry", "read_restarts", "read_run_activity", "read_run_facts", "read_run_progress",
    "read_run_restarts",
    "read_step_memory",
]
