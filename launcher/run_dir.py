"""One run id for every rank of a launch, and the local folder that run's files live in.

Precedence (ARCHITECTURE.md section 4): an explicit id (`--run-id` or
`TRACEML_RUN_ID`), else a rendezvous id the user chose (`--rdzv-id`, which
torchrun turns into `TORCHELASTIC_RUN_ID`; the literal `none` means unset),
else `SLURM_JOB_ID`, else a fresh id. A fresh id is only safe on one node:
other nodes' launchers would invent their own, so multi-node launches without
any shared source are warned about.
"""
from __future__ import annotations

import datetime as _dt
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from traceml.schema import environment as env

DEFAULT_RUNS_DIR = "traceml_runs"
DB_FILENAME = "traceml.sqlite"
SUMMARY_FILENAME = "final_summary.json"
CARD_FILENAME = "summary_card.txt"

@dataclass(frozen=True, slots=True)
class ResolvedRunId:
    run_id: str
    source: str  # "explicit" | "rdzv_id" | "slurm" | "generated"


def generate_run_id(now: _dt.datetime | None = None) -> str:
    """Sortable, readable and unique enough for two launches in the same second."""
    now = now or _dt.datetime.now()
    return f"{now:%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def resolve_run_id(explicit: str | None, rdzv_id: str | None,
                   environ: Mapping[str, str] | None = None) -> ResolvedRunId:
    environ = os.environ if environ is None else environ
    for value, source in (
        (explicit, "explicit"),
        (environ.get(env.TRACEML_RUN_ID), "explicit"),
        (rdzv_id, "rdzv_id"),
        (environ.get(env.SLURM_JOB_ID), "slurm"),
    ):
        if value and value.strip() and value.strip().lower() != "none":
            return ResolvedRunId(value.strip(), source)
    return ResolvedRunId(generate_run_id(), "generated")


def run_directory(runs_dir: str | os.PathLike[str], run_id: str) -> Path:
    """`<runs_dir>/<run id>`, named exactly as the processor names a run's summary folder."""
    from traceml.processor.security import summary_folder

    return summary_folder(Path(runs_dir), run_id)
