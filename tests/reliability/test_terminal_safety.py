"""Issue 18 item 9: strings from the wire reach no terminal raw.

A run whose run id, strategy and host name carry an OSC title/clipboard sequence, a
clear-screen CSI, a C1 CSI byte, a bidi override and Rich markup is stored as the
processor stores it; every surface that prints it (the real `traceml summary`, its
`--list`, `traceml top --once`, `traceml compare`, the summary card file, the live
view's Rich frame and the end-of-run card) must emit no control byte and show the
text literally. `final_summary.json` keeps the true strings.
"""
from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from harness.resource_rows import rank_resource_records
from tests.step_time.scenarios import START_TIME, STEP_SECONDS, scenario_records
from traceml.processor.presenters.terminal_text import printable
from traceml.processor.sqlite_writer import StepTimeStore

MARKUP = "[bold red]x[/]"
RUN_ID = "run\x1b]0;pwned\x07\x1b[2J\x9b31m" + MARKUP + "\u202egnp"
STRATEGY = "ddp\x1b[2J[bold]s[/]"
HOST = "node\x1b]52;c;AAAA\x07\x9b1;1H"

# Any C0 control but newline (tab only where a surface uses it as its own separator),
# DEL, C1, and the bidi controls.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def assert_safe(text: str, *, tabs: bool = False) -> None:
    found = sorted({hex(ord(c)) for c in _CONTROL.findall(text)} | (set() if tabs else {"\\t"} & set(text)))
    assert not found, f"control characters reached the output: {found}\n{text!r}"


def assert_shows_run_id(text: str) -> None:
    """The run id is visible as typed: its escapes spelled out, its markup unconsumed."""
    assert printable(RUN_ID) in text.replace("\n", ""), text
    assert MARKUP in text


@pytest.fixture(scope="module")
def hostile_db(tmp_path_factory) -> Path:
    db = tmp_path_factory.mktemp("hostile") / "traceml.sqlite"
    records = [replace(r, run_id=RUN_ID, training_strategy=STRATEGY,
                       identity=replace(r.identity, hostname=HOST))
               for r in scenario_records("ddp_rank_straggler")]
    # Resource samples on that host too: the card's and the live view's resource lines name it.
    times = [START_TIME + step * STEP_SECONDS + 0.05 for step in range(1, 25)]
    resources = [*rank_resource_records(RUN_ID, 0, times, host=HOST, host_cpu=0.9),
                 *rank_resource_records(RUN_ID, 1, times, host=HOST)]
    with StepTimeStore(db) as store:
        store.write(records, resource_records=resources, receive_time=START_TIME + 3600.0)
    return db


def traceml(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "traceml.launcher.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={"COLUMNS": "400", "PATH": "/usr/bin:/bin"})


def test_printable_spells_out_every_control_and_keeps_text():
    assert printable("plain run-1 é 日本") == "plain run-1 é 日本"
    assert printable("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert printable("\x9b\x7f\u202e\ud800") == "\\x9b\\x7f\\u202e\\ud800"
    assert printable("l1\nl2\r\t", keep_newlines=True) == "l1\nl2\\x0d\\x09"
    assert_safe(printable("".join(map(chr, range(0x00, 0xA0))) + "\u2028\u2029\u2066"))


def test_live_view_frame_and_line(hostile_db, monkeypatch):
    from traceml.launcher.live import LiveMonitor

    monkeypatch.setenv("COLUMNS", "400")
    for tty in (True, False):
        out = io.StringIO()
        monitor = LiveMonitor(hostile_db, RUN_ID, out=out, tty=tty)  # the title holds the run id too
        assert monitor.refresh_once() is not None
        text = out.getvalue()
        assert_safe(text)
        assert_shows_run_id(text)
        if tty:  # the Panel title is not parsed as markup either; the host CPU line names the host, escaped
            assert text.count(MARKUP) >= 2, text
            assert printable(HOST) in text.replace("\n", ""), text


def test_end_of_run_card_and_card_file(hostile_db, tmp_path):
    from traceml.launcher.finalize import finalize_run

    run_path = tmp_path / "run"
    run_path.mkdir()
    (run_path / "traceml.sqlite").write_bytes(hostile_db.read_bytes())
    out = io.StringIO()
    report = finalize_run(run_path, RUN_ID, out=out)
    assert report is not None
    assert_safe(out.getvalue())
    assert_shows_run_id(out.getvalue())
    assert_safe(report.card_path.read_text())
    assert f"host CPU median 90% ({printable(HOST)})" in report.card_path.read_text()
    assert report.summary["metadata"]["run_id"] == RUN_ID  # the JSON keeps the true string
    assert json.loads(report.summary_path.read_text())["metadata"]["run_id"] == RUN_ID


@pytest.mark.slow
def test_real_cli_surfaces(hostile_db, tmp_path):
    listed = traceml("summary", str(hostile_db), "--list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert_safe(listed.stdout, tabs=True)
    assert_shows_run_id(listed.stdout)

    card = traceml("summary", str(hostile_db), "--out", str(tmp_path / "a"), cwd=tmp_path)
    assert card.returncode == 0, card.stderr
    assert_safe(card.stdout)
    assert_shows_run_id(card.stdout)
    assert printable(STRATEGY.lower()) in card.stdout

    missing = traceml("summary", str(hostile_db), "--run", "nope", cwd=tmp_path)  # the error lists run ids
    assert missing.returncode == 2
    assert_safe(missing.stderr)

    top = traceml("top", "--db", str(hostile_db), "--once", cwd=tmp_path)
    assert top.returncode == 0, top.stderr
    assert_safe(top.stdout)
    assert_shows_run_id(top.stdout)

    summary = tmp_path / "a" / "final_summary.json"
    compared = traceml("compare", str(summary), str(summary), cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr
    assert_safe(compared.stdout)
    assert_shows_run_id(compared.stdout)
