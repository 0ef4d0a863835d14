"""The one-file HTML reports: a run's summary window, and a comparison of two summaries.

Orchestration only: the run report runs `StepTimePipeline` once with the summary
profile (the final summary's own window), reads the run facts the final summary
reads (its deep captures included, as the store's processor left them) plus the
per-step memory of the drawn ranks, and hands them to the same view model and
fragments the live page draws. The comparison report draws what
`traceml compare` decided (`Comparison.to_json()`): which changes are material is
never re-decided here.
"""
from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Mapping

from traceml.processor.sqlite_layout import connect_readonly
from traceml.processor.store_read import read_run_facts, read_step_memory
from traceml.processor.web.pages import compare_page, report_page
from traceml.processor.web.view import (
    LAST_STEPS,
    StepMemory,
    ViewInputs,
    build_compare_view,
    build_run_view,
    drawn_ranks,
)

REPORT_FILENAME = "report.html"
COMPARE_FILENAME = "compare.html"
FRESHNESS_FINAL = "final"
"""The report's freshness line: a summary of stored data, not a live read."""


def build_report_view(db_path: str | os.PathLike, run_id: str, *, generated_at: float | None = None) -> dict:
    """The view model of a run's summary window (what `report.html` draws and embeds)."""
    from traceml.processor.step_time.model import SUMMARY_WINDOW_STEPS
    from traceml.processor.step_time.pipeline import PROFILE_SUMMARY, StepTimePipeline, StepTimeRequest

    db_path = Path(db_path)
    analysis = StepTimePipeline().run(StepTimeRequest(db_path, run_id, profile=PROFILE_SUMMARY))
    memory, telemetry = read_run_facts(db_path, run_id, latest_memory=False)
    step_memory = StepMemory()
    window = analysis.window
    if window.steps:
        tail = window.steps[-LAST_STEPS:]
        conn = connect_readonly(db_path)
        try:
            step_memory = StepMemory(read_step_memory(conn, run_id, drawn_ranks(analysis), tail[0], tail[-1]))
        except sqlite3.OperationalError:
            pass
        finally:
            conn.close()
    from traceml.processor.capture.book import stored_captures  # the book's owner reads them back

    return build_run_view(analysis, ViewInputs(
        freshness=FRESHNESS_FINAL, profile=PROFILE_SUMMARY, max_steps=SUMMARY_WINDOW_STEPS,
        generated_at=time.time() if generated_at is None else generated_at,
        memory=memory, telemetry=telemetry, step_memory=step_memory,
        captures=tuple(stored_captures(db_path, run_id, window))))


def _write(path: Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_run_report(db_path: str | os.PathLike, run_id: str, path: str | os.PathLike) -> Path:
    """Write the run's self-contained HTML report to `path` (atomically); returns the path."""
    return _write(Path(path), report_page(build_report_view(db_path, run_id)))


def write_compare_report(comparison: Mapping, a: Mapping, b: Mapping, path: str | os.PathLike) -> Path:
    """Write `traceml compare`'s HTML report: `comparison` is `Comparison.to_json()`, `a`/`b` the summaries."""
    return _write(Path(path), compare_page(build_compare_view(comparison, a, b)))


__all__ = ["COMPARE_FILENAME", "REPORT_FILENAME", "build_report_view", "write_compare_report",
           "write_run_report"]
