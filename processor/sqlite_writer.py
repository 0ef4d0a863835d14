"""The write side of the Step Time store: the processor's one SQLite writer.

Receivers hand decoded batches to the ingest queue, whose writer thread calls
`StepTimeStore.write`; every `write` commits before it returns (acknowledge
after commit). Rows come from `normalise` (this module decides only what is
stored again and what replaces what):

- Re-sent identical (run, rank, step) rows add nothing (`duplicates`); a
  different row for the same key replaces the stored one (latest wins) and gets
  a new, higher row id so live readers that tail by id see the change.
- Raw event names this version does not know stay in `payload` only
  (`unknown_events`, logged once).
- Per run, the cursor (latest row id and step) and the rank universe, whose
  version moves when a rank appears or its identity changes; end-of-run markers
  and reported drops.
- Resource samples (`resource_samples`), in the same transaction as the steps: a
  rank's own always; a foreign sender's (`hostmetrics`, DCGM: no run) only on a
  host where a stored run has a rank (its step rows' `hostname`, or that rank's own
  resource rows) and was heard from in the last `HOST_ACTIVE_S`, and a foreign
  process's figures only for a pid that a rank's own rows on that host named
  shortly before (`PID_WINDOW_S`). Anything else is not stored (`unjoined_resources`,
  which the ingest queue counts as ignored): a shared Collector's other hosts and
  processes would otherwise fill the table. A re-sent sample (same sender, host,
  device, metric and time) adds nothing. Resource rows are keyed by time, not by
  attempt: an elastic restart leaves them where they are.

It validates nothing: every record has passed the decoders (`decode`), the processor's one
judge of values (it rejects a span whole, with a counted reason, rather than
let a bad value reach here), and the receivers are the only way in. The tables
and the packed row format are `sqlite_layout`'s; reading is the read side's.

One writer connection behind a lock (WAL, so readers never wait for it). The
file is opened only after `sqlite_guard.check_database` found it to be ours (or
new), so a foreign or damaged file is refused before WAL or a table touches it;
an older layout of ours is copied beside it (`sqlite_guard.keep_copy`) before it
is brought up to date, and a new one is created, in one transaction each, so a
killed start leaves the old layout or the new one, never half of one. A damaged
page met while writing is noted in `sqlite_guard` for `/readyz`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from traceml.processor.normalise import normalise_memory_record, normalise_resource_record, normalise_step_record
from traceml.processor.sqlite_guard import (
    DatabaseCheck,
    DatabaseUnusable,
    check_database,
    keep_copy,
    note_database_error,
)
from traceml.processor.sqlite_layout import (
    ADDED_COLUMNS,
    APPLICATION_ID,
    BUSY_TIMEOUT_S,
    DDL,
    MEMORY_COLUMNS,
    RESOURCE_COLUMNS,
    SAMPLE_COLUMNS,
    SCHEMA_USER_VERSION,
)
from traceml.processor.store_records import bounded_unplaced
from traceml.processor.step_time.model import ResourceIngestRecord, StepMemoryIngestRecord, StepTimeIngestRecord
from traceml.schema import resources as sr

LOG = logging.getLogger(__name__)

_INSERT_SAMPLE = (
    f"INSERT OR IGNORE INTO step_time_samples ({','.join(SAMPLE_COLUMNS)})"
    f" VALUES ({','.join('?' * len(SAMPLE_COLUMNS))})"
)
_INSERT_OLD_SAMPLE = (
    f"INSERT OR IGNORE INTO step_time_attempt_samples (attempt, {','.join(SAMPLE_COLUMNS)})"
    f" VALUES ({','.join('?' * (len(SAMPLE_COLUMNS) + 1))})"
)
_INSERT_OLD_MEMORY = (
    f"INSERT OR IGNORE INTO step_memory_attempt_samples (attempt, {', '.join(MEMORY_COLUMNS)})"
    f" VALUES ({', '.join('?' * (len(MEMORY_COLUMNS) + 1))})"
)
_INSERT_MEMORY = (
    f"INSERT OR IGNORE INTO step_memory_samples ({', '.join(MEMORY_COLUMNS)})"
    f" VALUES ({', '.join('?' * len(MEMORY_COLUMNS))})"
)
_INSERT_RESOURCE = (
    f"INSERT INTO resource_samples ({', '.join(RESOURCE_COLUMNS)})"
    f" SELECT {', '.join('?' * len(RESOURCE_COLUMNS))}"
    " WHERE NOT EXISTS (SELECT 1 FROM resource_samples WHERE host = ? AND sample_time = ? AND metric = ?"
    " AND device = ? AND source = ? AND run_id IS ? AND global_rank IS ? AND pid IS ?)"
)  # the (host, sample_time) index finds a resend
_R_RUN, _R_RANK, _R_HOST, _R_DEVICE, _R_METRIC, _R_TIME, _R_VALUE, _R_SOURCE, _R_PID = range(9)
_PROCESS_METRICS = frozenset({sr.PROCESS_CPU_UTILIZATION, sr.PROCESS_MEMORY_USAGE})

HOST_ACTIVE_S = 600.0
"""A foreign sample is stored while a run with a rank on its host was heard from this recently
(twice the run monitor's default idle timeout): a shared Collector's samples of a host whose
runs ended long ago would fall outside every run's window, so they are not kept."""
HOST_RECHECK_S = 5.0
"""How long a host (or its pids) found unknown is not looked up again: another ingest worker
may have stored its rank since; this process's own writes count at once."""
PID_WINDOW_S = 300.0
"""A foreign process figure joins a pid that a rank's own rows on that host named within this
much before the figure's time (a rank samples every few seconds): a short index range."""
_MAX_REMEMBERED = 4096  # hosts per cache before it starts over


@dataclass(frozen=True)
class WriteResult:
    """What one `write` call did: rows stored (`accepted`, of which `replaced` took the
    place of a different stored row), identical resends (`duplicates`), and raw event
    names kept in the audit payload only (`unknown_events`)."""

    accepted: int
    duplicates: int
    replaced: int = 0
    unknown_events: int = 0
    # Positions in the `resource_records` given of foreign records not stored: no stored
    # rank on their host (or, for a process's figures, with their pid there).
    unjoined_resources: tuple[int, ...] = ()


def ensure_schema(conn: sqlite3.Connection, check: DatabaseCheck) -> None:
    """Switch to WAL; then, for a new file or an older layout of ours (as `check` found it),
    create the tables and indexes it lacks, add the columns it lacks and stamp the
    application id and version, all in one transaction. A current file is left as it is."""
    conn.execute("PRAGMA journal_mode = WAL")
    if not (check.new or check.older):
        return
    alters = []
    for table, column, kind in ADDED_COLUMNS:
        present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if present and column not in present:  # an absent table is created whole by DDL
            alters.append(f"ALTER TABLE {table} ADD COLUMN {column} {kind};")
    try:
        conn.executescript("BEGIN IMMEDIATE;\n" + DDL + "\n".join(alters)
                           + f"\nPRAGMA application_id = {APPLICATION_ID};"
                           + f"\nPRAGMA user_version = {SCHEMA_USER_VERSION};\nCOMMIT;")
    except BaseException:
        if conn.in_transaction:
            conn.rollback()
        raise


class StepTimeStore:
    """The processor's single SQLite writer (WAL). Thread-safe: one connection, one lock.

    Raises `DatabaseUnusable` (one line: what is wrong, what to do) for a file it
    must not or cannot write.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        check = check_database(self.path)
        if check.older:
            copy = keep_copy(check)
            LOG.warning("%s was written by an older traceml-processor (layout version %d): a copy is kept at %s,"
                        " and the file is brought up to version %d", self.path, check.version, copy,
                        SCHEMA_USER_VERSION)
        try:
            self._conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S, check_same_thread=False)
        except sqlite3.Error as exc:
            raise DatabaseUnusable(f"cannot open {self.path} for writing ({exc})") from None
        try:
            # WAL + synchronous=NORMAL: a commit is durable against a killed process (the WAL
            # holds it); only an OS crash or power loss may lose the last commits. See
            # docs/processor.md. A modest page cache (16 MiB, default 2 MiB) keeps more of the
            # rank-spread unique index in memory; fewer automatic checkpoints mean fewer
            # fsyncs in the commit path.
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._conn.execute("PRAGMA cache_size = -16384")  # KiB
            self._conn.execute("PRAGMA wal_autocheckpoint = 4000")  # pages
            ensure_schema(self._conn, check)
        except sqlite3.Error as exc:
            self._conn.close()
            raise DatabaseUnusable(f"cannot prepare {self.path} for writing ({exc}); check its permissions and"
                                   " free disk space, or point --db at a new file") from None
        self._unknown_logged = False
        self._closed = False
        self._host_seen: dict[str, float] = {}  # host -> latest wall time a stored rank there was heard
        self._host_misses: dict[str, float] = {}  # host -> monotonic time it was found inactive
        self._host_pids: dict[str, tuple[set[int], float]] = {}  # host -> (its ranks' pids, monotonic loaded)
        self._restarted = self._has_restarts()  # any run past attempt 0: check every batch

    # --- writing ---------------------------------------------------------------------

    def write(
        self,
        step_records: Iterable[StepTimeIngestRecord] = (),
        memory_records: Iterable[StepMemoryIngestRecord] = (),
        resource_records: Iterable[ResourceIngestRecord] = (),
        *,
        receive_time: float | None = None,
    ) -> WriteResult:
        """Normalise, deduplicate and commit decoded records of every kind; returns after commit."""
        now = time.time() if receive_time is None else receive_time
        resource_rows = [normalise_resource_record(record, now) for record in resource_records]
        unjoined: list[int] = []
        learned_hosts: set[str] = set()
        learned_pids: set[tuple[str, int]] = set()

        step_rows: dict[tuple[str, int, int, int], tuple] = {}  # (run, attempt, rank, step) -> row
        duplicates = 0
        superseded = 0  # a different row for the same key later in this batch (latest wins)
        unknown_events = 0
        for record in step_records:
            row, unknown = normalise_step_record(record, now)
            unknown_events += unknown
            key = (row[0], record.attempt, row[1], row[7])
            previous = step_rows.get(key)
            if previous is not None:
                if previous[-1] == row[-1]:
                    duplicates += 1
                else:
                    superseded += 1
            step_rows[key] = row

        memory_rows: dict[tuple[str, int, int, int, str], tuple] = {}  # (run, attempt, rank, step, device)
        for record in memory_records:
            row = normalise_memory_record(record, now)
            key = (row[0], record.attempt, row[1], row[2], row[3])
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
                if any(key[1] for key in step_rows) or any(key[1] for key in memory_rows) or self._restarted:
                    # Elastic restarts: rows of an earlier attempt than the run's go to the
                    # attempt tables; a later attempt moves the run's rows there first.
                    n_accepted, n_duplicates = self._separate_attempts(conn, step_rows, memory_rows)
                    accepted += n_accepted
                    duplicates += n_duplicates
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
                    conn.executemany(_INSERT_MEMORY, rows)
                    inserted = conn.total_changes - before
                    accepted += inserted
                    duplicates += len(rows) - inserted
                learned_hosts.update(row[6] for row in step_rows.values() if row[6])
                if resource_rows:
                    inserted, stored = self._write_resources(conn, resource_rows, now, unjoined, learned_hosts,
                                                             learned_pids)
                    accepted += inserted
                    duplicates += stored - inserted
                conn.commit()
            except BaseException as exc:
                note_database_error(self.path, exc)
                conn.rollback()
                raise
            for host in learned_hosts:  # only what is committed
                self._host_seen[host] = now
                self._host_misses.pop(host, None)
            if len(self._host_seen) > _MAX_REMEMBERED:
                self._host_seen = {h: t for h, t in self._host_seen.items() if now - t <= HOST_ACTIVE_S}
            for host, pid in learned_pids:
                if host in self._host_pids:
                    self._host_pids[host][0].add(pid)
        if unknown_events:
            self._log_unknown_events(unknown_events)
        return WriteResult(accepted=accepted, duplicates=duplicates, replaced=replaced,
                           unknown_events=unknown_events, unjoined_resources=tuple(unjoined))

    # --- resource samples ------------------------------------------------------------

    def _write_resources(self, conn: sqlite3.Connection, rows: list[tuple], now: float, unjoined: list[int],
                         learned_hosts: set[str], learned_pids: set[tuple[str, int]]) -> tuple[int, int]:
        """Insert a rank's own rows and the foreign rows that join a stored rank (inside the write
        transaction, after the batch's steps); returns (inserted, offered for insertion) and fills
        `unjoined` with the positions of the foreign rows left out."""
        keep: list[tuple] = []
        foreign: list[int] = []
        for i, row in enumerate(rows):
            if row[_R_RUN] is None:
                foreign.append(i)
                continue
            keep.append(row)
            if row[_R_HOST]:
                learned_hosts.add(row[_R_HOST])
                if row[_R_PID] is not None:
                    learned_pids.add((row[_R_HOST], row[_R_PID]))
        if foreign:
            clock = time.monotonic()
            active: dict[str, bool] = {}
            earliest: dict[str, float] = {}  # host -> its earliest foreign process figure in the batch
            for i in foreign:
                row = rows[i]
                if row[_R_METRIC] in _PROCESS_METRICS:
                    earliest[row[_R_HOST]] = min(earliest.get(row[_R_HOST], row[_R_TIME]), row[_R_TIME])
            pids: dict[str, set[int]] = {}
            for i in foreign:
                row = rows[i]
                host = row[_R_HOST]
                ok = active.get(host)
                if ok is None:
                    ok = active[host] = host in learned_hosts or self._host_active(conn, host, now, clock)
                if ok and row[_R_METRIC] in _PROCESS_METRICS:
                    pid = row[_R_PID]
                    if pid is not None and (host, pid) not in learned_pids:
                        host_pids = pids.get(host)
                        if host_pids is None:
                            host_pids = pids[host] = self._pids_on(conn, host, earliest[host] - PID_WINDOW_S,
                                                                   clock, pid)
                        ok = pid in host_pids
                    else:
                        ok = pid is not None
                if ok:
                    keep.append(row)
                else:
                    unjoined.append(i)
        if not keep:
            return 0, 0
        before = conn.total_changes
        conn.executemany(_INSERT_RESOURCE, [(*row, row[_R_HOST], row[_R_TIME], row[_R_METRIC], row[_R_DEVICE],
                                             row[_R_SOURCE], row[_R_RUN], row[_R_RANK], row[_R_PID])
                                            for row in keep])
        return conn.total_changes - before, len(keep)

    def _host_active(self, conn: sqlite3.Connection, host: str, now: float, clock: float) -> bool:
        """Was a run with a rank on `host` heard from in the last `HOST_ACTIVE_S` (the run's receive
        time, through its ranks' hostname; or a rank's own resource sample there)?"""
        if not host:
            return False
        seen = self._host_seen.get(host)
        if seen is not None and now - seen <= HOST_ACTIVE_S:
            return True
        missed = self._host_misses.get(host)
        if missed is not None and clock - missed < HOST_RECHECK_S:
            return False
        since = now - HOST_ACTIVE_S
        (by_steps,) = conn.execute(
            "SELECT max(u.last_receive_time) FROM step_time_ranks AS k JOIN step_time_runs AS u"
            " ON u.run_id = k.run_id WHERE k.hostname = ?", (host,)).fetchone()
        (by_samples,) = conn.execute(
            "SELECT max(sample_time) FROM resource_samples WHERE host = ? AND sample_time >= ?"
            " AND run_id IS NOT NULL", (host, since)).fetchone()
        latest = max((t for t in (by_steps, by_samples) if t is not None), default=None)
        if latest is not None and latest >= since:
            self._host_misses.pop(host, None)
            self._host_seen[host] = min(latest, now)  # a clock ahead of ours counts as now
            return True
        if len(self._host_misses) >= _MAX_REMEMBERED:
            self._host_misses.clear()
        self._host_misses[host] = clock
        return False

    def _pids_on(self, conn: sqlite3.Connection, host: str, since: float, clock: float, wanted: int) -> set[int]:
        """The pids a rank's own rows on `host` named since `since` (cached; looked up again, at most
        every `HOST_RECHECK_S`, when a foreign process figure names a pid not among them)."""
        cached = self._host_pids.get(host)
        if cached is not None and (wanted in cached[0] or clock - cached[1] < HOST_RECHECK_S):
            return cached[0]
        found = {int(pid) for (pid,) in conn.execute(
            "SELECT DISTINCT pid FROM resource_samples WHERE host = ? AND sample_time >= ?"
            " AND run_id IS NOT NULL AND pid IS NOT NULL", (host, since))}
        if cached is not None:
            found |= cached[0]
        if len(self._host_pids) >= _MAX_REMEMBERED:
            self._host_pids.clear()
        self._host_pids[host] = (found, clock)
        return found

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

    def _has_restarts(self) -> bool:
        return bool(self._conn.execute("SELECT 1 FROM step_time_runs WHERE attempt > 0 LIMIT 1").fetchone())

    def _separate_attempts(self, conn: sqlite3.Connection, step_rows: dict, memory_rows: dict) -> tuple[int, int]:
        """Keep attempts apart (inside the write transaction); returns (stored, duplicates) of the
        rows it sent to the attempt tables, which it takes out of `step_rows` / `memory_rows`.

        The current-attempt tables hold one attempt per run: a row of a later attempt than the
        run's moves every stored row of the run to the attempt tables (keyed by attempt, so
        nothing is overwritten), resets the run's latest step and end markers (they were the
        earlier attempt's) and bumps its rank-universe version so live readers reload; a row of
        an earlier attempt (sent late) is kept there too, never in the current tables."""
        runs = {key[0] for key in step_rows} | {key[0] for key in memory_rows}
        newest: dict[str, int] = {}
        for key in (*step_rows, *memory_rows):
            newest[key[0]] = max(newest.get(key[0], 0), key[1])
        current: dict[str, int] = {}
        for run_id in runs:
            row = conn.execute("SELECT attempt FROM step_time_runs WHERE run_id = ?", (run_id,)).fetchone()
            stored = None if row is None else int(row[0])
            if stored is None:
                current[run_id] = newest[run_id]
                continue
            if newest[run_id] > stored:
                self._archive_run(conn, run_id, stored, newest[run_id])
                stored = newest[run_id]
            current[run_id] = stored
        for run_id, attempt in current.items():
            if attempt:
                self._restarted = True
            conn.execute(
                "INSERT INTO step_time_runs (run_id, first_receive_time, last_receive_time, attempt)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (run_id) DO UPDATE SET attempt = excluded.attempt",
                (run_id, time.time(), time.time(), attempt))
        old_steps = [(k, r) for k, r in step_rows.items() if k[1] < current[k[0]]]
        old_memory = [(k, r) for k, r in memory_rows.items() if k[1] < current[k[0]]]
        for k, _ in old_steps:
            del step_rows[k]
        for k, _ in old_memory:
            del memory_rows[k]
        before = conn.total_changes
        conn.executemany(_INSERT_OLD_SAMPLE, [(k[1], *r) for k, r in old_steps])
        conn.executemany(_INSERT_OLD_MEMORY, [(k[1], *r) for k, r in old_memory])
        stored = conn.total_changes - before
        return stored, len(old_steps) + len(old_memory) - stored

    @staticmethod
    def _archive_run(conn: sqlite3.Connection, run_id: str, attempt: int, new_attempt: int) -> None:
        LOG.info("run %r: attempt %d started; attempt %d's rows kept apart", run_id, new_attempt, attempt)
        conn.execute(f"INSERT OR IGNORE INTO step_time_attempt_samples (attempt, {','.join(SAMPLE_COLUMNS)})"
                     f" SELECT ?, {','.join(SAMPLE_COLUMNS)} FROM step_time_samples WHERE run_id = ?",
                     (attempt, run_id))
        conn.execute("DELETE FROM step_time_samples WHERE run_id = ?", (run_id,))
        conn.execute(f"INSERT OR IGNORE INTO step_memory_attempt_samples (attempt, {','.join(MEMORY_COLUMNS)})"
                     f" SELECT ?, {','.join(MEMORY_COLUMNS)} FROM step_memory_samples WHERE run_id = ?",
                     (attempt, run_id))
        conn.execute("DELETE FROM step_memory_samples WHERE run_id = ?", (run_id,))
        conn.execute("UPDATE step_time_runs SET attempt = ?, latest_step = NULL, ranks_version = ranks_version + 1"
                     " WHERE run_id = ?", (new_attempt, run_id))
        conn.execute("UPDATE step_time_ranks SET finished_time = NULL, final_counts = NULL, outcome = NULL,"
                     " exit_code = NULL WHERE run_id = ?", (run_id,))

    def mark_rank_finished(self, run_id: str, rank: int, final_counts: Mapping[str, int], *,
                           outcome: str | None = None, exit_code: int | None = None, attempt: int = 0) -> None:
        """Record a rank's end marker (`traceml.run.end`): final counts and, when the rank said,
        how its process ended (`outcome`, `exit_code`). A marker of an earlier attempt than the
        run's current one is not the current attempt's end: it is ignored."""
        now = time.time()
        with self._lock, self._noting_damage():
            self._check_open()
            with self._conn:
                row = self._conn.execute("SELECT attempt FROM step_time_runs WHERE run_id = ?", (run_id,)).fetchone()
                if row is not None and attempt < int(row[0]):
                    return
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
                    "UPDATE step_time_ranks SET finished_time = ?, final_counts = ?, outcome = ?,"
                    " exit_code = ? WHERE run_id = ? AND global_rank = ?",
                    (now, json.dumps(dict(final_counts), sort_keys=True), outcome, exit_code, run_id, rank),
                )

    def record_drops(self, run_id: str, rank: int, counts: Mapping[str, int]) -> None:
        """Store a rank's cumulative dropped-telemetry counters (largest report per queue wins)."""
        rows = [(run_id, rank, queue, n) for queue, n in counts.items()]
        if not rows:
            return
        with self._lock, self._noting_damage():
            self._check_open()
            with self._conn:
                self._conn.executemany(
                    "INSERT INTO step_time_drops (run_id, global_rank, queue, dropped)"
                    " VALUES (?, ?, ?, ?) ON CONFLICT (run_id, global_rank, queue) DO UPDATE SET"
                    " dropped = max(dropped, excluded.dropped)",
                    rows,
                )

    def record_sources(self, notes) -> None:
        """Store which foreign mapping each rank's steps came through (`store_records.MappingNote`s):
        steps and unplaced counts add up over batches; the unmeasured phases are the mapping's own."""
        if not notes:
            return
        with self._lock, self._noting_damage():
            self._check_open()
            with self._conn:
                for note in notes:
                    key = (note.run_id, note.global_rank, note.mapping)
                    row = self._conn.execute(
                        "SELECT unplaced, steps FROM step_time_sources WHERE run_id = ? AND global_rank = ?"
                        " AND mapping = ?", key).fetchone()
                    unplaced = dict(note.unplaced)
                    steps = note.steps
                    if row is not None:
                        for label, n in json.loads(row[0]).items():
                            unplaced[label] = unplaced.get(label, 0) + n
                        steps += row[1]
                    self._conn.execute(
                        "INSERT OR REPLACE INTO step_time_sources (run_id, global_rank, mapping, unmeasured,"
                        " unplaced, steps) VALUES (?, ?, ?, ?, ?, ?)",
                        (*key, json.dumps(list(note.unmeasured)),
                         json.dumps(bounded_unplaced(unplaced), sort_keys=True), steps))

    def record_culprits(self, run_id: str, culprits) -> None:
        """Store a summarised run's confirmed culprits (`fleet.CulpritRecord`s), replacing what an
        earlier summary of the run recorded (a reopened run is summarised again)."""
        with self._lock, self._noting_damage():
            self._check_open()
            with self._conn:
                self._conn.execute("DELETE FROM fleet_culprits WHERE run_id = ?", (run_id,))
                self._conn.executemany(
                    "INSERT INTO fleet_culprits (run_id, global_rank, kind, host, device, ended_time,"
                    " lost_rank_seconds, lost_device_hours) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(run_id, c.global_rank, c.kind, c.host, c.device, c.ended_time, c.lost_rank_seconds,
                      c.lost_device_hours) for c in culprits])

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

    @contextlib.contextmanager
    def _noting_damage(self):
        """Note a damaged-page error for `/readyz` (`sqlite_guard`), then let it propagate."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            note_database_error(self.path, exc)
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("StepTimeStore is closed")

    def _log_unknown_events(self, count: int) -> None:
        level = logging.DEBUG if self._unknown_logged else logging.WARNING
        self._unknown_logged = True
        LOG.log(level, "step time store: %d raw event value(s) of names this version does not know,"
                       " kept in the audit payload only (logged once)", count)


__all__ = ["StepTimeStore", "WriteResult", "ensure_schema"]
