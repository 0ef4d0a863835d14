"""One run id for every rank of a launch, and the local folder that run's files live in.

Precedence: the ranks' own (`traceml.schema.run_id`), with the rendezvous id
taken from `--rdzv-id` (which torchrun turns into the ranks'
`TORCHELASTIC_RUN_ID`): `--run-id`, `TRACEML_RUN_ID`, `--rdzv-id` unless `none`,
`SLURM_JOB_ID`, else a fresh id. A fresh id is only safe on one node: other
nodes' launchers would invent their own, so multi-node launches without any
shared source are warned about (`launcher.run`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from traceml.schema import run_id as _run_id

DEFAULT_RUNS_DIR = "traceml_runs"
DB_FILENAME = "traceml.sqlite"
LAUNCHER_ENDING_FILENAME = "launcher_ending.json"
"""Beside the database: the ranks' exit codes as `traceml run` saw them, for `traceml summary`."""

@dataclass(frozen=True, slots=True)
class ResolvedRunId:
    run_id: str
    source: _run_id.RunIdSource  # the ranks' vocabulary; `launcher.run` checks for SOURCE_GENERATED


def resolve_run_id(explicit: str | None, rdzv_id: str | None,
                   environ: Mapping[str, str] | None = None) -> ResolvedRunId:
    environ = os.environ if environ is None else environ
    declared = _run_id.declared_run_id(explicit, rdzv_id, environ)
    if declared is None:
        return ResolvedRunId(_run_id.fresh_run_id(), _run_id.SOURCE_GENERATED)
    value, source = declared
    return ResolvedRunId(value, source)


def run_directory(runs_dir: str | os.PathLike[str], run_id: str) -> Path:
    """`<runs_dir>/<run id>`, named exactly as the processor names a run's summary folder."""
    from traceml.processor.api import summary_folder

    return summary_folder(Path(runs_dir), run_id)
