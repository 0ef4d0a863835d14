"""What every mapping hands on (`ForeignStep`) and the one place it becomes a stored row (`place`).

A job that never installed TraceML sends step records of its own shape: Megatron-LM's
and nemo-lens's spans, a team's own span names, the original TraceML's log records.
Each mapping reads its shape into a `ForeignStep`: the step's number, bounds, identity
and its phases already in our canonical vocabulary (microbatches summed into their
step, as ours are), plus what it could not place. `place` then judges it by the span
decoder's rules (`decode_attributes`) and turns it into the same `StepTimeIngestRecord`
our own `traceml.step` span becomes, so storage, analysis, diagnosis and every surface
treat it as ours. Which mapping a rank came through, which phases that mapping can never
measure and what it left unplaced travel beside it as a `store_records.MappingNote`.

Foreign clocks are host wall-clock (span bounds, log timestamps): a phase is stored on
the CPU clock, never the GPU's.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from traceml.processor.decode_attributes import Reject, ResourceIdentity, int_attr, ms_value
from traceml.processor.step_time.model import RankIdentity, RawEventValue, StepTimeIngestRecord
from traceml.processor.store_records import (
    ATTRIBUTE_TOO_LARGE,
    MISSING_RANK,
    MISSING_RUN_ID,
    MISSING_STEP,
    MISSING_TIMESTAMP,
    NEGATIVE,
    NO_EVENTS,
    IGNORED_OWN_SPANS_WIN,
    WRONG_TYPE,
    DecodedBatch,
)
from traceml.schema.vocabulary import CANONICAL_METRICS, METRIC_TO_RAW_EVENT

if TYPE_CHECKING:
    from traceml.processor.admission import RunAdmission
    from traceml.processor.decode import DecodeLimits


@dataclass(frozen=True, slots=True)
class PhaseTime:
    """One phase of one step: summed milliseconds and how many occurrences were summed."""

    ms: float
    count: int | None = 1


@dataclass(frozen=True)
class ForeignStep:
    """One step of a foreign sender, read by a mapping (see /work/notes/mapping-api.md).

    `phases` maps canonical phase names (`vocabulary.CANONICAL_METRICS`) to their summed
    time; a phase the step did not measure is absent (stored null, never 0).
    `traced_step_time` is the whole step. Identity left None is taken from the resource.
    `steps`: the training steps the row stands for: 1, or N for a record of an N-step window
    (the original TraceML's windowed step records), whose phases are then the window's mean
    per step, never invented per-step values; the mapping note counts training steps by it.
    """

    mapping: str
    step: int | None
    start_ns: int
    end_ns: int
    phases: Mapping[str, PhaseTime]
    unplaced: Mapping[str, int] = field(default_factory=dict)
    run_id: str | None = None
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    hostname: str | None = None
    steps: int = 1


def _checked_int(name: str, value, minimum: int, maximum: int) -> int:
    """A mapped integer by the attribute decoder's rules (never a string of digits)."""
    return int_attr({name: value}, name, allow_string=False, minimum=minimum, maximum=maximum)


def _identity(step: ForeignStep, res: ResourceIdentity | None, limits: "DecodeLimits",
              admission: "RunAdmission") -> tuple[str, RankIdentity]:
    if res is not None and res.error is not None and (step.run_id is None or step.rank is None):
        raise res.error
    run_id = step.run_id if step.run_id is not None else (res.run_id if res is not None else None)
    if run_id is not None:
        if not isinstance(run_id, str):
            raise Reject(WRONG_TYPE, f"run id must be a string, got {run_id!r}")
        run_id = run_id.strip()
        if len(run_id) > limits.max_run_id_chars:
            raise Reject(ATTRIBUTE_TOO_LARGE, f"run id is {len(run_id)} characters (cap {limits.max_run_id_chars})")
    if not run_id:
        raise Reject(MISSING_RUN_ID, f"{step.mapping}: no run id on the step or its resource")
    rank_cap = limits.max_ranks_per_run * 64
    base = res.identity if res is not None else None
    if step.rank is None and base is None:
        raise Reject(MISSING_RANK, f"{step.mapping}: no rank on the step or its resource")
    rank = base.global_rank if step.rank is None else _checked_int("rank", step.rank, 0, rank_cap)
    world = step.world_size
    if world is not None:
        world = _checked_int("world size", world, 1, rank_cap)
    if (base is not None and base.global_rank == rank and (world is None or world == base.world_size)
            and step.local_rank is None and step.hostname is None):
        identity = base  # spans of one resource share one identity object (`normalise` caches by it)
    else:
        local = None if step.local_rank is None else _checked_int("local rank", step.local_rank, 0, rank_cap)
        host = step.hostname if isinstance(step.hostname, str) else (base.hostname if base else None)
        identity = RankIdentity(
            global_rank=rank,
            local_rank=local if local is not None else (base.local_rank if base else None),
            node_rank=base.node_rank if base else None,
            world_size=world if world is not None else (base.world_size if base else None),
            local_world_size=base.local_world_size if base else None,
            hostname=host,
        )
    admission.admit(run_id, rank)
    return run_id, identity


def ingest_record(step: ForeignStep, res: ResourceIdentity | None, limits: "DecodeLimits",
                  admission: "RunAdmission") -> StepTimeIngestRecord:
    """`step` judged by the span decoder's rules -> the row our own step span would make.

    Raises `Reject` with the reason word of the first rule it breaks.
    """
    if step.step is None:
        raise Reject(MISSING_STEP, f"{step.mapping}: the step has no step number")
    number = _checked_int("step", step.step, 0, limits.max_step)
    if not step.start_ns or not step.end_ns:
        raise Reject(MISSING_TIMESTAMP, "start or end time is zero")
    if step.end_ns < step.start_ns:
        raise Reject(NEGATIVE, "end time before start time")
    events: dict[str, RawEventValue] = {}
    for metric, phase in step.phases.items():
        raw = METRIC_TO_RAW_EVENT.get(metric)
        if raw is None or metric not in CANONICAL_METRICS:
            raise Reject(WRONG_TYPE, f"{step.mapping}: {metric!r} is not a phase")
        ms = ms_value(phase.ms, metric, limits)
        count = None if phase.count is None else _checked_int(f"{metric} count", phase.count, 0,
                                                               limits.max_event_count)
        events[raw] = RawEventValue(cpu_ms=ms, gpu_ms=None, count=count)
    if not events:
        raise Reject(NO_EVENTS, f"{step.mapping}: step {number} placed no phase")
    run_id, identity = _identity(step, res, limits, admission)
    return StepTimeIngestRecord(
        run_id=run_id, identity=identity, step=number, start_time=step.start_ns / 1e9,
        sample_time=step.end_ns / 1e9, events=events,
        training_strategy=res.strategy if res is not None else None,
        attempt=res.attempt if res is not None else 0)


def place(batch: DecodedBatch, step: ForeignStep, res: ResourceIdentity | None, limits: "DecodeLimits",
          admission: "RunAdmission", unmeasured: tuple[str, ...] = (), *,
          own: "OwnRanks | None" = None) -> bool:
    """The layer's one entry: `step` becomes a step row of `batch`, with its mapping note.

    A step that breaks a rule is rejected whole in `batch.rejected` (its reason word) and
    False returned; nothing raises. `unmeasured`: the phases the mapping can never measure.
    `own`: the (run, rank)s that send TraceML's own step spans; a step of one of them is
    counted (`traceml_spans_win`), not stored.
    """
    try:
        record = ingest_record(step, res, limits, admission)
        steps = _checked_int("steps", step.steps, 1, limits.max_step)
    except Reject as exc:
        batch.reject(exc.reason, f"{step.mapping} step: {exc.detail}")
        return False
    if own is not None and own.sends(record.run_id, record.identity.global_rank):
        batch.ignored[IGNORED_OWN_SPANS_WIN] += 1
        return False
    batch.step_records.append(record)
    batch.note_mapping(record.run_id, record.identity.global_rank, step.mapping, unmeasured, step.unplaced,
                       steps)
    if record.identity.world_size is not None:
        batch.world_sizes[record.run_id] = record.identity.world_size
    return True


class OwnRanks:
    """The (run, rank)s this processor has seen sending TraceML's own step spans (bounded).

    A rank with both TraceML and a framework's own telemetry under one run id would give two
    readings of each step with the same key; ours are the row (`place`'s `own`). Kept for the
    processor's lifetime, at most `limit` pairs (past it, the oldest are forgotten first).
    """

    def __init__(self, limit: int = 100_000):
        self.limit = limit
        self._seen: dict[tuple[str, int], None] = {}
        self._lock = threading.Lock()

    def add(self, run_id: str, rank: int) -> None:
        key = (run_id, rank)
        if key not in self._seen:  # the hot path: one lookup per step span
            with self._lock:
                if len(self._seen) >= self.limit:
                    self._seen.pop(next(iter(self._seen)))
                self._seen[key] = None

    def sends(self, run_id: str, rank: int) -> bool:
        return (run_id, rank) in self._seen
