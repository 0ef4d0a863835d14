"""The pure Rich live presenter and the plain line formatter."""
from __future__ import annotations

from rich.console import Console

from tests.step_time.handbuilt_windows import rank_values, window
from harness.child_python import python_output
from traceml.processor.diagnosis import diagnose
from traceml.processor.presenters import format_live_line, issue_rows, render_live
from traceml.processor.step_time.model import LiveStepTimeResult, StepTimeAnalysis


def result_of(w, freshness="live", age=0.5, error=None):
    return LiveStepTimeResult(StepTimeAnalysis(window=w, diagnosis=diagnose(w)), freshness, age, error)


def text_of(renderable, width=160):
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def straggler_window():
    return window({
        0: rank_values(iw=100.0, h2d=0.0, fwd=20.0, bwd=20.0, opt=0.0, traced=40.0),
        1: rank_values(iw=0.0, h2d=0.0, fwd=20.0, bwd=120.0, opt=0.0, traced=140.0),
    }, steps=24)


def test_render_shows_issues_in_order_metrics_and_freshness():
    text = text_of(render_live(result_of(straggler_window()), steps_per_s=2.5, samples_per_s=80.0))
    assert "1. INPUT_STRAGGLER [crit, confirmed] score 0.714 rank 0" in text
    assert "INPUT_BOUND" not in text  # what the straggler explains is not the job's input problem
    assert "120.0 (r1)" in text  # backward worst and its rank
    assert "+71%" in text  # backward skew against the 70 ms median
    assert "freshness: live, 0.5s old" in text
    assert "2.50 steps/s | 80.0 samples/s" in text


def test_rows_are_what_the_view_draws():
    rows = issue_rows(result_of(straggler_window()))
    assert [(r.position, r.kind, r.severity, r.rank) for r in rows] == [
        (1, "INPUT_STRAGGLER", "crit", "rank 0")]


def test_cold_and_bridged_results_render():
    cold = text_of(render_live(result_of(window({}, steps=0, clock=None), "cold", None)))
    assert "WARMUP" in cold and "freshness: cold" in cold and "—" in cold
    bridged = text_of(render_live(result_of(straggler_window(), "bridged", 12.0, "database is locked")))
    assert "freshness: bridged, 12.0s old (database is locked)" in bridged


def test_plain_line():
    line = format_live_line(result_of(straggler_window()), steps_per_s=1.0)
    assert line == ("[live] run run-test | 24 steps | clock gpu | INPUT_STRAGGLER crit 0.714 rank 0 "
                    "| step 140.0 ms (worst 140.0 (r0)) | 1.00 steps/s")


def test_importing_presenters_loads_no_sqlite_pipeline_or_diagnosis():
    code = ("import sys, traceml.processor.presenters\n"
            "bad = [m for m in ('sqlite3', 'traceml.processor.diagnosis', 'traceml.processor.step_time.pipeline',"
            " 'traceml.processor.step_time.sqlite_reader') if m in sys.modules]\n"
            "print(bad)")
    assert python_output(code) == "[]"
