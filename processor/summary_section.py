"""The final summary of a run, and its live summary metrics: the analysis plus the run facts.

Reporting is pure (it never reads SQLite), so this module is the orchestrator the
contract calls the summary section: it runs `StepTimePipeline` once with the
summary profile, reads memory peaks and telemetry health of the run
(`store_read.read_run_facts`), and hands everything to the reporting projector and
writer. The live re-export uses the same readers with `latest=True` memory. The
run's coverage (its lowest stored step, so a run first seen part-way is flagged)
is one of these facts: the analysis reads only the latest window of steps and
cannot know it.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from traceml.processor.endings import LauncherEnding
from traceml.processor.fleet import confirmed_culprits, repeat_offence, with_repeat_offences
from traceml.processor.settings import REPEAT_OFFENDER_RUNS, REPEAT_OFFENDER_WINDOW
from traceml.processor.reporting.inputs import RunMetadata
from traceml.processor.store_read import read_run_facts
from traceml.schema.distribution import package_version

REPEAT_OFFENDER_DEFAULTS = (REPEAT_OFFENDER_RUNS.default, REPEAT_OFFENDER_WINDOW.default)
"""(K, N) of the repeat-offender rule when no processor setting says otherwise (`traceml summary`)."""


def build_final_summary(db_path: Path, run_id: str, *, generated_at: float | None = None,
                        launcher: LauncherEnding | None = None,
                        repeat_offenders: tuple[int, int] | None = REPEAT_OFFENDER_DEFAULTS) -> dict:
    """The public final-summary object of one run, from the complete database.

    `launcher`: the exit codes `traceml run` saw (how each rank ended joins them with
    the end markers). A run with no stored step gets NO_STEPS, saying why, instead of
    the window's WARMUP gate. `repeat_offenders`: (K, N) of the repeat-offender rule
    (`fleet`), judged against the culprits the store recorded for other runs; None: not judged."""
    return summarise(db_path, run_id, generated_at=generated_at, launcher=launcher,
                     repeat_offenders=repeat_offenders)[0]


def summarise(db_path: Path, run_id: str, *, generated_at: float | None = None,
              launcher: LauncherEnding | None = None,
              repeat_offenders: tuple[int, int] | None = REPEAT_OFFENDER_DEFAULTS) -> tuple[dict, tuple]:
    """`build_final_summary`, and the run's confirmed culprits (`fleet.CulpritRecord`s) for the
    processor to record at the run's end."""
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
    generated_at = time.time() if generated_at is None else generated_at
    from traceml.processor.diagnosis.ledger import run_ledger_from  # the ledger's owner: lost time

    culprits = confirmed_culprits(analysis, run_ledger_from(analysis, telemetry), generated_at)
    if repeat_offenders is not None and culprits:
        analysis = with_repeat_offences(analysis, _offences(Path(db_path), culprits, *repeat_offenders))
    metadata = RunMetadata(run_id=run_id, generated_at=generated_at,
                           traceml_version=package_version(), profile=PROFILE_SUMMARY,
                           max_steps=analysis.window.max_steps or SUMMARY_WINDOW_STEPS)  # cut beyond the cell cap
    from traceml.processor.capture.book import stored_captures  # deep captures kept beside the store

    captures = stored_captures(db_path, run_id, analysis.window)
    return project_final_summary(analysis, metadata, memory=memory, telemetry=telemetry,
                                 captures=captures), culprits


def _offences(db_path: Path, culprits, k: int, n: int) -> list:
    """The repeat offences among `culprits`, from the other runs the store recorded on their hosts
    (a store of a layout before the culprits table has no history: none)."""
    import sqlite3

    from traceml.processor.sqlite_layout import connect_readonly
    from traceml.processor.store_read import read_host_runs

    offences = []
    conn = connect_readonly(db_path)
    try:
        for culprit in culprits:
            history = read_host_runs(conn, culprit.host, before_run=culprit.run_id, limit=n - 1)
            offence = repeat_offence(culprit, history, k=k, n=n)
            if offence is not None:
                offences.append(offence)
    except sqlite3.OperationalError:
        return []
    finally:
        conn.close()
    return offences


def write_final_summary(db_path: Path, run_id: str, folder: Path, *,
                        launcher: LauncherEnding | None = None,
                        repeat_offenders: tuple[int, int] | None = REPEAT_OFFENDER_DEFAULTS) -> tuple[Path, Path]:
    """Build the run's final summary from the store and write `final_summary.json` + the text card
    into `folder` (atomic writes, by `reporting.write_summary_files`)."""
    return write_summary(db_path, run_id, folder, launcher=launcher, repeat_offenders=repeat_offenders)[0]


def write_summary(db_path: Path, run_id: str, folder: Path, *, launcher: LauncherEnding | None = None,
                  repeat_offenders: tuple[int, int] | None = REPEAT_OFFENDER_DEFAULTS) -> tuple[tuple[Path, Path], tuple]:
    """`write_final_summary`, and the run's confirmed culprits (what the processor records at a run's end)."""
    from traceml.processor.reporting.final_summary import write_summary_files

    summary, culprits = summarise(Path(db_path), run_id, launcher=launcher, repeat_offenders=repeat_offenders)
    return write_summary_files(folder, summary), culprits


def live_points(result, db_path: Path, *, top_k: int | None = None, totals=None) -> Sequence:
    """Summary metric points of one live refresh (latest memory peaks, reported drops);
    `top_k`: ranks exported by score beyond the ones that always are (None: the default);
    `totals`: the run's step counters (`reporting.step_exemplars.StepTotals`), None for none.
    The window's worst steps become the points' exemplars (their stored span ids)."""
    from traceml.processor.reporting.summary_metrics import DEFAULT_RANK_SERIES_TOP_K, summary_metric_points

    # The live metrics read drops, not stored-step counts: no scan of the run's rows per refresh.
    memory, telemetry = read_run_facts(db_path, result.analysis.window.run_id, latest_memory=True,
                                       count_stored=False)
    return summary_metric_points(result.analysis, freshness=result.freshness, memory=memory,
                                 telemetry=telemetry.ranks, first_step_stored=telemetry.first_step_stored,
                                 top_k=DEFAULT_RANK_SERIES_TOP_K if top_k is None else top_k,
                                 exemplars=step_exemplars(result.analysis.window, db_path), totals=totals)


def step_exemplars(window, db_path: Path) -> dict:
    """Per Step Time metric, the window's worst step as a `StepExemplar` (its stored trace and span
    id; a step stored without them, e.g. a foreign row, gives none): one indexed read per metric."""
    import sqlite3

    from traceml.processor.metric_point import StepExemplar
    from traceml.processor.reporting.step_exemplars import worst_steps
    from traceml.processor.sqlite_layout import connect_readonly
    from traceml.processor.store_read import read_step_span

    worst = worst_steps(window)
    if not worst:
        return {}
    out = {}
    conn = connect_readonly(db_path)
    try:
        ids: dict[tuple[int, int], tuple[bytes, bytes] | None] = {}
        for metric, cell in worst.items():
            key = (cell.rank, cell.step)
            if key not in ids:
                ids[key] = read_step_span(conn, window.run_id, cell.rank, cell.step)
            if ids[key] is not None:
                trace_id, span_id = ids[key]
                out[metric] = StepExemplar(trace_id.hex(), span_id.hex(), cell.value_ms / 1000.0,
                                           cell.end_time if cell.end_time is not None else time.time(),
                                           cell.rank, cell.step)
    except sqlite3.OperationalError:  # a store of a layout without the span ids: no exemplars
        return {}
    finally:
        conn.close()
    return out
