"""End of a run: write `final_summary.json` and the text card, then print the card.

The launcher writes them itself after stopping the embedded processor (the
processor's own run-end summary may already be there; ours, written last from
the complete database, replaces it with the same content), so a run whose
script crashed, or whose ranks never sent their end marker, still ends with a
summary. Building the summary is the processor's summary section's job (the
same code the processor's own run end uses); this module only calls it, reads
what it wrote and prints it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from traceml.launcher import run_dir as rd
from traceml.schema.diagnosis import NO_STEPS
from traceml.schema.summary import FINAL_SUMMARY_FILE


@dataclass(frozen=True)
class FinalReport:
    summary_path: Path
    card_path: Path | None
    summary: dict[str, Any]
    card: str

    @property
    def diagnosis(self) -> dict[str, Any] | None:
        diagnosis = self.summary.get("diagnosis")
        return diagnosis if isinstance(diagnosis, dict) else None


def write_report(db_path: Path, run_id: str, folder: Path, launcher=None) -> FinalReport:
    """Build the summary from the database into `folder` and load what was written.

    `launcher`: the ranks' exit codes as `traceml run` saw them (`endings.LauncherEnding`); kept
    beside the database, so a later rebuild (`traceml summary`, launcher None) reads them back."""
    from traceml.processor.api import write_final_summary

    launcher = _kept_launcher_ending(Path(db_path), run_id, launcher)
    folder.mkdir(parents=True, exist_ok=True)
    written = [Path(p) for p in write_final_summary(Path(db_path), run_id, Path(folder), launcher=launcher)]
    summary_path = next((p for p in written if p.suffix == ".json"), folder / FINAL_SUMMARY_FILE)
    card_path = next((p for p in written if p.suffix == ".txt"), None)
    summary = json.loads(summary_path.read_text())
    card = card_path.read_text() if card_path is not None else str(summary.get("card") or "")
    return FinalReport(summary_path, card_path, summary, card)


def _kept_launcher_ending(db_path: Path, run_id: str, launcher):
    """Keep `launcher` beside the database for `run_id`, or, when None, read back the one kept."""
    from traceml.processor.api import launcher_ending_from_json, launcher_ending_to_json

    path = db_path.parent / rd.LAUNCHER_ENDING_FILENAME
    if launcher is not None:
        try:
            path.write_text(json.dumps({"run_id": run_id, **launcher_ending_to_json(launcher)}))
        except OSError:
            pass  # the summary written now still has it; only a later rebuild would lack it
        return launcher
    try:
        data = json.loads(path.read_text())
        return launcher_ending_from_json(data) if data.get("run_id") == run_id else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # none kept (a processor's own database), or unreadable: go by the markers


def finalize_run(run_path: Path, run_id: str, *, out: TextIO, print_card: bool = True,
                 exit_code: int = 0, launcher=None) -> FinalReport | None:
    """Write and print the run's summary; a failure here is reported, never raised."""
    db_path = run_path / rd.DB_FILENAME
    if not db_path.exists():
        print(f"[traceml] no telemetry database at {db_path}; no summary written", file=out, flush=True)
        return None
    _copy_capture_traces(db_path, run_id, run_path, out)
    try:
        report = write_report(db_path, run_id, run_path, launcher)
    except Exception as exc:  # the training outcome matters more than our summary
        from traceml.processor.api import printable

        print(printable(f"[traceml] could not write the final summary: {type(exc).__name__}: {exc}"),
              file=out, flush=True)
        return None
    if print_card and report.card:
        print("", file=out)
        from traceml.processor.api import printable

        print(printable(report.card.rstrip("\n"), keep_newlines=True), file=out)
    note = "" if exit_code == 0 else f" (the script failed with exit code {exit_code})"
    print(f"\n[traceml] final summary: {report.summary_path}{note}", file=out)
    if report.card_path is not None:
        print(f"[traceml] text card:     {report.card_path}", file=out)
    if (report.diagnosis or {}).get("kind") != NO_STEPS:  # nothing to compare without a step
        print(f"[traceml] compare runs:  traceml compare {report.summary_path} <other run>/"
              f"{FINAL_SUMMARY_FILE}", file=out, flush=True)
    return report


def _copy_capture_traces(db_path: Path, run_id: str, folder: Path, out: TextIO) -> list[Path]:
    """The run's raw capture traces beside final_summary.json (TensorBoard's profiler plugin lists
    `.pt.trace.json.gz` under the run folder; Perfetto opens each); a failure is reported, never raised.

    Moved, not copied, when the store's capture folder is inside the run folder (the embedded
    processor's, stopped by now): a second copy there would be a second run to TensorBoard."""
    import os
    import shutil

    from traceml.processor.api import capture_trace_paths

    copied = []
    for source in capture_trace_paths(db_path, run_id):
        target = folder / source.name
        try:
            if folder.resolve() in source.resolve().parents:
                os.replace(source, target)
            else:
                shutil.copy2(source, target)
            copied.append(target)
        except OSError as exc:
            print(f"[traceml] could not copy the capture trace {source.name}: {exc}", file=out, flush=True)
    return copied
