"""Typed facts the caller hands to the reporting projectors besides the analysis.

The projectors never read SQLite: whoever orchestrates the summary (or the live
re-export) reads run metadata, memory peaks and telemetry health from the store
and passes them here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from traceml.processor.endings import LauncherEnding, RankEndFacts, RankEnding, rank_endings


@dataclass(frozen=True, slots=True)
class RunMetadata:
    """Who and when: run identity and how the summary was produced."""

    run_id: str
    generated_at: float | None = None  # unix seconds; None leaves the timestamp null
    traceml_version: str | None = None
    profile: str = "summary"  # "summary" (final) or "live"
    max_steps: int | None = None  # the profile's window bound, e.g. 10,000 common steps


@dataclass(frozen=True, slots=True)
class RankMemory:
    """One rank's peak memory on its tracked device, bytes.

    For the final summary the caller passes the maximum over the run; for the
    re-exported metric, the latest step's peak. None = unavailable (no CUDA
    device, or never reported); never 0 for "unknown".
    """

    global_rank: int
    device: str | None
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None


@dataclass(frozen=True, slots=True)
class RankTelemetry:
    """One rank's telemetry health: did it finish cleanly, what did its queues drop."""

    global_rank: int
    finished: bool
    dropped: Mapping[str, int] = field(default_factory=dict)  # queue name -> records dropped
    # From the rank's end marker (None before it arrives): step records its exporter
    # lost to failed trace exports, and the steps it completed; plus the steps stored.
    export_failures: int | None = None
    steps_completed: int | None = None
    steps_stored: int = 0
    # How its process ended, as its end marker said (None: not said, or no marker), and
    # its node (to match the launcher's exit codes, which cover one node's ranks).
    outcome: str | None = None
    exit_code: int | None = None
    node_rank: int | None = None
    step_boundary: str | None = None  # how its steps were delimited (`vocabulary.STEP_BOUNDARIES`)


@dataclass(frozen=True, slots=True)
class AttemptSteps:
    """One elastic restart attempt of the run and the steps stored for each rank in it."""

    attempt: int
    steps: Mapping[int, int]  # global rank -> steps stored


@dataclass(frozen=True, slots=True)
class RunSource:
    """How one rank's steps came in through a foreign mapping (`processor/mapping`), as stored
    (`store_read.read_sources`): the mapping's name, the phases it can never measure, what it left
    unplaced in the rank's steps (label -> count) and how many steps it placed."""

    global_rank: int
    mapping: str
    unmeasured: tuple[str, ...] = ()
    unplaced: Mapping[str, int] = field(default_factory=dict)
    steps: int = 0


@dataclass(frozen=True, slots=True)
class AttemptSpan:
    """One elastic attempt of a run as the store holds it (`store_read.read_run_restarts`): what
    the badput ledger needs to count the steps and the time a restart lost."""

    attempt: int
    ranks: int
    first_step: int
    last_step: int
    first_start: float | None  # unix seconds: its earliest step start
    last_end: float | None  # its latest step end


FIRST_STEP = 0
"""The step number every rank process gives its first step (the training side counts from 0)."""


def started_part_way(first_step_stored: int | None) -> bool | None:
    """The one rule for "the processor first saw this run part-way".

    True when nothing below `FIRST_STEP` + 1 is stored for any rank: the run's
    first steps never reached this store, because the processor started after
    the job, or this replica received the run only after the Collector's
    load-balancing exporter moved it here. Its summary and metrics then cover
    the run from `first_step_stored` on. None when no step is stored (unknown).
    """
    return None if first_step_stored is None else first_step_stored > FIRST_STEP


@dataclass(frozen=True)
class RunTelemetry:
    """Telemetry health of the run: per-rank reports, rows the store rejected, and its coverage."""

    ranks: Sequence[RankTelemetry] = ()
    rejected_rows: Mapping[str, int] = field(default_factory=dict)  # reason -> count
    first_step_stored: int | None = None  # lowest step stored for any rank; None: none (or not read)
    launcher: LauncherEnding | None = None  # the launcher's exit codes (`traceml run`), when it passed them
    attempt: int | None = None  # the attempt the window analyses (the run's latest); None: not read
    attempts: Sequence[AttemptSteps] = ()  # every attempt stored, oldest first
    # Ranks whose every stored step measured its input wait as the time before forward (steps
    # inferred from optimizer updates with no DataLoader `next()` timed: `input_wait_count` 0).
    input_before_forward_ranks: Sequence[int] = ()
    # Elastic restarts as the badput ledger counts them (`store_read.read_restarts`): every attempt's
    # span, and per earlier attempt the (rank, step) cells and seconds the next one did again. None:
    # not read (the live re-export reads no attempts).
    attempt_spans: Sequence[AttemptSpan] = ()
    redone_steps: Mapping[int, tuple[int, float]] | None = None
    # The ranks whose steps came through a foreign mapping (Megatron-LM, nemo-lens, a declared one,
    # the original TraceML's logs); a rank with none sent TraceML's own spans.
    sources: Sequence[RunSource] = ()

    @property
    def started_part_way(self) -> bool | None:
        return started_part_way(self.first_step_stored)

    def rank_endings(self, expected_ranks: Sequence[int] = ()) -> dict[int, RankEnding]:
        """How each rank ended (`processor.endings`: end markers joined with the launcher's codes)."""
        return rank_endings((RankEndFacts(t.global_rank, t.finished, t.outcome, t.exit_code, t.node_rank)
                             for t in self.ranks), expected_ranks, self.launcher)
