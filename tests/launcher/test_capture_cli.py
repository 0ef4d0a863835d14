"""`traceml capture`'s own parts without a processor (the command against real replicas is
tests/processor/test_capture_routes.py; against a live run, tests/launcher/test_capture_runs.py)."""
from __future__ import annotations

import io

from traceml.launcher import capture

HOSTILE = "[bold red]aten::evil\x1b[2J\u202e"
RECORD = {"capture_id": "c1-ab", "run_id": "run\x07", "culprit_rank": 1, "reference_rank": 0, "steps": 5,
          "trigger": "COMPUTE_STRAGGLER", "status": "done", "reason": None, "traces": ["r.c1-ab.rank1.pt.trace.json.gz"],
          "digest": {"culprit_step_ms": 50.0, "reference_step_ms": 30.0, "gap_ms": 20.0, "not_seen": ["a note"],
                     "rows": [{"name": HOSTILE, "kind": "op", "culprit_ms": 20.0, "reference_ms": 0.0,
                               "excess_ms": 20.0, "share_of_gap": 1.0},
                              {"name": "aten::mm", "kind": "op", "culprit_ms": 1.0, "reference_ms": None,
                               "excess_ms": None, "share_of_gap": None}]}}


def test_the_digest_prints_wire_strings_as_text_never_as_markup_or_terminal_control():
    out = io.StringIO()
    capture.render(RECORD, out, width=200)
    text = out.getvalue()
    assert "[bold red]aten::evil\\x1b[2J\\u202e" in text and "\x1b" not in text and "\u202e" not in text
    assert "run\\x07" in text and "+20.000" in text and "100%" in text
    mm = next(line for line in text.splitlines() if "aten::mm" in line)
    assert "?" in mm  # a time the reference left out is unknown, not zero
    assert "not seen: a note" in text and "trace: r.c1-ab.rank1.pt.trace.json.gz" in text


def test_processor_urls_come_from_the_flags_else_the_ranks_control_endpoint_each_once():
    env = {"TRACEML_CONTROL_ENDPOINT": "http://a:4318/, http://b:4318,http://a:4318"}
    assert capture.processor_urls(None, env) == ["http://a:4318", "http://b:4318"]
    assert capture.processor_urls(["http://c:1"], env) == ["http://c:1"]
    assert capture.processor_urls(None, {}) == []


def test_no_processor_url_is_refused_saying_how_to_give_one(capsys):
    assert capture.main(["--run", "r", "--rank", "1"], environ={}) == 2
    assert "TRACEML_CONTROL_ENDPOINT" in capsys.readouterr().err
