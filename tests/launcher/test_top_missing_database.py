"""`traceml top --once` on a database that does not exist says so at once (it waited 30 s in silence).

The live view still waits for a database a processor is about to create (`--wait`, default 30),
and `--once --wait S` waits when asked to.
"""
from __future__ import annotations

import io
import threading
import time

import pytest

from tests.launcher.launcher_helpers import traceml
from traceml.launcher import top


def test_once_on_a_missing_database_answers_at_once(tmp_path):
    started = time.monotonic()
    run = traceml(["top", "--once", "--db", str(tmp_path / "missing.db")], tmp_path, timeout=60)
    assert run.returncode == 2 and "missing.db does not exist" in run.output, run.output
    assert time.monotonic() - started < 20  # the interpreter's start under load; the old wait alone was 30 s


@pytest.mark.slow
def test_once_waits_when_asked(tmp_path, capsys):
    db = tmp_path / "late.db"
    started = time.monotonic()
    threading.Timer(0.6, db.write_bytes, args=(b"",)).start()  # appears after 0.6 s: found, then no run data
    assert top.main(["--once", "--wait", "5", "--db", str(db)], out=io.StringIO()) == 1
    assert 0.5 < time.monotonic() - started < 5
    assert top.main(["--once", "--wait", "0.2", "--db", str(tmp_path / "never.db")], out=io.StringIO()) == 2
    assert "never.db does not exist" in capsys.readouterr().err
