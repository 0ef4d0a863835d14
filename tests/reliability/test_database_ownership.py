"""Issue 32 item 3: a database that is not ours, or ours at a version we do not know, is never written.

The files are built by the sqlite3 command-line shell where the machine has one (else the
`sqlite3` module): another program's database that happens to hold a `step_time_samples`
table of its own, one stamped with another application id, one carrying our application id at
a version no release wrote. Each is refused before anything writes: its bytes hash the same
after, and its folder lists the same files (no `-wal`, `-shm`, journal, lock file or copy).
An older layout of ours is copied beside itself first (the copy holds what the file held,
a `-wal` left by a killed processor included), then brought up to date.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from harness.older_layouts import downgrade, older_database
from traceml.processor.sqlite_guard import DatabaseUnusable, check_database, known_layouts
from traceml.processor.sqlite_layout import APPLICATION_ID, DDL, LAYOUT_CHANGES, SCHEMA_USER_VERSION
from traceml.processor.sqlite_writer import StepTimeStore

SQLITE3_CLI = shutil.which("sqlite3")

OTHER_APP = """
PRAGMA journal_mode = WAL;
CREATE TABLE step_time_samples (id INTEGER PRIMARY KEY, job TEXT NOT NULL, step INTEGER, seconds REAL);
INSERT INTO step_time_samples (job, step, seconds) VALUES ('nightly', 1, 0.25), ('nightly', 2, 0.5);
"""
"""Another program's database: our table name, its own columns, in WAL mode."""


def build(path: Path, script: str) -> Path:
    """`script` run on a new file by the sqlite3 shell (the module where there is none)."""
    if SQLITE3_CLI:
        subprocess.run([SQLITE3_CLI, str(path)], input=script, text=True, check=True, capture_output=True,
                       timeout=30)
    else:
        conn = sqlite3.connect(path)
        conn.executescript(script)
        conn.close()
    return path


def state(folder: Path) -> dict[str, str]:
    """Every file in `folder` with the hash of its bytes."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def refused_untouched(path: Path) -> str:
    """Open `path` as the writer would; it must be refused and its folder left as it was."""
    before = state(path.parent)
    with pytest.raises(DatabaseUnusable) as refused:
        StepTimeStore(path)
    assert state(path.parent) == before
    return str(refused.value)


def _ours_current(folder: Path) -> Path:
    path = folder / "ours.db"
    StepTimeStore(path).close()
    return path


def test_another_programs_step_time_samples_table_is_refused_without_a_byte_changed(tmp_path):
    path = build(tmp_path / "other.db", OTHER_APP)
    message = refused_untouched(path)
    assert "belongs to another application" in message
    assert "step_time_samples has columns id, job, seconds, step" in message
    assert "left untouched" in message
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:  # still the other program's
        assert conn.execute("SELECT count(*) FROM step_time_samples").fetchone() == (2,)


def test_our_exact_tables_under_another_application_id_are_refused(tmp_path):
    script = DDL + "PRAGMA application_id = 1234; PRAGMA user_version = 4;"
    message = refused_untouched(build(tmp_path / "stamped.db", script))
    assert "belongs to another application (application_id 0x000004d2" in message


@pytest.mark.parametrize("change", ["version_no_release_wrote", "newer", "extra_column", "extra_index"])
def test_ours_at_a_layout_we_do_not_know_is_refused(tmp_path, change):
    path = _ours_current(tmp_path)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = DELETE")  # one file, so the hash covers all of it
    if change == "version_no_release_wrote":
        conn.execute("PRAGMA user_version = 3")  # our id, but version 3 never carried it with these tables
    elif change == "newer":
        conn.execute(f"PRAGMA user_version = {SCHEMA_USER_VERSION + 1}")
    elif change == "extra_column":
        conn.execute("ALTER TABLE step_time_runs ADD COLUMN note TEXT")
    else:
        conn.execute("CREATE INDEX step_time_runs_note ON step_time_runs (last_receive_time)")
    conn.commit()
    conn.close()
    message = refused_untouched(path)
    if change == "newer":
        assert "newer than this traceml-processor" in message
    elif change == "extra_index":
        assert "its tables step_time_runs_note" in message
    else:
        assert "carries traceml-processor's application id but not a layout this release knows" in message
    if change == "extra_column":
        assert "step_time_runs has columns" in message


def test_a_new_database_carries_our_application_id_and_version(tmp_path):
    path = _ours_current(tmp_path)
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        assert conn.execute("PRAGMA application_id").fetchone() == (APPLICATION_ID,)
        assert conn.execute("PRAGMA user_version").fetchone() == (SCHEMA_USER_VERSION,)
    check = check_database(path)
    assert (check.new, check.version, check.older) == (False, SCHEMA_USER_VERSION, False)
    assert known_layouts()[-1][0] == SCHEMA_USER_VERSION == LAYOUT_CHANGES[-1].version


def test_a_current_database_is_opened_without_a_copy_or_a_change(tmp_path):
    path = _ours_current(tmp_path)
    before = state(tmp_path)
    StepTimeStore(path).close()
    assert state(tmp_path) == before


def _dump(path: Path) -> list[str]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


@pytest.mark.parametrize("version", sorted({change.version for change in LAYOUT_CHANGES[:-1]} | {1}))
@pytest.mark.slow
def test_an_older_layout_of_ours_is_copied_beside_it_then_brought_up_to_date(tmp_path, version):
    path = older_database(tmp_path / "traceml.db", version)
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO step_time_runs (run_id, first_receive_time, last_receive_time) VALUES ('old', 1, 2)")
    conn.commit()
    conn.close()
    original = _dump(path)
    check = check_database(path)
    assert (check.new, check.version, check.older) == (False, version, True)

    with StepTimeStore(path) as store:
        store.mark_rank_finished("old", 0, {}, outcome="finished", exit_code=0)
    copy = tmp_path / f"traceml.db.v{version}.bak"
    assert _dump(copy) == original  # the copy is the file as it was
    assert check_database(copy).version == version and check_database(copy).older
    assert not any(tmp_path.glob("*.bak-*")) and not any(tmp_path.glob("*.partial"))
    assert not (tmp_path / f"{copy.name}-wal").exists() and not (tmp_path / f"{copy.name}-journal").exists()
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        assert conn.execute("PRAGMA application_id").fetchone() == (APPLICATION_ID,)
        assert conn.execute("PRAGMA user_version").fetchone() == (SCHEMA_USER_VERSION,)
        assert conn.execute("SELECT run_id FROM step_time_runs").fetchall() == [("old",)]
    assert check_database(path).older is False

    StepTimeStore(path).close()  # migrated once: no second copy
    assert sorted(p.name for p in tmp_path.glob("*.bak")) == [copy.name]


def test_the_copy_of_a_killed_processors_older_file_holds_what_its_wal_held(tmp_path):
    """An older processor killed with rows still in `-wal`: the copy is taken through SQLite
    (which reads the WAL), not by copying the main file's bytes, so those rows are in it."""
    live = tmp_path / "live.db"
    StepTimeStore(live).close()
    writer = sqlite3.connect(live)
    downgrade(writer, 4)
    writer.execute("PRAGMA wal_autocheckpoint = 0")
    writer.execute("INSERT INTO step_time_runs (run_id, first_receive_time, last_receive_time) VALUES ('wal', 1, 2)")
    writer.commit()
    killed = tmp_path / "killed"
    killed.mkdir()
    for suffix in ("", "-wal", "-shm"):  # what a kill -9 leaves: the writer never closed
        shutil.copyfile(f"{live}{suffix}", killed / f"traceml.db{suffix}")
    writer.close()
    StepTimeStore(killed / "traceml.db").close()
    copy = killed / "traceml.db.v4.bak"
    with sqlite3.connect(f"file:{copy}?mode=ro", uri=True) as conn:
        assert conn.execute("SELECT run_id FROM step_time_runs").fetchall() == [("wal",)]
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)


def test_a_taken_copy_name_is_never_overwritten(tmp_path):
    path = older_database(tmp_path / "traceml.db", 3)
    (tmp_path / "traceml.db.v3.bak").write_bytes(b"an earlier copy")
    StepTimeStore(path).close()
    assert (tmp_path / "traceml.db.v3.bak").read_bytes() == b"an earlier copy"
    assert check_database(tmp_path / "traceml.db.v3.1.bak").version == 3


@pytest.mark.slow
def test_the_processor_refuses_another_programs_database_in_one_line_and_leaves_its_folder(tmp_path):
    """The real CLI: exit 1, one line, the file and its folder as they were (no lock file either)."""
    folder = tmp_path / "theirs"
    folder.mkdir()
    path = build(folder / "app.db", OTHER_APP)
    before = state(folder)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACEML_"))}
    result = subprocess.run(
        [sys.executable, "-m", "traceml.processor.cli", "--db", str(path), "--otlp-grpc", "127.0.0.1:0",
         "--otlp-http", "127.0.0.1:0", "--export-endpoint", "off"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("traceml-processor: cannot start: ") and "belongs to another application" in lines[0]
    assert state(folder) == before
