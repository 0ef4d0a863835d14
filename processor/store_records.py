"""What intake hands to the store: the decoded records of one request and why parts were refused.

The decoders (`decode_spans`, `decode_metrics`) fill a `DecodedBatch`; the ingest
queue, the writer's callers, the run monitor and the read side use it and the
reason words below without loading a decoder (nor protobuf). The step, memory and
resource records themselves are the store's model (`step_time/model.py`); this
module adds the request-level ones (end markers, drop reports, the batch).
Standard library and the layers below only.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping

from traceml.processor.step_time.model import (
    ResourceIngestRecord,
    StepMemoryIngestRecord,
    StepTimeIngestRecord,
)
from traceml.schema import vocabulary as v

MAX_EVENT_MS = 86_400_000.0
"""One day, per summed event and step: a longer phase is a broken clock, not a measurement.
The read side applies the same cap to rows some other tool wrote into the store."""

# Reasons (stable strings: they appear in partial-success messages and self-metrics).
MISSING_RUN_ID = "missing_run_id"
MISSING_RANK = "missing_rank"
MISSING_STEP = "missing_step"
MISSING_TIMESTAMP = "missing_timestamp"
WRONG_TYPE = "wrong_attribute_type"
NON_FINITE = "non_finite_value"
NEGATIVE = "negative_value"
ABSURD = "absurd_value"
NO_EVENTS = "no_events"
ATTRIBUTE_TOO_LARGE = "attribute_too_large"
TOO_MANY_ATTRIBUTES = "too_many_attributes"
TOO_MANY_RUNS = "too_many_runs"
TOO_MANY_RANKS = "too_many_ranks"
# A part of the request protobuf or JSON could not read (`otlp_read`, which turns bodies
# into requests: the receivers import it, this module does not, so the read side that
# imports the caps above loads no protobuf).
NESTED_TOO_DEEPLY = "nested_too_deeply"
UNREADABLE = "unreadable"

# Why something was ignored rather than rejected.
IGNORED_FOREIGN = "not_traceml"
IGNORED_PHASE_SPAN = "phase_span"
IGNORED_UNUSED_METRIC = "unused_metric"
IGNORED_NO_VALUE = "no_recorded_value"  # a point flagged "no recorded value" (a Prometheus staleness marker)
IGNORED_UNPLACED = "unplaced_foreign"
"""A foreign record a mapping (`processor/mapping`) read but could not place on any step (a phase
span whose step span never came, a step span of a shape no phase rule places): counted, never
guessed into a phase."""
IGNORED_UNUSED_RECORD = "unused_record"
"""A foreign record of a known emitter's shape that no row is built from (the original TraceML's
`step_memory` and `runtime_context` log records, `mapping/traceml_logs.py`)."""
IGNORED_OWN_SPANS_WIN = "traceml_spans_win"
"""A foreign step of a (run, rank) that also sends TraceML's own step spans (a job with both
TraceML and, say, Megatron-LM's telemetry under one run id): ours are the row, the mapped one
is counted, so two readings of one step never replace each other in the store."""
IGNORED_UNKNOWN_HOST = "unknown_host"
"""A foreign resource point (`hostmetrics`, DCGM) on a host where no run the store knows has a
rank (or, for a process's figures, no rank with that pid): counted by the ingest queue after
the store said so (`WriteResult.unjoined_resources`), since only the store knows the hosts."""


@dataclass(frozen=True, slots=True)
class RunEndMarker:
    """A rank's TraceML shut down (`traceml.run.end`), with how its process ended when it said."""

    run_id: str
    global_rank: int
    steps_completed: int | None
    world_size: int | None
    sample_time: float
    # attribute key -> count; plus `traceml.steps.boundary` -> its word (`STEP_BOUNDARIES`), when said
    final_counts: Mapping[str, int | str] = field(default_factory=dict)
    dropped: Mapping[str, int] = field(default_factory=dict)  # queue -> final dropped count
    outcome: str | None = None  # schema.endings.MARKER_OUTCOMES; None: not said (or not one of them)
    exit_code: int | None = None  # the status that ending gives the process, when said
    attempt: int = 0  # the sender's elastic restart attempt (`traceml.run.attempt`)


@dataclass(frozen=True, slots=True)
class DropReport:
    """Cumulative count of telemetry a rank reported dropped from one of its queues."""

    run_id: str
    global_rank: int
    queue: str
    dropped: int
    sample_time: float


MAX_UNPLACED_LABELS = 32
"""Labels (span names, attribute keys, from the wire) kept per stored mapping note; the counts of
any further ones go to `OTHER_UNPLACED`, so a sender naming spans by id cannot grow the store."""
MAX_UNPLACED_LABEL_CHARS = 128
OTHER_UNPLACED = "(other names)"


def bounded_unplaced(counts: Mapping[str, int]) -> dict[str, int]:
    """`counts` with at most `MAX_UNPLACED_LABELS` labels (the largest kept, ties by name), each cut
    to `MAX_UNPLACED_LABEL_CHARS`; the rest summed under `OTHER_UNPLACED`."""
    merged: dict[str, int] = {}
    for label, n in counts.items():
        label = label if label == OTHER_UNPLACED else label[:MAX_UNPLACED_LABEL_CHARS]
        merged[label] = merged.get(label, 0) + int(n)
    other = merged.pop(OTHER_UNPLACED, 0)
    ranked = sorted(merged.items(), key=lambda kv: (-kv[1], kv[0]))
    out = dict(ranked[:MAX_UNPLACED_LABELS])
    other += sum(n for _, n in ranked[MAX_UNPLACED_LABELS:])
    if other:
        out[OTHER_UNPLACED] = other
    return out


@dataclass
class MappingNote:
    """How one rank's steps of one batch came in through a foreign mapping (`processor/mapping`):
    the mapping's name, the phases it can never measure, and per label (span name, attribute key)
    how much inside its steps no phase rule placed. Stored per (run, rank, mapping)."""

    run_id: str
    global_rank: int
    mapping: str
    unmeasured: tuple[str, ...] = ()
    unplaced: Counter = field(default_factory=Counter)
    steps: int = 0


@dataclass
class DecodedBatch:
    """Everything one export request contributed, plus what was refused and why."""

    signal: v.Signal
    step_records: list[StepTimeIngestRecord] = field(default_factory=list)
    memory_records: list[StepMemoryIngestRecord] = field(default_factory=list)
    resource_records: list[ResourceIngestRecord] = field(default_factory=list)
    run_ends: list[RunEndMarker] = field(default_factory=list)
    drops: list[DropReport] = field(default_factory=list)
    rejected: Counter = field(default_factory=Counter)  # reason -> items
    ignored: Counter = field(default_factory=Counter)  # reason -> items
    examples: list[str] = field(default_factory=list)  # first few explanations
    world_sizes: dict[str, int] = field(default_factory=dict)  # run -> declared world size
    mapped: dict[tuple[str, int, str], MappingNote] = field(default_factory=dict)  # (run, rank, mapping) -> note

    @property
    def rejected_count(self) -> int:
        return sum(self.rejected.values())

    @property
    def ignored_count(self) -> int:
        return sum(self.ignored.values())

    @property
    def record_count(self) -> int:
        return (len(self.step_records) + len(self.memory_records) + len(self.resource_records)
                + len(self.run_ends) + len(self.drops))

    @property
    def run_ids(self) -> set[str]:
        runs = {r.run_id for r in self.step_records}
        runs.update(r.run_id for r in self.memory_records)
        runs.update(r.run_id for r in self.resource_records if r.run_id is not None)
        runs.update(r.run_id for r in self.run_ends)
        runs.update(r.run_id for r in self.drops)
        return runs

    def note_mapping(self, run_id: str, rank: int, mapping: str, unmeasured: tuple[str, ...],
                     unplaced: Mapping[str, int], steps: int = 1) -> None:
        """One row of `rank` came in through foreign `mapping` (`mapping.record.place`), standing
        for `steps` training steps (more than 1: a window's mean per step)."""
        key = (run_id, rank, mapping)
        note = self.mapped.get(key)
        if note is None:
            note = self.mapped[key] = MappingNote(run_id, rank, mapping, tuple(unmeasured))
        note.steps += steps
        if unplaced:
            note.unplaced.update(unplaced)

    def reject(self, reason: str, detail: str, count: int = 1) -> None:
        self.rejected[reason] += count
        if len(self.examples) < 3:
            self.examples.append(f"{reason}: {detail}")

    def message(self) -> str:
        """The partial-success `error_message`: empty when nothing was refused or ignored."""
        parts = []
        if self.rejected:
            counts = ", ".join(f"{k}={n}" for k, n in sorted(self.rejected.items()))
            parts.append(f"rejected {self.rejected_count} ({counts})")
            if self.examples:
                parts.append("first: " + "; ".join(self.examples))
        if self.ignored:
            counts = ", ".join(f"{k}={n}" for k, n in sorted(self.ignored.items()))
            parts.append(f"ignored {self.ignored_count} that TraceML does not use ({counts})")
        return "; ".join(parts)
