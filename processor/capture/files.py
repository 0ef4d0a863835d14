"""Where a run's captures live on disk: one folder per run beside the processor's store.

`<db>.captures/<run folder>/<capture id>/` holds `capture.json` (the record's state, rewritten at
each change), `rank<N>.summary.json` (each rank's upload as it was sent, validated first) and the
raw traces under `schema.capture.trace_file_name`, so a summary written later by another process
(`traceml run` after its embedded processor stopped, `traceml summary`) reads the same captures
back with `load_records`. The run folder is named as the run's summary folder is
(`security.summary_folder`), so no run id can reach outside the root.

A capture's files go when its run leaves the processor (`remove_run`, called when the run
monitor forgets a run), which is also when its admission slot is freed: the store's rows are kept,
but nothing serves a forgotten run's captures any more, and they are the only part of a run that
is megabytes. A restarted processor keeps only the folders of the runs it adopts (`keep_only`).
`traceml run` moves the traces into its run folder first.

Writes replace files atomically (a temporary file renamed), so a reader never sees half a record.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from traceml.processor.capture.model import CaptureRecord
from traceml.processor.security import sanitize_run_id, summary_folder
from traceml.schema.capture import (
    CaptureFormatError,
    RankCaptureSummary,
    trace_file_name,
    valid_capture_id,
)

LOG = logging.getLogger(__name__)

RECORD_FILE = "capture.json"
TRACE_SUFFIX = ".pt.trace.json.gz"


def captures_root(db_path: Path) -> Path:
    """The folder that holds every run's captures for the store at `db_path`."""
    db_path = Path(db_path)
    return db_path.with_name(db_path.name + ".captures")


def run_captures_folder(db_path: Path, run_id: str) -> Path:
    return summary_folder(captures_root(db_path), run_id)


def run_label(run_id: str) -> str:
    """The run's part of a trace file name (the sanitised run id, as its folder is named)."""
    return sanitize_run_id(run_id)


class CaptureFiles:
    """Write side: the book's records and uploads of the store at `db_path`."""

    def __init__(self, db_path: Path):
        self.db_path = Path(db_path)

    def folder(self, run_id: str, capture_id: str) -> Path:
        if not valid_capture_id(capture_id):
            raise ValueError(f"not a capture id: {capture_id[:80]!r}")
        return run_captures_folder(self.db_path, run_id) / capture_id

    def save_record(self, record: CaptureRecord) -> None:
        doc = {"capture_id": record.capture_id, "run_id": record.run_id, "trigger": record.trigger,
               "status": record.status, "culprit_rank": record.culprit_rank,
               "reference_rank": record.reference_rank, "steps": record.steps,
               "requested_at": record.requested_at, "finished_at": record.finished_at,
               "reason": record.reason, "traces": list(record.traces)}
        _write(self.folder(record.run_id, record.capture_id) / RECORD_FILE, json.dumps(doc).encode())

    def save_summary(self, summary: RankCaptureSummary, raw: bytes) -> None:
        _write(self.folder(summary.run_id, summary.capture_id) / f"rank{summary.rank}.summary.json", raw)

    def save_trace(self, run_id: str, capture_id: str, rank: int, data: bytes) -> str:
        """Keep one rank's gzip'd trace; returns its file name."""
        name = trace_file_name(run_label(run_id), capture_id, rank)
        _write(self.folder(run_id, capture_id) / name, data)
        return name

    def remove_run(self, run_id: str) -> None:
        try:
            folder = run_captures_folder(self.db_path, run_id)
        except ValueError:
            return
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
            LOG.info("run %r: its capture files were removed with it", run_id)


    def keep_only(self, run_ids) -> list[str]:
        """At start-up: remove the capture folders of every run but `run_ids` (the runs the
        processor adopts again); the others left it before the restart. Returns the removed names."""
        root = captures_root(self.db_path)
        if not root.is_dir():
            return []
        kept = set()
        for run_id in run_ids:
            try:
                kept.add(run_captures_folder(self.db_path, run_id).name)
            except ValueError:
                continue
        removed = []
        for folder in root.iterdir():
            if folder.is_dir() and folder.name not in kept:
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder.name)
        return removed


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


# --- read side (another process: the launcher's summary, `traceml capture` never) -------------


def load_records(db_path: Path, run_id: str) -> list[CaptureRecord]:
    """The run's captures as the store's processor left them, oldest first, with the ranks'
    summaries read back (the digest is not stored: `book.digest_of` computes it again)."""
    try:
        folder = run_captures_folder(db_path, run_id)
    except ValueError:
        return []
    if not folder.is_dir():
        return []
    records = []
    for entry in sorted(folder.iterdir()):
        record = _load_one(entry)
        if record is not None and record.run_id == run_id:
            records.append(record)
    records.sort(key=lambda r: (r.requested_at, r.capture_id))
    return records


def _load_one(folder: Path) -> CaptureRecord | None:
    try:
        doc = json.loads((folder / RECORD_FILE).read_bytes())
        summaries = []
        for path in sorted(folder.glob("rank*.summary.json")):
            try:
                summaries.append(RankCaptureSummary.from_json(path.read_bytes()))
            except (CaptureFormatError, OSError):
                continue  # validated when received; a damaged file is left out, not guessed
        return CaptureRecord(
            capture_id=str(doc["capture_id"]), run_id=str(doc["run_id"]), trigger=str(doc["trigger"]),
            status=str(doc["status"]), culprit_rank=int(doc["culprit_rank"]),
            reference_rank=None if doc.get("reference_rank") is None else int(doc["reference_rank"]),
            steps=int(doc["steps"]), requested_at=float(doc["requested_at"]),
            finished_at=None if doc.get("finished_at") is None else float(doc["finished_at"]),
            reason=doc.get("reason"), summaries=tuple(summaries),
            traces=tuple(str(t) for t in doc.get("traces") or ()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def capture_trace_paths(db_path: Path, run_id: str) -> list[Path]:
    """Every raw trace kept for the run (what `traceml run` copies beside final_summary.json)."""
    try:
        folder = run_captures_folder(db_path, run_id)
    except ValueError:
        return []
    return sorted(folder.glob(f"*/*{TRACE_SUFFIX}")) if folder.is_dir() else []
