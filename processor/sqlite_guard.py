"""Is the `--db` file ours, whole and ours alone: the checks between the flag and the writer.

A processor is pointed at a path by an operator, a Helm value or a typo. Before
anything writes there:

- `check_database` reads the file without changing it (its header as bytes, then
  its catalog through a read-only connection that leaves no file beside it) and
  refuses, with one line saying what is wrong and what to do, a directory, a file
  that is not SQLite, a truncated one, one that is not ours, one of ours at a
  version this release does not know (newer included), and one this user may not
  read or write. Ours means: `sqlite_layout.APPLICATION_ID` and exactly the current
  tables, columns and indexes at the current `user_version`, or exactly the layout
  one of the older versions wrote (`LAYOUT_CHANGES`; those files carry no
  application id). A table name alone proves nothing: another program may have a
  `step_time_samples` of its own. Only a file that passes is opened for writing (WAL
  and the tables come after, in `sqlite_writer`), so a foreign file is never touched.
- `keep_copy` copies an older layout of ours beside it (`<db>.v<N>.bak`, through
  SQLite's online backup, so a `-wal` left by a killed processor is in the copy)
  before the writer brings it up to date.
- `WriterLock` makes a second processor on the same database refuse to start
  (the docs say never to share one: two writers' run monitors would both end and
  summarise the same runs). It is a `flock` on `<db>-processor.lock`, which the
  kernel drops when the holder dies, `kill -9` included. Readers (`traceml
  summary`, `top`, the live view) never take it, and the ingest workers of one
  processor (`--workers`) share the database under their parent's lock.
- `integrity_check` runs SQLite's `quick_check` at start within a time budget,
  and `note_database_error` records a damaged page met later by the writer or a
  reader (SQLITE_CORRUPT, "database disk image is malformed"), so `/readyz`
  reports it (`database_fault`) and the log says it once.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import sqlite3
import stat
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from traceml.processor.sqlite_layout import (
    APPLICATION_ID,
    DDL,
    FIRST_USER_VERSION,
    LAYOUT_CHANGES,
    SCHEMA_OBJECTS,
    SCHEMA_USER_VERSION,
    connect_readonly,
)

LOG = logging.getLogger(__name__)

SQLITE_MAGIC = b"SQLite format 3\x00"
LOCK_SUFFIX = "-processor.lock"
QUICK_CHECK_BUDGET_S = 5.0
"""Most time the start-up integrity check may take (it may overrun by up to about a
second). `quick_check` reads every page: 2.5 GiB took 2.0 s from the page cache on
the project's 2-core machine, so a database of more than a few GiB is checked only
in part at start (logged); a damaged page found later is still reported."""

_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26
_DO_NEW = "point --db at a new file (the processor creates it)"
_DO_RESTORE = "restore it from a backup, or move it aside and " + _DO_NEW


class DatabaseUnusable(RuntimeError):
    """The database cannot be used; the message is one line: what is wrong, what to do."""


@dataclass(frozen=True)
class DatabaseCheck:
    """What `check_database` found: `new` when nothing (or an empty file) is there yet,
    else ours at `version` (older than `SCHEMA_USER_VERSION` when `older`)."""

    path: Path
    new: bool
    version: int = SCHEMA_USER_VERSION

    @property
    def older(self) -> bool:
        return not self.new and self.version < SCHEMA_USER_VERSION


@dataclass(frozen=True)
class Layout:
    """What a database holds, as its catalog says: table -> column names, and index -> table."""

    tables: dict[str, frozenset[str]]
    indexes: dict[str, str]

    def without(self, tables: tuple[str, ...], columns: tuple[tuple[str, str, str], ...]) -> "Layout":
        kept = {name: cols for name, cols in self.tables.items() if name not in tables}
        for table, column, _ in columns:
            if table in kept:
                kept[table] = kept[table] - {column}
        return Layout(kept, {name: table for name, table in self.indexes.items() if table in kept})


@functools.cache
def known_layouts() -> tuple[tuple[int, Layout], ...]:
    """(user_version, layout) of every layout a release of ours wrote, oldest first; the last
    is the current one. Read from `DDL` built in memory, less the changes made after each."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.executescript(DDL)
        current = _read_layout(conn, _catalog(conn))
    finally:
        conn.close()
    found = []
    for i in range(len(LAYOUT_CHANGES) + 1):
        later = LAYOUT_CHANGES[i:]
        version = LAYOUT_CHANGES[i - 1].version if i else FIRST_USER_VERSION
        found.append((version, current.without(tuple(t for c in later for t in c.tables),
                                               tuple(col for c in later for col in c.columns))))
    return tuple(found)


def _catalog(conn: sqlite3.Connection) -> list[tuple[str, str, str]]:
    """(type, name, table) of every schema object bar SQLite's own."""
    return [row for row in conn.execute("SELECT type, name, tbl_name FROM sqlite_master")
            if not row[1].startswith("sqlite_")]


def _read_layout(conn: sqlite3.Connection, catalog: list[tuple[str, str, str]]) -> Layout:
    """The layout of a catalog whose every name is one of ours (so safe to quote as is)."""
    tables = {name: frozenset(row[1] for row in conn.execute(f'PRAGMA table_info("{name}")'))
              for kind, name, _ in catalog if kind == "table"}
    return Layout(tables, {name: table for kind, name, table in catalog if kind == "index"})


def lock_path(db_path: str | Path) -> Path:
    path = Path(db_path)
    return path.with_name(path.name + LOCK_SUFFIX)


def check_database(path: str | Path) -> DatabaseCheck:
    """Refuse (`DatabaseUnusable`) any `path` the writer must not open; never changes a file."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise DatabaseUnusable(f"{path} is a directory; --db needs a file path, e.g. {path / 'traceml.db'}")
    if not folder.is_dir():
        raise DatabaseUnusable(f"the folder of {path} does not exist; create {folder} first")
    try:
        info = path.stat()
    except FileNotFoundError:
        _check_folder_writable(path)
        return DatabaseCheck(path, new=True)
    except OSError as exc:
        raise DatabaseUnusable(f"cannot look at {path}: {exc.strerror}; check the permissions of {folder}") from None
    if not stat.S_ISREG(info.st_mode):
        raise DatabaseUnusable(f"{path} is not a regular file; {_DO_NEW}")
    try:
        with open(path, "rb") as handle:
            header = handle.read(100)
    except OSError as exc:
        raise DatabaseUnusable(
            f"cannot read {path}: {exc.strerror} (mode {stat.filemode(info.st_mode)}, owner uid {info.st_uid},"
            f" this process uid {os.geteuid()}); give this user read and write access or {_DO_NEW}") from None
    if not header:
        _check_writable(path, info)
        return DatabaseCheck(path, new=True)  # an empty file is a new SQLite database
    if not header.startswith(SQLITE_MAGIC) and not SQLITE_MAGIC.startswith(header):
        raise DatabaseUnusable(f"{path} is not a SQLite database (it starts with {header[:16]!r}); {_DO_NEW}")
    if len(header) < 100:
        raise DatabaseUnusable(f"{path} is truncated ({info.st_size} bytes, shorter than a SQLite header);"
                               f" {_DO_RESTORE}")
    expected = _size_from_header(header)
    if expected is not None and info.st_size < expected:
        raise DatabaseUnusable(f"{path} is truncated ({info.st_size} bytes, its header says {expected});"
                               f" {_DO_RESTORE}")
    _check_writable(path, info)
    try:
        conn = _connect_leaving_no_trace(path)
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            catalog = _catalog(conn)
            foreign = sorted(name for _, name, _ in catalog if name not in SCHEMA_OBJECTS)
            layout = None if foreign or app_id not in (0, APPLICATION_ID) else _read_layout(conn, catalog)
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise DatabaseUnusable(f"{path} cannot be read as a SQLite database ({exc}); {_DO_RESTORE}") from None
    except sqlite3.Error as exc:
        raise DatabaseUnusable(f"cannot open {path} ({exc}); check that no other program holds it") from None
    return _judge(path, app_id, version, foreign, layout)


def _judge(path: Path, app_id: int, version: int, foreign: list[str], layout: Layout | None) -> DatabaseCheck:
    """Ours (and at which version), new, or refused: from what `check_database` read."""
    if app_id == APPLICATION_ID and version > SCHEMA_USER_VERSION:
        raise DatabaseUnusable(f"{path} has schema version {version}, newer than this traceml-processor's"
                               f" {SCHEMA_USER_VERSION}; run the release that wrote it, or {_DO_NEW}")
    if layout is not None:
        if app_id == 0 and version == 0 and not layout.tables and not layout.indexes:
            return DatabaseCheck(path, new=True)  # a SQLite file with nothing in it yet
        for known_version, known in known_layouts():
            if known_version == version and known == layout and (
                    app_id == APPLICATION_ID or known_version < SCHEMA_USER_VERSION):
                return DatabaseCheck(path, new=False, version=version)
    shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
    if app_id == APPLICATION_ID:
        other = f"; its tables {shown}" if foreign else _difference(layout, version)
        raise DatabaseUnusable(
            f"{path} carries traceml-processor's application id but not a layout this release knows"
            f" (user_version {version}{other}), so it is left untouched; {_DO_RESTORE}")
    if foreign:
        what = f"its tables {shown}"
    elif app_id:
        what = f"application_id {app_id:#010x}"
    elif layout is not None and layout.tables:
        what = f"user_version {version}{_difference(layout, version)}"
    else:
        what = f"user_version {version}"
    raise DatabaseUnusable(f"{path} belongs to another application ({what}: not a traceml-processor"
                           f" database of a layout this release knows), so it is left untouched; {_DO_NEW}")


def _difference(layout: Layout | None, version: int) -> str:
    """", <first table that differs from every layout of `version>: its columns>" for a message."""
    if layout is None:
        return ""
    candidates = [known for v, known in known_layouts() if v == version] or [known_layouts()[-1][1]]
    for name in sorted(layout.tables):
        if all(known.tables.get(name) != layout.tables[name] for known in candidates):
            columns = sorted(layout.tables[name])
            shown = ", ".join(columns[:5]) + (", ..." if len(columns) > 5 else "")
            return f"; its {name} has columns {shown}"
    missing = sorted(set(candidates[-1].tables) - set(layout.tables))
    if missing:
        return f"; no {missing[0]} table"
    return "; its indexes differ"


def keep_copy(check: DatabaseCheck) -> Path:
    """Copy an older layout of ours to `<db>.v<version>.bak` beside it (a new name if taken)
    before the writer migrates it; returns the copy's path.

    SQLite's online backup from a read-only connection (so the copy holds what a `-wal`
    left by a killed processor holds), into a temporary name that is synced and then
    renamed: a crash leaves either no copy or a whole one, never the original changed.
    """
    path = check.path
    target = path.with_name(f"{path.name}.v{check.version}.bak")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.v{check.version}.{n}.bak")
        n += 1
    partial = target.with_name(target.name + ".partial")
    try:
        source = _connect_leaving_no_trace(path)
        try:
            copy = sqlite3.connect(partial)
            try:
                source.backup(copy)
                copy.execute("PRAGMA journal_mode = DELETE")  # the copy is one file
            finally:
                copy.close()
        finally:
            source.close()
        with open(partial, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(partial, target)
        _fsync_folder(target.parent)
    except (OSError, sqlite3.Error) as exc:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise DatabaseUnusable(f"{path} is an older traceml-processor database (version {check.version}); its copy"
                               f" {target} could not be written ({exc}), so it was not migrated; free space in"
                               f" {path.parent} or copy it elsewhere first") from None
    return target


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _connect_leaving_no_trace(path: Path) -> sqlite3.Connection:
    """A read-only connection that creates no file beside `path`.

    A plain `mode=ro` connection to a WAL-mode database creates `-wal` and `-shm`
    files and cannot remove them. With no `-wal` or `-journal` present there is
    nothing beyond the main file to read, so it is opened `immutable` (no locks,
    no side files); otherwise someone is using the file and they already exist.
    """
    if any(path.with_name(path.name + side).exists() for side in ("-wal", "-journal")):
        return connect_readonly(path)
    return sqlite3.connect(f"file:{quote(str(path))}?mode=ro&immutable=1", uri=True, isolation_level=None,
                           check_same_thread=False)


def _size_from_header(header: bytes) -> int | None:
    """Bytes the header says the file holds; None where the size field is not valid."""
    page_size = struct.unpack(">H", header[16:18])[0]
    page_size = 65536 if page_size == 1 else page_size
    pages, change, valid_for = struct.unpack(">I", header[28:32])[0], header[24:28], header[92:96]
    if change != valid_for or not pages or page_size < 512:
        return None  # written by a SQLite before 3.7.0: the size is not kept in the header
    return pages * page_size


def _check_writable(path: Path, info: os.stat_result) -> None:
    if not os.access(path, os.W_OK):
        raise DatabaseUnusable(
            f"{path} is read-only for this user (mode {stat.filemode(info.st_mode)}, owner uid {info.st_uid},"
            f" this process uid {os.geteuid()}); make it writable or {_DO_NEW}")
    _check_folder_writable(path)


def _check_folder_writable(path: Path) -> None:
    folder = path.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DatabaseUnusable(f"the folder {folder} is not writable for this user (SQLite keeps its -wal and"
                               f" -shm files beside {path.name}); make it writable or point --db elsewhere")


def integrity_check(path: str | Path, budget_s: float = QUICK_CHECK_BUDGET_S) -> str:
    """`PRAGMA quick_check` within `budget_s`: "ok", or "unfinished" when the budget ran out.

    Raises `DatabaseUnusable` naming the first problem when a page is damaged.
    """
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return "ok"
    deadline = time.monotonic() + budget_s
    conn = _connect_leaving_no_trace(path)
    conn.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
    try:
        rows = [row[0] for row in conn.execute("PRAGMA quick_check(3)")]
    except sqlite3.OperationalError as exc:
        if "interrupt" in str(exc):
            LOG.info("integrity check of %s unfinished after %.1f s (%d MiB); pages not reached are checked"
                     " when read", path, budget_s, path.stat().st_size >> 20)
            return "unfinished"
        raise DatabaseUnusable(f"the integrity check of {path} failed ({exc}); {_DO_RESTORE}") from None
    except sqlite3.DatabaseError as exc:
        raise DatabaseUnusable(f"{path} is damaged ({exc}); {_DO_RESTORE}") from None
    finally:
        conn.close()
    if rows != ["ok"]:
        first = " ".join(rows[0].split())
        raise DatabaseUnusable(f"{path} is damaged (quick_check: {first}); {_DO_RESTORE}")
    return "ok"


class WriterLock:
    """One processor per database: an exclusive `flock` on `<db>-processor.lock`.

    The file stays after release: unlinking it would let a third process lock a
    new file while a second still waits on the old one. The holder's pid is
    written into it so a refused start can name who holds it.
    """

    def __init__(self, db_path: str | Path):
        self.db_path = Path(db_path)
        self.path = lock_path(db_path)
        self._fd: int | None = None

    def acquire(self) -> "WriterLock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise DatabaseUnusable(f"cannot create the lock file {self.path}: {exc.strerror};"
                                   f" make {self.path.parent} writable or point --db elsewhere") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise DatabaseUnusable(
                f"another traceml-processor (pid {holder}) is using {self.db_path}; two must never share a"
                " database: stop that one first, or give this one its own --db") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock


# --- damage met while serving ---------------------------------------------------------------

_faults: dict[Path, str] = {}
_faults_lock = threading.Lock()


def is_corruption(exc: BaseException) -> bool:
    """SQLITE_CORRUPT / SQLITE_NOTADB (any extended code), as SQLite reports a damaged file."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    text = str(exc)
    return "malformed" in text or "not a database" in text


def note_database_error(path: str | Path, exc: BaseException) -> bool:
    """Record `exc` against `path` when it says the file is damaged (logged once); True if so."""
    if not is_corruption(exc):
        return False
    key = Path(path).resolve()
    with _faults_lock:
        first = key not in _faults
        if first:
            _faults[key] = f"{type(exc).__name__}: {exc}"
    if first:
        LOG.error("database %s is damaged (%s): no longer ready; stop the processor, then %s",
                  path, exc, _DO_RESTORE)
    return True


def database_fault(path: str | Path) -> str | None:
    """The damage noted against `path` in this process, if any (what `/readyz` reports)."""
    with _faults_lock:
        return _faults.get(Path(path).resolve())


__all__ = [
    "DatabaseCheck", "DatabaseUnusable", "LOCK_SUFFIX", "Layout", "QUICK_CHECK_BUDGET_S", "WriterLock",
    "check_database", "database_fault", "integrity_check", "is_corruption", "keep_copy", "known_layouts",
    "lock_path", "note_database_error",
]
