"""Issue 18 item 5: start-up explains a bad database, never touches a foreign one, one processor per file.

Every case runs the real `traceml-processor` CLI on loopback. A bad `--db` must end
in exit 1 with one line on stderr (what is wrong, what to do) and no traceback, and
leave the file byte for byte as it was, with no `-wal` / `-shm` created beside it.
A page damaged while the processor serves turns `/readyz` to 503 with the reason.
A second processor on the same database is refused while the first holds it, and
starts once the first was killed with SIGKILL (the kernel drops a dead holder's lock).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness.processor_process import ProcessorProcess
from harness.waiting import wait_until
from harness.reliability import reliability_helpers as h
from tests.step_time.scenarios import build_scenario
from traceml.processor.sqlite_guard import LOCK_SUFFIX, database_fault
from traceml.processor.sqlite_layout import SCHEMA_USER_VERSION, connect_readonly

SIDE_FILES = ("-wal", "-shm", "-journal")


@pytest.fixture(scope="module")
def populated(tmp_path_factory) -> Path:
    """A database as the processor writes it (200 rows), closed cleanly."""
    return build_scenario("complete_gpu", tmp_path_factory.mktemp("populated") / "traceml.db")


def copy_of(db: Path, folder: Path, name: str = "traceml.db") -> Path:
    target = folder / name
    shutil.copyfile(db, target)
    return target


def page_size_and_root(db: Path, table: str = "step_time_samples") -> tuple[int, int]:
    conn = connect_readonly(db)
    try:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
    finally:
        conn.close()
    return page_size, root


def damage_page(db: Path, page: int, page_size: int) -> None:
    """Overwrite one page (1-based) with seeded garbage, as bit rot or a bad sector would."""
    garbage = random.Random(page).randbytes(page_size)
    with open(db, "r+b") as handle:
        handle.seek((page - 1) * page_size)
        handle.write(garbage)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_cli(db: Path, cwd: Path, timeout_s: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACEML_"))}
    return subprocess.run(
        [sys.executable, "-m", "traceml.processor.cli", "--db", str(db), "--otlp-grpc", "127.0.0.1:0",
         "--otlp-http", "127.0.0.1:0", "--export-endpoint", "off"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)


# --- bad files: each kind is refused in one line and left as it was ---------------------------


def _foreign(folder: Path) -> Path:
    path = folder / "app.db"
    conn = sqlite3.connect(path)
    conn.executescript("CREATE TABLE accounts (id INTEGER PRIMARY KEY, name TEXT);"
                       "INSERT INTO accounts (name) VALUES ('alice');")
    conn.close()
    return path


def _foreign_wal(folder: Path) -> Path:
    path = folder / "app-wal.db"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.executescript("CREATE TABLE notes (body TEXT); INSERT INTO notes VALUES ('x');")
    conn.close()
    return path


def _foreign_same_names(folder: Path) -> Path:
    """Another application that happens to use one of our table names, plus its own."""
    path = folder / "similar.db"
    conn = sqlite3.connect(path)
    conn.executescript("CREATE TABLE step_time_runs (x); CREATE TABLE settings (k, v);")
    conn.close()
    return path


def _foreign_user_version(folder: Path) -> Path:
    path = folder / "versioned.db"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 42")
    conn.close()
    return path


def _not_sqlite(folder: Path) -> Path:
    path = folder / "random.db"
    path.write_bytes(random.Random(7).randbytes(8192))
    return path


def _text(folder: Path) -> Path:
    path = folder / "notes.txt"
    path.write_text("a file some script wrote\n")
    return path


def _header_only(folder: Path, populated: Path) -> Path:
    path = folder / "cut.db"
    path.write_bytes(populated.read_bytes()[:60])
    return path


def _truncated(folder: Path, populated: Path) -> Path:
    path = folder / "half.db"
    data = populated.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _newer_schema(folder: Path, populated: Path) -> Path:
    path = copy_of(populated, folder, "newer.db")
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_USER_VERSION + 1}")
    conn.execute("PRAGMA journal_mode = DELETE")  # leave no side files of our own making
    conn.close()
    return path


def _damaged_page(folder: Path, populated: Path) -> Path:
    path = copy_of(populated, folder, "rotten.db")
    page_size, root = page_size_and_root(path)
    damage_page(path, root, page_size)
    return path


def _damaged_index_leaf(folder: Path, populated: Path) -> Path:
    """A page in the middle of the file (not a root), found by `quick_check` at start."""
    path = copy_of(populated, folder, "rotten-middle.db")
    page_size = page_size_and_root(path)[0]
    damage_page(path, path.stat().st_size // page_size // 2, page_size)
    return path


FOREIGN = {"foreign": _foreign, "foreign_wal": _foreign_wal, "foreign_same_names": _foreign_same_names,
           "foreign_user_version": _foreign_user_version, "not_sqlite": _not_sqlite, "text": _text}
FROM_POPULATED = {"header_only": _header_only, "truncated": _truncated, "newer_schema": _newer_schema,
                  "damaged_root_page": _damaged_page, "damaged_middle_page": _damaged_index_leaf}
EXPECTED = {
    "foreign": "belongs to another application", "foreign_wal": "belongs to another application",
    "foreign_same_names": "belongs to another application",
    "foreign_user_version": "belongs to another application", "not_sqlite": "is not a SQLite database",
    "text": "is not a SQLite database", "header_only": "is truncated", "truncated": "is truncated",
    "newer_schema": "newer than this traceml-processor", "damaged_root_page": "is damaged",
    "damaged_middle_page": "is damaged",
}


def assert_refused_in_one_line(result: subprocess.CompletedProcess, expected: str) -> str:
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("traceml-processor: cannot start: ") and expected in lines[0], lines[0]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", [*FOREIGN, *FROM_POPULATED])
def test_a_bad_database_is_refused_in_one_line_and_left_unchanged(kind, tmp_path, populated):
    make = FOREIGN.get(kind)
    path = make(tmp_path) if make is not None else FROM_POPULATED[kind](tmp_path, populated)
    before = digest(path)
    existing = set(os.listdir(tmp_path))
    line = assert_refused_in_one_line(run_cli(path, tmp_path), EXPECTED[kind])
    assert str(path.name) in line
    assert digest(path) == before, "the refused file was changed"
    created = set(os.listdir(tmp_path)) - existing
    allowed = {path.name + LOCK_SUFFIX} if kind.startswith("damaged") else set()  # ours: it is our file
    assert created <= allowed, created


@pytest.mark.slow
def test_a_directory_or_missing_folder_is_refused_in_one_line(tmp_path):
    (tmp_path / "dir.db").mkdir()
    assert_refused_in_one_line(run_cli(tmp_path / "dir.db", tmp_path), "is a directory")
    assert_refused_in_one_line(run_cli(tmp_path / "nowhere" / "traceml.db", tmp_path), "does not exist")


def _chattr(flag: str, path: Path) -> bool:
    return shutil.which("chattr") is not None and subprocess.run(
        ["chattr", flag, str(path)], capture_output=True, timeout=10).returncode == 0


@contextlib.contextmanager
def unwritable(path: Path, mode: int):
    """`path` made unwritable for this user: by its mode, or, for root (whom modes do not
    stop), by the immutable attribute, which stops root too. Restored on the way out."""
    if os.geteuid() != 0:
        path.chmod(mode)
        try:
            yield
        finally:
            path.chmod(0o755 if path.is_dir() else 0o644)
        return
    if not _chattr("+i", path):
        pytest.skip("running as root without chattr +i on this filesystem: nothing stops root writing")
    try:
        yield
    finally:
        _chattr("-i", path)


@pytest.mark.slow
def test_a_read_only_database_or_folder_is_refused_in_one_line(tmp_path, populated):
    read_only = copy_of(populated, tmp_path, "ro.db")
    with unwritable(read_only, 0o444):
        assert_refused_in_one_line(run_cli(read_only, tmp_path), "is read-only for this user")
        assert digest(read_only) == digest(populated)
    folder = tmp_path / "locked"
    folder.mkdir()
    inside = copy_of(populated, folder)
    with unwritable(folder, 0o555):
        assert_refused_in_one_line(run_cli(inside, tmp_path), "is not writable")
    assert sorted(p.name for p in folder.iterdir()) == ["traceml.db"]  # no side file was made


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file: no permission can make one unreadable to it")
def test_an_unreadable_database_is_refused_in_one_line(tmp_path, populated):
    unreadable = copy_of(populated, tmp_path, "hidden.db")
    unreadable.chmod(0o000)
    try:
        assert_refused_in_one_line(run_cli(unreadable, tmp_path), "cannot read")
    finally:
        unreadable.chmod(0o644)


@pytest.mark.slow
def test_an_empty_file_and_a_good_database_start(tmp_path, populated):
    """The checks refuse only what is wrong: a new path, an empty file (what `touch` or
    `mktemp` leaves) and a database the processor wrote all start."""
    (tmp_path / "empty.db").touch()
    for db in (tmp_path / "new.db", tmp_path / "empty.db", copy_of(populated, tmp_path)):
        with ProcessorProcess(tmp_path / f"p-{db.stem}", db=db).start(wait_readyz=True) as proc:
            assert proc.ready()


# --- damage met while serving -------------------------------------------------------------------


def readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def post_steps(port: int, run_id: str, steps) -> int:
    body = h.steps_request(run_id, 0, steps).SerializeToString()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/traces", data=body, method="POST",
                                     headers={"Content-Type": "application/x-protobuf"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.slow
def test_a_page_damaged_while_serving_turns_readyz_to_503_with_the_reason(tmp_path, populated):
    db = copy_of(populated, tmp_path)
    page_size, root = page_size_and_root(db)
    with ProcessorProcess(tmp_path, db=db).start(wait_readyz=True) as proc:
        # The table's root, not yet read by the writer (a page it rewrote would live in the
        # WAL and its cache): the next write must read it from the file.
        damage_page(db, root, page_size)
        statuses = []
        assert wait_until(lambda: statuses.append(post_steps(proc.http, "run-after", range(1, 4)))
                          or readyz(proc.http)[0] == 503, 30, 0.2), statuses
        status, body = readyz(proc.http)
        assert status == 503 and "database damaged" in body and "malformed" in body, body
        assert wait_until(lambda: "is damaged" in proc.log_text(), 10)
        assert proc.log_text().count("is damaged") == 1  # logged once, not per request


def test_a_reader_meeting_a_damaged_page_reports_it(tmp_path, populated):
    """The read side (live tail, summary) notes the damage too, for `/readyz`."""
    from traceml.processor.step_time.sqlite_reader import load_summary_snapshot

    db = copy_of(populated, tmp_path)
    run_id = connect_readonly(db).execute("SELECT run_id FROM step_time_runs").fetchone()[0]
    page_size, root = page_size_and_root(db)
    damage_page(db, root, page_size)
    assert database_fault(db) is None
    with pytest.raises(sqlite3.DatabaseError):
        load_summary_snapshot(db, run_id)
    assert "malformed" in database_fault(db)


# --- one processor per database -----------------------------------------------------------------


@pytest.mark.slow
def test_a_second_processor_is_refused_until_the_first_is_killed(tmp_path):
    db = tmp_path / "shared.db"
    first = ProcessorProcess(tmp_path / "first", db=db).start(wait_readyz=True)
    try:
        line = assert_refused_in_one_line(run_cli(db, tmp_path), "another traceml-processor")
        assert f"pid {first.proc.pid}" in line
        assert first.ready()  # the refused start took nothing from the running one
        # Readers never take the lock: `traceml summary --list` works beside the writer.
        listed = subprocess.run([sys.executable, "-m", "traceml.launcher.cli", "summary", str(db), "--list"],
                                capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        first.kill9()
        with ProcessorProcess(tmp_path / "second", db=db).start(wait_readyz=True) as second:
            assert second.ready()
    finally:
        first.stop()


@pytest.mark.slow
def test_ingest_workers_share_their_processors_database(tmp_path):
    """`--workers 2`: the spawned worker opens the same database under its parent's lock."""
    with ProcessorProcess(tmp_path, extra_args=["--workers", "2"]).start(wait_readyz=True) as proc:
        assert proc.ready()
        assert "another traceml-processor" not in proc.log_text()
