"""The run id every rank and the launcher agree on: the sources in order, and the one fresh-id format.

ARCHITECTURE.md section 4. Two places resolve a run id: each rank
(`traceml.exporter.identity`) and `traceml run` (`traceml.launcher.run_dir`,
which hands its choice to every rank as TRACEML_RUN_ID). They must agree, so the
order of the declared sources lives here, once:

1. an explicit id (`traceml.init(run_id=...)`, `traceml run --run-id`), else
   TRACEML_RUN_ID;
2. the rendezvous id the user chose: TORCHELASTIC_RUN_ID in a rank, `--rdzv-id`
   in the launcher (torchrun turns the one into the other), unless it is the
   literal `none` (any case), which plain `torchrun` sets when none was chosen;
3. SLURM_JOB_ID.

What happens when no source declares an id is each side's own decision (ranks
agree on a generated one through the rendezvous store; the launcher generates
one); both generate it with `fresh_run_id()`. Which source gave the id is named
by one vocabulary on both sides (`RunIdSource`): a rank's `RunIdentity.run_id_source`
and the launcher's `ResolvedRunId.source`. Standard library only.
"""
from __future__ import annotations

import secrets
import time
from typing import Literal, Mapping

from .environment import SLURM_JOB_ID, TORCHELASTIC_RUN_ID, TRACEML_RUN_ID

RunIdSource = Literal["argument", "TRACEML_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                      "rendezvous_store", "launcher_process", "generated"]
# The declared sources, in their order of precedence:
SOURCE_ARGUMENT: RunIdSource = "argument"
SOURCE_TRACEML_ENV: RunIdSource = TRACEML_RUN_ID
SOURCE_RENDEZVOUS: RunIdSource = TORCHELASTIC_RUN_ID  # a rank's variable; the launcher's `--rdzv-id`
SOURCE_SLURM: RunIdSource = SLURM_JOB_ID
# When none declares one: the ranks' agreement through the job's rendezvous store, or the id
# derived from the launcher process the local ranks share (exporter.identity); else a fresh id.
SOURCE_RENDEZVOUS_STORE: RunIdSource = "rendezvous_store"
SOURCE_LAUNCHER_PROCESS: RunIdSource = "launcher_process"
SOURCE_GENERATED: RunIdSource = "generated"
RUN_ID_SOURCES: tuple[RunIdSource, ...] = (SOURCE_ARGUMENT, SOURCE_TRACEML_ENV, SOURCE_RENDEZVOUS, SOURCE_SLURM,
                                           SOURCE_RENDEZVOUS_STORE, SOURCE_LAUNCHER_PROCESS, SOURCE_GENERATED)

RENDEZVOUS_UNSET = "none"
"""The rendezvous id plain `torchrun` (no `--rdzv-id`) sets: no id was chosen."""


def declared_run_id(explicit: str | None, rendezvous_id: str | None,
                    environ: Mapping[str, str]) -> tuple[str, RunIdSource] | None:
    """`(run id, source)` from the first source that declares one, else None.

    Args:
        explicit: the caller's own setting (an argument, a command-line option).
        rendezvous_id: the rendezvous id as the caller sees it (a rank reads
            TORCHELASTIC_RUN_ID; the launcher has its `--rdzv-id`).
        environ: where TRACEML_RUN_ID and SLURM_JOB_ID are read.

    Values are stripped; a blank value declares nothing.
    """
    for value, source in ((explicit, SOURCE_ARGUMENT),
                          (environ.get(TRACEML_RUN_ID), SOURCE_TRACEML_ENV),
                          (rendezvous_id, SOURCE_RENDEZVOUS),
                          (environ.get(SLURM_JOB_ID), SOURCE_SLURM)):
        value = (value or "").strip()
        if value and not (source == SOURCE_RENDEZVOUS and value.lower() == RENDEZVOUS_UNSET):
            return value, source
    return None


def fresh_run_id() -> str:
    """A new run id: UTC start time plus 32 random bits (sortable, unique across jobs)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(4)
