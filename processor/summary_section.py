"""The run facts beside the analysis, read from the store, and the final summary of a run.

Reporting is pure (it never reads SQLite), so this module is the orchestrator the
contract calls the summary section: it runs `StepTimePipeline` once with the
summary profile, reads memory peaks and telemetry health of the run, and hands
everything to the reporting projector and writer. The live re-export uses the
same readers with `latest=True` memory. The run's coverage (its lowest stored
step, so a run first seen part-way is flagged) is one of these facts: the
analysis reads only the latest window of steps and cannot know it.
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from traceml.processor.endings import LauncherEnding
from traceml.processor.reporting.inputs import (
    AttemptSteps,
    RankMemory,
    RankTelemetry,
    RunMetadata,
    RunTelemetry,
)
from traceml.processor.sqlite_layout import connect_readonly
from traceml.schema import vocabulary as v
from traceml.schema.distribution import package_version


def read_rank_memory(conn: sqlite3.Connection, run_id: str, *, latest: bool) -> list[RankMemory]:
    """Per rank: the latest step's peaks (`latest=True`, live metric) or the run's maxima (summary)."""
    if latest:
        rows = conn.execute(
            "SELECT m.global_rank, m.device, m.peak_allocated_bytes, m.peak_reserved_bytes"
            " FROM step_memory_samples AS m"
            " JOIN (SELECT global_rank, max(step) AS step FROM step_memory_samples"
            "       WHERE run_id = ? GROUP BY global_rank) AS last"
            "   ON m.global_rank = last.global_rank AND m.step = last.step"
            " WHERE m.run_id = ? ORDER BY m.global_rank, m.device", (run_id, run_id)).fetchall()
    else:
        rows = conn.execute(
            "SELECT global_rank, min(device), max(peak_allocated_bytes), max(peak_reserved_bytes)"
            " FROM step_memory_samples WHERE run_id = ? GROUP BY global_rank ORDER BY global_rank",
            (run_id,)).fetchall()
    by_rank: dict[int, RankMemory] = {}
    for rank, device, allocated, reserved in rows:
        by_rank.setdefault(rank, RankMemory(rank, device, allocated, reserved))
    return list(by_rank.values())


def read_rank_telemetry(conn: sqlite3.Connection, run_id: str, *, count_stored: bool = True
                        ) -> list[RankTelemetry]:
    """Per known rank: did it send its end marker, what did it report dropped and lost, what is stored.

    `count_stored=False` skips counting the stored steps (a scan of the run's step
    rows), which only the final summary reads; `steps_stored` is then left at 0.
    """
    finished: dict[int, bool] = {}
    final: dict[int, dict] = {}
    said: dict[int, tuple] = {}  # rank -> (outcome, exit code, node rank)
    # `outcome` / `exit_code` came with schema version 2: an older file read as is has neither.
    columns = {row[1] for row in conn.execute("PRAGMA table_info(step_time_ranks)")}
    ending = "outcome, exit_code" if "exit_code" in columns else "NULL, NULL"
    for rank, finished_time, counts, outcome, exit_code, node_rank in conn.execute(
            f"SELECT global_rank, finished_time, final_counts, {ending}, node_rank FROM step_time_ranks"
            " WHERE run_id = ?", (run_id,)):
        finished[rank] = finished_time is not None
        said[rank] = (outcome, exit_code, node_rank)
        if finished_time is not None:
            try:
                final[rank] = json.loads(counts or "{}")
            except ValueError:
                final[rank] = {}
    drops: dict[int, dict[str, int]] = {}
    for rank, queue, dropped in conn.execute(
            "SELECT global_rank, queue, dropped FROM step_time_drops WHERE run_id = ?", (run_id,)):
        drops.setdefault(rank, {})[queue] = int(dropped)
    stored = dict(conn.execute(  # (run_id, global_rank, step) is UNIQUE: a row is a step
        "SELECT global_rank, COUNT(*) FROM step_time_samples WHERE run_id = ? GROUP BY global_rank",
        (run_id,)).fetchall()) if count_stored else {}
    ranks = sorted(set(finished) | set(drops))
    return [RankTelemetry(rank, finished.get(rank, False), drops.get(rank, {}),
                          export_failures=_count(final.get(rank), v.ATTR_RUN_END_EXPORT_FAILURES),
                          steps_completed=_count(final.get(rank), v.ATTR_STEPS_COMPLETED),
                          steps_stored=int(stored.get(rank, 0)),
                          outcome=said.get(rank, (None,))[0], exit_code=said.get(rank, (None, None))[1],
                          node_rank=said.get(rank, (None, None, None))[2],
                          step_boundary=_word(final.get(rank), v.ATTR_STEP_BOUNDARY, v.STEP_BOUNDARIES))
            for rank in ranks]


def read_attempts(conn: sqlite3.Connection, run_id: str) -> tuple[int | None, list[AttemptSteps]]:
    """The run's current attempt (the one its window analyses) and the steps stored per rank of
    every attempt, earlier ones from the attempt tables (schema 2; an older file: attempt 0 only)."""
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    per: dict[int, dict[int, int]] = {}
    current = None
    if "step_time_attempt_samples" in tables:
        row = conn.execute("SELECT attempt FROM step_time_runs WHERE run_id = ?", (run_id,)).fetchone()
        current = None if row is None else int(row[0])
        for attempt, rank, count in conn.execute(
                "SELECT attempt, global_rank, COUNT(*) FROM step_time_attempt_samples WHERE run_id = ?"
                " GROUP BY attempt, global_rank", (run_id,)):
            per.setdefault(int(attempt), {})[int(rank)] = int(count)
    for rank, count in conn.execute(
            "SELECT global_rank, COUNT(*) FROM step_time_samples WHERE run_id = ? GROUP BY global_rank", (run_id,)):
        per.setdefault(current or 0, {})[int(rank)] = int(count)
    if current is None and per:
        current = 0
    return current, [AttemptSteps(a, dict(sorted(ranks.items()))) for a, ranks in sorted(per.items())]


def read_first_step_stored(conn: sqlite3.Connection, run_id: str) -> int | None:
    """The lowest step stored for any rank of the run (one index seek on (run_id, step)); None: no step."""
    row = conn.execute("SELECT MIN(step) FROM step_time_samples WHERE run_id = ?", (run_id,)).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def _word(counts: dict | None, key: str, allowed: tuple[str, ...]) -> str | None:
    """A word from a rank's end marker (kept with its counts); None when absent or not allowed."""
    value = None if counts is None else counts.get(key)
    return value if isinstance(value, str) and value in allowed else None


def _count(counts: dict | None, key: str) -> int | None:
    """A final count from a rank's end marker; None when the marker or the count is absent."""
    value = None if counts is None else counts.get(key)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def read_run_facts(db_path: Path, run_id: str, *, latest_memory: bool,
                   count_stored: bool = True) -> tuple[list[RankMemory], RunTelemetry]:
    """The readers in one short read-only connection; nothing known before the tables exist."""
    if not Path(db_path).exists():
        return [], RunTelemetry()
    conn = connect_readonly(db_path)
    try:
        attempt, attempts = read_attempts(conn, run_id) if count_stored else (None, [])
        return (read_rank_memory(conn, run_id, latest=latest_memory),
                RunTelemetry(ranks=read_rank_telemetry(conn, run_id, count_stored=count_stored),
                             first_step_stored=read_first_step_stored(conn, run_id),
                             attempt=attempt, attempts=attempts))
    except sqlite3.OperationalError:
        return [], RunTelemetry()
    finally:
        conn.close()



def build_final_summary(db_path: Path, run_id: str, *, generated_at: float | None = None,
                        launcher: LauncherEnding | None = None) -> dict:
    """The public final-summary object of one run, from the complete database.

    `launcher`: the exit codes `traceml run` saw (how each rank ended joins them with
    the end markers). A run with no stored step gets NO_STEPS, saying why, instead of
    the window's WARMUP gate."""
    from traceml.processor.reporting.final_summary import project_final_summary
    from traceml.processor.step_time.model import SUMMARY_WINDOW_STEPS
    from traceml.processor.step_time.pipeline import PROFILE_SUMMARY, StepTimePipeline, StepTimeRequest

    analysis = StepTimePipeline().run(StepTimeRequest(db_path, run_id, profile=PROFILE_SUMMARY))
    memory, telemetry = read_run_facts(db_path, run_id, latest_memory=False)
    if launcher is not None:
        telemetry = replace(telemetry, launcher=launcher)
    if telemetry.first_step_stored is None:
        from traceml.processor.diagnosis.no_steps import no_steps_issue, with_no_steps

        issue = no_steps_issue(telemetry.rank_endings(analysis.window.expected_ranks),
                               {t.global_rank: t.steps_completed for t in telemetry.ranks},
                               {t.global_rank: t.export_failures for t in telemetry.ranks},
                               {t.global_rank: t.step_boundary for t in telemetry.ranks})
        analysis = with_no_steps(analysis, issue)
    metadata = RunMetadata(run_id=run_id, generated_at=time.time() if generated_at is None else generated_at,
                           traceml_version=package_version(), profile=PROFILE_SUMMARY,
                           max_steps=analysis.window.max_steps or SUMMARY_WINDOW_STEPS)  # cut beyond the cell cap
    return project_final_summary(analysis, metadata, memory=memory, telemetry=telemetry)


def write_final_summary(db_path: Path, run_id: str, folder: Path, *,
                        launcher: LauncherEnding | None = None) -> tuple[Path, Path]:
    """Build the run's final summary from the store and write `final_summary.json` + the text card
    into `folder` (atomic writes, by `reporting.write_summary_files`)."""
    from traceml.processor.reporting.final_summary import write_summary_files

    return write_summary_files(folder, build_final_summary(Path(db_path), run_id, launcher=launcher))


def live_points(result, db_path: Path, *, top_k: int | None = None) -> Sequence:
    """Summary metric points of one live refresh (latest memory peaks, reported drops);
    `top_k`: ranks exported by score beyond the ones that always are (None: the default)."""
    from traceml.processor.reporting.summary_metrics import DEFAULT_RANK_SERIES_TOP_K, summary_metric_points

    # The live metrics read drops, not stored-step counts: no scan of the run's rows per refresh.
    memory, telemetry = read_run_facts(db_path, result.analysis.window.run_id, latest_memory=True,
                                       count_stored=False)
    return summary_metric_points(result.analysis, freshness=result.freshness, memory=memory,
                                 telemetry=telemetry.ranks, first_step_stored=telemetry.first_step_stored,
                                 top_k=DEFAULT_RANK_SERIES_TOP_K if top_k is None else top_k)
