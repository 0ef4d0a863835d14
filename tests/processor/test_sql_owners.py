"""One owner per database access (issue 29): SQL runs only in the modules that own the store.

The layout (`sqlite_layout`) names the tables, the writer (`sqlite_writer`) fills
them, the two analysis readers read their windows, `store_read` answers every
other question, and `sqlite_guard` looks at a file's catalog before anything
writes to it. Anywhere else in the processor or the launcher, a query (an
`execute` call, a SQL statement in a string, or a connection of its own) fails
here, naming the file and line, so a column change stays a change of those modules.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("processor", "launcher")
SQL_OWNERS = frozenset({
    "processor/sqlite_layout.py",  # DDL, table names, the read-only connection
    "processor/sqlite_writer.py",  # the one writer
    "processor/step_time/sqlite_reader.py",  # the step-time analysis window
    "processor/resources/reader.py",  # the resource analysis samples
    "processor/store_read.py",  # every other read, by name
    "processor/sqlite_guard.py",  # the file's header, catalog, user_version and quick_check before writing
})

_EXECUTE = frozenset({"execute", "executemany", "executescript"})
_STATEMENT = re.compile(
    r"\bSELECT\b[\s\S]*?\bFROM\b"
    r"|\bINSERT\s+(?:OR\s+[A-Z]+\s+)?INTO\b"
    r"|\bUPDATE\s+\S+\s+SET\b"
    r"|\bDELETE\s+FROM\b"
    r"|\b(?:CREATE|DROP)\s+(?:TABLE|INDEX|VIEW|TRIGGER)\b"
    r"|\bALTER\s+TABLE\b"
    r"|\bPRAGMA\s+\w+")
"""A SQL statement as code writes one (keywords upper case, with their clause): prose that says
"select" or "from" in lower case, or names a table, is not one."""


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings or bare string statements (attribute docs)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)}


def _string_text(node: ast.AST) -> str | None:
    """A string literal's text; an f-string's literal parts with `{}` where values go."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
    return None


def sql_sites(source: str, filename: str = "<source>") -> list[str]:
    """Every place `source` runs SQL: `x.execute*(...)`, `sqlite3.connect(...)`, or a SQL statement
    in a string (docstrings excepted); one "line: what" each."""
    tree = ast.parse(source, filename)
    docs = _docstrings(tree)
    inside_fstring = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if name in _EXECUTE:
                found.append(f"{node.lineno}: .{name}(...)")
            elif name == "connect" and isinstance(node.func.value, ast.Name) and node.func.value.id == "sqlite3":
                found.append(f"{node.lineno}: sqlite3.connect(...)")
        if id(node) in docs or id(node) in inside_fstring:
            continue
        text = _string_text(node)
        if text is not None:
            match = _STATEMENT.search(text)
            if match:
                found.append(f"{node.lineno}: {' '.join(match.group(0).split())[:40]!r}")
    return found


def _modules() -> list[Path]:
    return sorted(path for folder in SCANNED for path in (ROOT / folder).rglob("*.py"))


@pytest.mark.slow
def test_only_the_store_owners_run_sql():
    outside = {}
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        if rel in SQL_OWNERS:
            continue
        sites = sql_sites(path.read_text(encoding="utf-8"), rel)
        if sites:
            outside[rel] = sites
    assert outside == {}, ("SQL outside the store's owners; ask `processor/store_read.py` "
                           f"(add a named function there) instead: {outside}")


def test_every_owner_still_runs_sql():
    """The allowed list stays tight: an owner that no longer queries leaves it."""
    idle = [rel for rel in sorted(SQL_OWNERS) if not sql_sites((ROOT / rel).read_text(encoding="utf-8"), rel)]
    assert idle == []
    assert len(_modules()) > 50  # the scan sees the trees, not an empty folder


def test_the_detector_finds_each_kind_of_query_and_passes_prose():
    code = '''
import sqlite3
"""Module prose may say SELECT run_id FROM step_time_runs in a docstring."""
conn = sqlite3.connect("x.db")
conn.execute("select 1")
rows = list(cursor.executemany(statement, values))
QUERY = "SELECT run_id, step" " FROM step_time_samples WHERE run_id = ?"
table = "step_time_runs"
QUERY2 = f"UPDATE {table} SET latest_step = ?"
QUERY3 = """
    INSERT OR IGNORE INTO step_time_drops (run_id) VALUES (?)
"""
note = "select the run from the list, then update the view"
LOG_LINE = "PRAGMA quick_check found nothing"
def f():
    """Reads `PRAGMA user_version` and DELETE FROM nothing: prose."""
'''
    sites = sql_sites(code)
    kinds = [site.split(": ", 1)[1] for site in sites]
    assert "sqlite3.connect(...)" in kinds
    assert ".execute(...)" in kinds and ".executemany(...)" in kinds
    assert any("SELECT run_id, step FROM" in k for k in kinds)  # implicit concatenation is one string
    assert any("UPDATE {} SET" in k for k in kinds)  # f-string
    assert any("INSERT OR IGNORE INTO" in k for k in kinds)
    assert any("PRAGMA quick_check" in k for k in kinds)  # a string a program would send
    assert len(sites) == 7, sites  # docstrings, lower-case prose and a bare table name are not SQL


DECODER_MODULES = ("traceml.processor.decode", "traceml.processor.decode_spans",
                   "traceml.processor.decode_metrics", "traceml.processor.decode_logs",
                   "traceml.processor.decode_attributes")
DECODER_IMPORTERS = frozenset({
    "processor/decode.py", "processor/decode_spans.py", "processor/decode_metrics.py",
    "processor/decode_attributes.py", "processor/decode_logs.py",
    "processor/mapping/traceml_logs.py",  # the original TraceML's log records: read as the decoders read
    "processor/mapping/record.py", "processor/mapping/spans.py",  # foreign steps, judged by the decoders' rules
    "processor/admission.py",  # refuses with the decoders' `Reject`
    "processor/otlp_intake.py", "processor/workers.py", "processor/service.py",  # the ingest path
    "processor/cli.py",  # `DecodeLimits` from the flags
})


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.slow
def test_only_the_ingest_path_loads_the_decoders():
    """Intake-to-store records and refusal reasons are `store_records`': the writer, the run
    monitor and every reader take them from there, never from a decoder."""
    loaders = sorted(path.relative_to(ROOT).as_posix() for path in _modules()
                     if _imports(path) & set(DECODER_MODULES))
    assert set(loaders) <= DECODER_IMPORTERS, sorted(set(loaders) - DECODER_IMPORTERS)
