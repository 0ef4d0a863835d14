"""Finding a processor database and the runs in it (for `summary` and `top`).

Read-only: these helpers never create or migrate a database, so pointing them
at a live processor's file is safe.
"""
from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from traceml.launcher import run_dir as rd


class RunLookupError(ValueError):
    """A path or run id that does not lead to stored Step Time data; the message says why."""


@dataclass(frozen=True, slots=True)
class StoredRun:
    run_id: str
    latest_step: int | None
    last_receive_time: float


def find_database(path: str | Path) -> Path:
    """A database file as given, or the one inside a run folder."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        candidate = path / rd.DB_FILENAME
        if candidate.is_file():
            return candidate
        found = sorted(path.glob("*.sqlite")) + sorted(path.glob("*.db"))
        if len(found) == 1:
            return found[0]
        if found:
            raise RunLookupError(f"{path} holds several databases ({', '.join(p.name for p in found)}); "
                                 "pass one of them")
        raise RunLookupError(f"{path} holds no TraceML database ({rd.DB_FILENAME})")
    raise RunLookupError(f"{path} does not exist")


def list_runs(db_path: Path) -> list[StoredRun]:
    """Runs in the database, most recently active last."""
    from traceml.processor.sqlite_layout import connect_readonly

    try:
        conn = connect_readonly(db_path)
    except (sqlite3.Error, OSError) as exc:
        raise RunLookupError(f"cannot open {db_path}: {exc}") from exc
    try:
        rows = conn.execute(
            "SELECT run_id, latest_step, last_receive_time FROM step_time_runs"
            " ORDER BY last_receive_time, run_id").fetchall()
    except sqlite3.Error as exc:
        raise RunLookupError(f"{db_path} is not a TraceML processor database ({exc})") from exc
    finally:
        conn.close()
    return [StoredRun(run_id, latest_step, float(last)) for run_id, latest_step, last in rows]


def choose_run(db_path: Path, run_id: str | None) -> str:
    """The requested run (which must exist) or the most recently active one."""
    runs = list_runs(db_path)
    if run_id is not None:
        if any(r.run_id == run_id for r in runs):
            return run_id
        known = ", ".join(r.run_id for r in runs) or "none"
        raise RunLookupError(f"run {run_id!r} is not in {db_path} (runs there: {known})")
    if not runs:
        raise RunLookupError(f"{db_path} holds no runs yet")
    return runs[-1].run_id
