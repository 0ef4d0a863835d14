"""What a test reads back from, or plants in, a Step Time database.

The processor itself never needs these reads (its readers are `runs`, `service`,
`summary_section` and `step_time/sqlite_reader.py`), so they live here rather than on
the writer. Reads go through the processor's own `connect_readonly`, so they are
safe beside a live processor. `insert_foreign_row` plays a writer that is not
ours, for the read side's defences.
"""
from __future__ import annotations

import json
import math
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from traceml.processor.sqlite_layout import (
    PACKED_FORMAT,
    PACKED_METRICS,
    SAMPLE_COLUMNS,
    connect_readonly,
    metric_columns,
)


@dataclass(frozen=True)
class StoredRun:
    """One `step_time_runs` row: strategy and cursor."""

    run_id: str
    training_strategy: str | None
    latest_row_id: int
    latest_step: int | None
    last_receive_time: float
    last_sample_time: float | None


def _query(db: Path, sql: str, args: tuple = ()) -> list[tuple]:
    conn = connect_readonly(db)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def count_rows(db: Path, table: str = "step_time_samples", run_id: str | None = None) -> int:
    """Rows in `table` (of `run_id` when given); the table name is checked, it is spliced into the SQL."""
    assert re.fullmatch(r"[a-z_]+", table), table
    if run_id is None:
        return _query(db, f"SELECT count(*) FROM {table}")[0][0]
    return _query(db, f"SELECT count(*) FROM {table} WHERE run_id = ?", (run_id,))[0][0]


def stored_step_keys(db: Path, run_id: str | None = None) -> set[tuple[str, int, int]]:
    """(run_id, rank, step) of every stored step row (of `run_id` when given)."""
    sql = "SELECT run_id, global_rank, step FROM step_time_samples"
    rows = _query(db, sql + (" WHERE run_id = ?" if run_id else ""), (run_id,) if run_id else ())
    return {(r, int(k), int(s)) for r, k, s in rows}


def stored_memory_keys(db: Path) -> set[tuple[str, int, int, str]]:
    """(run_id, rank, step, device) of every stored memory row."""
    return {(r, int(k), int(s), d) for r, k, s, d in _query(
        db, "SELECT run_id, global_rank, step, device FROM step_memory_samples")}


def stored_memory_values(db: Path, run_id: str) -> dict[tuple[int, int, str], tuple[int | None, int | None]]:
    """(rank, step, device) -> (peak allocated, peak reserved) bytes of a run's stored memory rows."""
    return {(int(k), int(s), d): (a, r) for k, s, d, a, r in _query(
        db, "SELECT global_rank, step, device, peak_allocated_bytes, peak_reserved_bytes"
            " FROM step_memory_samples WHERE run_id = ?", (run_id,))}


def steps_per_rank(db: Path) -> dict[int, int]:
    """rank -> stored step rows; empty while the file or its tables do not exist yet (a poll's answer)."""
    if not db.exists():
        return {}
    try:
        return dict(_query(db, "SELECT global_rank, COUNT(*) FROM step_time_samples GROUP BY global_rank"))
    except (FileNotFoundError, sqlite3.Error):
        return {}


def integrity_ok(db: Path) -> bool:
    """SQLite's own `PRAGMA integrity_check` says "ok"."""
    return _query(db, "PRAGMA integrity_check")[0][0] == "ok"


def stored_run_ids(db: Path) -> list[str]:
    """Run ids in the store, oldest first."""
    return [r[0] for r in _query(db, "SELECT run_id FROM step_time_runs ORDER BY first_receive_time, run_id")]


def stored_run(db: Path, run_id: str) -> StoredRun | None:
    rows = _query(db, "SELECT run_id, training_strategy, latest_row_id, latest_step, last_receive_time,"
                      " last_sample_time FROM step_time_runs WHERE run_id = ?", (run_id,))
    return StoredRun(*rows[0]) if rows else None


def finished_ranks(db: Path, run_id: str) -> dict[int, dict[str, int]]:
    """Ranks that sent their end-of-run marker -> their final counts."""
    rows = _query(db, "SELECT global_rank, final_counts FROM step_time_ranks"
                      " WHERE run_id = ? AND finished_time IS NOT NULL", (run_id,))
    return {rank: json.loads(counts or "{}") for rank, counts in rows}


def reported_drops(db: Path, run_id: str) -> dict[int, dict[str, int]]:
    """rank -> queue -> dropped records reported."""
    out: dict[int, dict[str, int]] = {}
    for rank, queue, dropped in _query(
            db, "SELECT global_rank, queue, dropped FROM step_time_drops WHERE run_id = ?", (run_id,)):
        out.setdefault(rank, {})[queue] = dropped
    return out


def pack_values(values: Mapping[str, float | None], sample_time: float | None, rank: int,
                step: int) -> bytes:
    """Column name -> value, into the `packed` BLOB layout (NaN for missing), as any writer could."""
    flat = []
    for metric in PACKED_METRICS:
        cpu_col, gpu_col, _ = metric_columns(metric)
        for col in (cpu_col, gpu_col):
            value = values.get(col)
            flat.append(math.nan if value is None else float(value))
    flat.append(math.nan if sample_time is None else float(sample_time))
    return PACKED_FORMAT.pack(*flat, rank, step)


def insert_foreign_row(db: Path, row: tuple) -> None:
    """Insert one `step_time_samples` row (in `SAMPLE_COLUMNS` order) bypassing the writer."""
    conn = sqlite3.connect(db)
    with conn:
        conn.execute(f"INSERT INTO step_time_samples ({','.join(SAMPLE_COLUMNS)})"
                     f" VALUES ({','.join('?' * len(SAMPLE_COLUMNS))})", row)
    conn.close()


__all__ = ["StoredRun", "count_rows", "finished_ranks", "insert_foreign_row", "integrity_ok", "pack_values",
           "reported_drops", "steps_per_rank", "stored_memory_keys", "stored_run", "stored_run_ids",
           "stored_step_keys"]
