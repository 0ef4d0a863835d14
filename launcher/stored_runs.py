"""Finding a processor database and the runs in it (for `summary` and `top`).

Read-only: these helpers never create or migrate a database, so pointing them
at a live processor's file is safe.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from traceml.launcher import run_dir as rd

if TYPE_CHECKING:
    from traceml.processor.api import StoredRun


class RunLookupError(ValueError):
    """A path or run id that does not lead to stored Step Time data; the message says why."""


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
    """Runs in the database, most recently active last (`store_read.list_runs`, read newest first)."""
    from traceml.processor.api import NotAStore, StoreUnavailable, list_runs as list_stored_runs

    try:
        runs = list_stored_runs(db_path)
    except StoreUnavailable as exc:
        raise RunLookupError(f"cannot open {db_path}: {exc}") from exc
    except NotAStore as exc:
        raise RunLookupError(f"{db_path} is not a TraceML processor database ({exc})") from exc
    return runs[::-1]


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
