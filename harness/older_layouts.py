"""Databases as an older traceml-processor wrote them, made from a current one.

`sqlite_layout.LAYOUT_CHANGES` is the layout's history; `downgrade` takes back every
change made after `version` (whole tables dropped, added columns dropped) and leaves
the header as that release left it: its `user_version`, no application id. What the
rows hold is the caller's business (a test of old `packed` rows rewrites them too).
"""
from __future__ import annotations

import sqlite3
from pathlib import Path

from traceml.processor.sqlite_layout import LAYOUT_CHANGES


def downgrade(conn: sqlite3.Connection, version: int) -> None:
    """Turn the current layout in `conn` into the last layout `version` wrote."""
    later = [change for change in LAYOUT_CHANGES if change.version > version]
    dropped = {table for change in later for table in change.tables}
    for table in sorted(dropped):
        conn.execute(f"DROP TABLE {table}")
    for change in later:
        for table, column, _ in change.columns:
            if table not in dropped:
                conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    conn.execute("PRAGMA application_id = 0")
    conn.execute(f"PRAGMA user_version = {version}")
    conn.commit()


def older_database(path: Path, version: int) -> Path:
    """A new, empty database at `path` in the layout `version` wrote (rollback journal, one file)."""
    from traceml.processor.sqlite_layout import DDL

    conn = sqlite3.connect(path)
    try:
        conn.executescript(DDL)
        downgrade(conn, version)
    finally:
        conn.close()
    return path
