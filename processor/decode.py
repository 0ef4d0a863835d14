"""OTLP export requests -> typed TraceML ingest records, with every refusal counted.

The decoder is the processor's only reader of wire names (all from
`traceml.schema.vocabulary`) and its only judge of values: what it hands on is
valid (run id, rank, step and timestamps; every duration None or a finite
float in [0, `DecodeLimits.max_event_ms`], one day by default; every count None
or an int in [0, `max_event_count`]; every memory peak None or an int in
[0, `max_memory_bytes`]), so nothing after it checks again. A
span or data point with any other value is rejected whole, with its reason; the
rest of the request is kept. It never raises on content; telemetry that is not
TraceML's is ignored and counted. A part of the request that protobuf or the
JSON parser could not read (`otlp_read.PartlyReadable`, e.g. another service's
resource with an attribute map nested past protobuf's recursion limit) is
rejected with its span or point count, the rest kept. The receivers turn the
counts into OTLP partial-success answers and self-metrics.

Step-span durations arrive in seconds (current exporters) or milliseconds (older
ones, `vocabulary.LEGACY_EVENT_FIELDS`); both leave here in milliseconds, the unit
of the store.
"""
from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from traceml.processor.step_time.model import (
    RankIdentity,
    RawEventValue,
    StepMemoryIngestRecord,
    StepTimeIngestRecord,
)
from traceml.schema import vocabulary as v
from traceml.schema.endings import MARKER_OUTCOMES

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


@dataclass(frozen=True)
class DecodeLimits:
    """Caps that keep one client from exhausting the processor."""

    max_runs: int = 1_000
    max_ranks_per_run: int = 16_384
    max_attribute_bytes: int = 4_096  # per string value
    max_run_id_chars: int = 256
    max_attributes: int = 512  # per span / data point
    max_step: int = 2**53
    max_event_ms: float = MAX_EVENT_MS
    max_event_count: int = 10_000_000
    max_memory_bytes: int = 2**50  # 1 PiB


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


@dataclass
class DecodedBatch:
    """Everything one export request contributed, plus what was refused and why."""

    signal: v.Signal
    step_records: list[StepTimeIngestRecord] = field(default_factory=list)
    memory_records: list[StepMemoryIngestRecord] = field(default_factory=list)
    run_ends: list[RunEndMarker] = field(default_factory=list)
    drops: list[DropReport] = field(default_factory=list)
    rejected: Counter = field(default_factory=Counter)  # reason -> items
    ignored: Counter = field(default_factory=Counter)  # reason -> items
    examples: list[str] = field(default_factory=list)  # first few explanations
    world_sizes: dict[str, int] = field(default_factory=dict)  # run -> declared world size

    @property
    def rejected_count(self) -> int:
        return sum(self.rejected.values())

    @property
    def ignored_count(self) -> int:
        return sum(self.ignored.values())

    @property
    def record_count(self) -> int:
        return len(self.step_records) + len(self.memory_records) + len(self.run_ends) + len(self.drops)

    @property
    def run_ids(self) -> set[str]:
        runs = {r.run_id for r in self.step_records}
        runs.update(r.run_id for r in self.memory_records)
        runs.update(r.run_id for r in self.run_ends)
        runs.update(r.run_id for r in self.drops)
        return runs

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


class _Reject(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class RunAdmission:
    """Thread-safe caps on how many runs, and ranks per run, the processor tracks."""

    def __init__(self, limits: DecodeLimits, known_runs: Iterable[str] = ()):
        self._limits = limits
        self._lock = threading.Lock()
        self._ranks: dict[str, set[int]] = {run: set() for run in known_runs}

    def admit(self, run_id: str, rank: int) -> None:
        ranks = self._ranks.get(run_id)
        if ranks is not None and rank in ranks:
            return
        with self._lock:
            ranks = self._ranks.get(run_id)
            if ranks is None:
                if len(self._ranks) >= self._limits.max_runs:
                    raise _Reject(TOO_MANY_RUNS, f"run {run_id!r} exceeds the cap of {self._limits.max_runs} runs")
                ranks = self._ranks[run_id] = set()
            if rank not in ranks:
                if len(ranks) >= self._limits.max_ranks_per_run:
                    raise _Reject(TOO_MANY_RANKS,
                                  f"rank {rank} of run {run_id!r} exceeds the cap of "
                                  f"{self._limits.max_ranks_per_run} ranks per run")
                ranks.add(rank)

    def forget(self, run_id: str) -> None:
        with self._lock:
            self._ranks.pop(run_id, None)

    def run_count(self) -> int:
        return len(self._ranks)


# --- attribute helpers -------------------------------------------------------------------


def _any_value(value, limits: DecodeLimits, key: str):
    """protobuf AnyValue -> Python scalar; arrays/maps/bytes come back as a marker type."""
    kind = value.WhichOneof("value")
    if kind == "string_value":
        s = value.string_value
        if len(s) > limits.max_attribute_bytes:
            raise _Reject(ATTRIBUTE_TOO_LARGE, f"{key} is {len(s)} characters (cap {limits.max_attribute_bytes})")
        return s
    if kind == "int_value":
        return value.int_value
    if kind == "double_value":
        return value.double_value
    if kind == "bool_value":
        return value.bool_value
    if kind is None:
        return None
    return _Unsupported(kind)


class _Unsupported:
    __slots__ = ("kind",)

    def __init__(self, kind: str):
        self.kind = kind

    def __repr__(self) -> str:
        return f"<{self.kind}>"


def _attributes(kvs, limits: DecodeLimits) -> dict:
    if len(kvs) > limits.max_attributes:
        raise _Reject(TOO_MANY_ATTRIBUTES, f"{len(kvs)} attributes (cap {limits.max_attributes})")
    out = {}
    for kv in kvs:
        key = kv.key
        if len(key) > limits.max_attribute_bytes:
            raise _Reject(ATTRIBUTE_TOO_LARGE, f"attribute key of {len(key)} characters")
        out[key] = _any_value(kv.value, limits, key)
    return out


def _int_attr(attrs: Mapping, key: str, *, allow_string: bool, minimum: int, maximum: int) -> int | None:
    """An integer attribute; strings of digits only where OTel env config makes them strings.

    An exact int in range (the common case on the hot path) returns at once; anything
    else is checked and rejected with its precise reason.
    """
    value = attrs.get(key, _MISS)
    if value is _MISS:
        return None
    if value.__class__ is int and minimum <= value <= maximum:
        return value
    if isinstance(value, bool) or value is None:
        raise _Reject(WRONG_TYPE, f"{key} must be an integer, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if not allow_string or not text.lstrip("-").isdigit():
            raise _Reject(WRONG_TYPE, f"{key} must be an integer, got string {value[:64]!r}")
        value = int(text)
    elif isinstance(value, float):
        raise _Reject(WRONG_TYPE, f"{key} must be an integer, got double {value!r}")
    elif not isinstance(value, int):
        raise _Reject(WRONG_TYPE, f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise _Reject(NEGATIVE, f"{key} is {value} (must be >= {minimum})")
    if value > maximum:
        raise _Reject(ABSURD, f"{key} is {value} (must be <= {maximum})")
    return value


def _ms_value(value, key: str, limits: DecodeLimits, to_ms: float = 1.0) -> float:
    """A duration attribute in its wire unit (`to_ms` milliseconds each) -> milliseconds, checked."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Reject(WRONG_TYPE, f"{key} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise _Reject(NON_FINITE, f"{key} is {value}")
    if value < 0:
        raise _Reject(NEGATIVE, f"{key} is {value}")
    ms = value * to_ms
    if ms > limits.max_event_ms:
        raise _Reject(ABSURD, f"{key} is {value} ({ms:g} ms, cap {limits.max_event_ms:g} ms)")
    return ms


@dataclass(frozen=True, slots=True)
class _Resource:
    run_id: str | None
    identity: RankIdentity | None
    strategy: str | None
    error: _Reject | None
    attempt: int = 0  # `traceml.run.attempt` (elastic restart); absent: 0


def _resource_identity(kvs, limits: DecodeLimits) -> _Resource:
    """Run and rank identity of one resource; TraceML keys win over NeMo/Megatron aliases."""
    try:
        attrs = _attributes(kvs, limits)
        for alias, key in v.RESOURCE_ALIASES.items():
            if key not in attrs and alias in attrs:
                attrs[key] = attrs[alias]
        run_id = attrs.get(v.ATTR_RUN_ID)
        if run_id is not None:
            if not isinstance(run_id, str):
                raise _Reject(WRONG_TYPE, f"{v.ATTR_RUN_ID} must be a string, got {run_id!r}")
            run_id = run_id.strip()
            if len(run_id) > limits.max_run_id_chars:
                raise _Reject(ATTRIBUTE_TOO_LARGE,
                              f"{v.ATTR_RUN_ID} is {len(run_id)} characters (cap {limits.max_run_id_chars})")
            run_id = run_id or None
        rank_cap = limits.max_ranks_per_run * 64
        rank = _int_attr(attrs, v.ATTR_RANK, allow_string=True, minimum=0, maximum=rank_cap)
        identity = None
        if rank is not None:
            hostname = attrs.get(v.RES_HOST_NAME)
            identity = RankIdentity(
                global_rank=rank,
                local_rank=_int_attr(attrs, v.ATTR_LOCAL_RANK, allow_string=True, minimum=0, maximum=rank_cap),
                node_rank=_int_attr(attrs, v.ATTR_NODE_RANK, allow_string=True, minimum=0, maximum=rank_cap),
                world_size=_int_attr(attrs, v.ATTR_WORLD_SIZE, allow_string=True, minimum=1, maximum=rank_cap),
                local_world_size=_int_attr(attrs, v.ATTR_LOCAL_WORLD_SIZE, allow_string=True,
                                           minimum=1, maximum=rank_cap),
                hostname=hostname if isinstance(hostname, str) else None,
            )
        strategy = attrs.get(v.ATTR_TRAINING_STRATEGY)
        if strategy is not None and not isinstance(strategy, str):
            raise _Reject(WRONG_TYPE, f"{v.ATTR_TRAINING_STRATEGY} must be a string, got {strategy!r}")
        attempt = _int_attr(attrs, v.ATTR_RUN_ATTEMPT, allow_string=True, minimum=0, maximum=1_000_000)
        return _Resource(run_id, identity, strategy, None, attempt or 0)
    except _Reject as exc:
        return _Resource(None, None, None, exc)


# --- traces ---------------------------------------------------------------------------------

_MEMORY_PEAK_KEYS = (v.ATTR_MEMORY_PEAK_ALLOCATED, v.ATTR_MEMORY_PEAK_RESERVED)
_ROW_KEYS = frozenset({v.ATTR_STEP, v.ATTR_RANK, v.ATTR_RUN_ID, v.ATTR_DEVICE, *_MEMORY_PEAK_KEYS})
"""The step span's attributes other than `traceml.event.*` that its rows are built from."""
_SLOT = {v.EVENT_FIELD_CPU: 0, v.EVENT_FIELD_GPU: 1, v.EVENT_FIELD_COUNT: 2}
_TO_MS = {v.DURATION_UNIT: 1000.0, v.LEGACY_DURATION_UNIT: 1.0}
"""Milliseconds per wire unit: SQLite and every reader keep milliseconds (the row layout,
the summary's `_ms` fields), so seconds from current exporters and milliseconds from
older ones become the same stored value."""
_EVENT_KEY_CACHE: dict[str, tuple[str, int, float] | None] = {}
_EVENT_KEY_CACHE_MAX = 4096
_MISS = object()


def _event_key(key: str) -> tuple[str, int, float] | None:
    """`traceml.phase.forward.cpu.duration` (or the legacy `traceml.event.forward_time.cpu_ms`)
    -> (raw event, slot, milliseconds per wire unit); memoised (keys repeat every step)."""
    try:
        return _EVENT_KEY_CACHE[key]
    except KeyError:
        pass
    parsed = v.parse_event_attribute(key)
    result = None if parsed is None else (parsed[0], _SLOT[parsed[1]], _TO_MS.get(parsed[2], 1.0))
    if len(_EVENT_KEY_CACHE) < _EVENT_KEY_CACHE_MAX and len(key) <= 256:
        _EVENT_KEY_CACHE[key] = result
    return result



def _kv_value(value, key: str, max_bytes: int):
    """One attribute's AnyValue -> scalar (the general path of the step-span loop)."""
    kind = value.WhichOneof("value")
    if kind == "double_value":
        return value.double_value
    if kind == "int_value":
        return value.int_value
    if kind == "string_value":
        val = value.string_value
        if len(val) > max_bytes:
            raise _Reject(ATTRIBUTE_TOO_LARGE, f"{key} is {len(val)} characters (cap {max_bytes})")
        return val
    if kind == "bool_value":
        return value.bool_value
    if kind is None:
        return None
    return _Unsupported(kind)


_new_object = object.__new__
_set_cpu = RawEventValue.cpu_ms.__set__  # slot descriptors: skip the frozen __setattr__ path
_set_gpu = RawEventValue.gpu_ms.__set__
_set_count = RawEventValue.count.__set__



class Decoder:
    """Stateless per request except for the shared run/rank admission caps."""

    def __init__(self, limits: DecodeLimits | None = None, admission: RunAdmission | None = None):
        self.limits = limits or DecodeLimits()
        self.admission = admission or RunAdmission(self.limits)

    def decode_traces(self, request) -> DecodedBatch:
        """`ExportTraceServiceRequest` -> step rows and run-end markers."""
        batch = DecodedBatch(v.SIGNAL_TRACES)
        limits = self.limits
        for part in getattr(request, "unreadable", ()):  # `otlp_read.PartlyReadable`
            batch.reject(part.reason, part.describe("spans"), part.items)
        for resource_spans in request.resource_spans:
            spans = [s for scope in resource_spans.scope_spans for s in scope.spans]
            if not spans:
                continue
            traceml = [s for s in spans if s.name.startswith("traceml.")]
            foreign = len(spans) - len(traceml)
            if foreign:
                batch.ignored[IGNORED_FOREIGN] += foreign
            if not traceml:
                continue
            res = _resource_identity(resource_spans.resource.attributes, limits)
            for span in traceml:
                name = span.name
                if name.startswith(v.SPAN_PHASE_PREFIX):
                    batch.ignored[IGNORED_PHASE_SPAN] += 1
                    continue
                if name != v.SPAN_STEP and name != v.SPAN_RUN_END:
                    batch.ignored[IGNORED_FOREIGN] += 1
                    continue
                try:
                    if res.error is not None:
                        raise res.error
                    if name == v.SPAN_STEP:
                        record, memory = self._step_span(span, res)
                        batch.step_records.append(record)
                        if memory is not None:
                            batch.memory_records.append(memory)
                    else:
                        batch.run_ends.append(self._run_end_span(span, res))
                    if res.identity is not None and res.identity.world_size is not None:
                        batch.world_sizes[res.run_id] = res.identity.world_size
                except _Reject as exc:
                    batch.reject(exc.reason, f"span {name!r}: {exc.detail}")
        return batch

    def _span_identity(self, attrs: Mapping, res: _Resource) -> tuple[str, RankIdentity]:
        run_id = res.run_id
        if run_id is None:
            span_run = attrs.get(v.ATTR_RUN_ID)
            if isinstance(span_run, str) and span_run.strip():
                if len(span_run) > self.limits.max_run_id_chars:
                    raise _Reject(ATTRIBUTE_TOO_LARGE, f"{v.ATTR_RUN_ID} is too long")
                run_id = span_run.strip()
            elif span_run is not None and not isinstance(span_run, str):
                raise _Reject(WRONG_TYPE, f"{v.ATTR_RUN_ID} must be a string, got {span_run!r}")
        if run_id is None:
            raise _Reject(MISSING_RUN_ID, f"no {v.ATTR_RUN_ID} (or nemo.run.id) on the resource")
        rank_cap = self.limits.max_ranks_per_run * 64
        span_rank = _int_attr(attrs, v.ATTR_RANK, allow_string=False, minimum=0, maximum=rank_cap)
        identity = res.identity
        if identity is None:
            if span_rank is None:
                raise _Reject(MISSING_RANK, f"no {v.ATTR_RANK} (or dl.rank) on the resource or span")
            identity = RankIdentity(global_rank=span_rank)
        self.admission.admit(run_id, identity.global_rank)
        return run_id, identity

    def _step_span(self, span, res: _Resource) -> tuple[StepTimeIngestRecord, StepMemoryIngestRecord | None]:
        """The hot path: one pass over the span's attributes, event keys parsed once per process.

        Returns the step's timing record and, when the span carries a measured peak,
        its memory record (timestamped at the span's end).
        """
        limits = self.limits
        kvs = span.attributes
        if len(kvs) > limits.max_attributes:
            raise _Reject(TOO_MANY_ATTRIBUTES, f"{len(kvs)} attributes (cap {limits.max_attributes})")
        ident: dict = {}
        fields: dict[str, list] = {}  # raw event -> [cpu, gpu, count]
        cached = _EVENT_KEY_CACHE.get
        max_ms, max_count, max_bytes = limits.max_event_ms, limits.max_event_count, limits.max_attribute_bytes
        for kv in kvs:
            key = kv.key
            value = kv.value
            parsed = cached(key, _MISS)
            if parsed is _MISS:
                parsed = _event_key(key)
            if parsed is None:
                val = _kv_value(value, key, max_bytes)
                if key in _ROW_KEYS:
                    ident[key] = val
                elif len(key) > max_bytes:
                    raise _Reject(ATTRIBUTE_TOO_LARGE, f"attribute key of {len(key)} characters")
                continue
            raw_event, slot, to_ms = parsed
            # A oneof member reads as its default (0) unless it is the one set, so a
            # non-zero in-range read proves the type without a WhichOneof call.
            if slot == 2:
                val = value.int_value
                if not 0 < val <= max_count:
                    val = _int_attr({key: _kv_value(value, key, max_bytes)}, key,
                                    allow_string=False, minimum=0, maximum=max_count)
            else:
                val = value.double_value * to_ms
                if not 0.0 < val <= max_ms:
                    val = _ms_value(_kv_value(value, key, max_bytes), key, limits, to_ms)
            entry = fields.get(raw_event)
            if entry is None:
                fields[raw_event] = entry = [None, None, None]
            entry[slot] = val
        run_id, identity = self._span_identity(ident, res)
        step = _int_attr(ident, v.ATTR_STEP, allow_string=False, minimum=0, maximum=limits.max_step)
        if step is None:
            raise _Reject(MISSING_STEP, f"no {v.ATTR_STEP} attribute")
        start_ns, end_ns = span.start_time_unix_nano, span.end_time_unix_nano
        if start_ns == 0 or end_ns == 0:
            raise _Reject(MISSING_TIMESTAMP, "start or end time is zero")
        if end_ns < start_ns:
            raise _Reject(NEGATIVE, "end time before start time")
        events = {}
        for raw, (cpu, gpu, count) in fields.items():
            if cpu is not None or gpu is not None:
                value = _new_object(RawEventValue)
                _set_cpu(value, cpu)
                _set_gpu(value, gpu)
                _set_count(value, count)
                events[raw] = value
        if not events:
            raise _Reject(NO_EVENTS, f"step {step} carries no {v.EVENT_ATTR_PREFIX}*.duration "
                                     f"(or legacy {v.LEGACY_EVENT_ATTR_PREFIX}*_ms) timing attributes")
        memory = None
        if v.ATTR_MEMORY_PEAK_ALLOCATED in ident or v.ATTR_MEMORY_PEAK_RESERVED in ident:
            memory = self._span_memory(ident, run_id, identity.global_rank, step, end_ns / 1e9, res.attempt)
        return StepTimeIngestRecord(
            run_id=run_id,
            identity=identity,
            step=step,
            start_time=start_ns / 1e9,
            sample_time=end_ns / 1e9,
            events=events,
            training_strategy=res.strategy,
            attempt=res.attempt,
        ), memory

    def _span_memory(self, attrs: Mapping, run_id: str, rank: int, step: int,
                     when: float, attempt: int = 0) -> StepMemoryIngestRecord:
        """The step span's peak memory (bytes, per device); an absent peak stays None."""
        cap = self.limits.max_memory_bytes
        allocated, reserved = (_int_attr(attrs, key, allow_string=False, minimum=0, maximum=cap)
                               for key in _MEMORY_PEAK_KEYS)
        device = attrs.get(v.ATTR_DEVICE, "")
        if not isinstance(device, str):
            raise _Reject(WRONG_TYPE, f"{v.ATTR_DEVICE} must be a string, got {device!r}")
        return StepMemoryIngestRecord(run_id=run_id, global_rank=rank, step=step, device=device,
                                      peak_allocated_bytes=allocated, peak_reserved_bytes=reserved,
                                      sample_time=when, attempt=attempt)

    def _run_end_span(self, span, res: _Resource) -> RunEndMarker:
        attrs = _attributes(span.attributes, self.limits)
        run_id, identity = self._span_identity(attrs, res)
        completed = _int_attr(attrs, v.ATTR_STEPS_COMPLETED, allow_string=False, minimum=0,
                              maximum=self.limits.max_step)
        counts: dict[str, int] = {}
        dropped: dict[str, int] = {}
        count_keys = (v.ATTR_STEPS_COMPLETED, v.ATTR_STEP, v.ATTR_RUN_END_EXPORT_FAILURES,
                      v.ATTR_RUN_END_EXPORT_RETRIES)
        for key in attrs:
            if key in count_keys or key.startswith(v.RUN_END_DROPPED_PREFIX):
                value = _int_attr(attrs, key, allow_string=False, minimum=0, maximum=self.limits.max_step)
                counts[key] = value
                queue = key[len(v.RUN_END_DROPPED_PREFIX):]
                if key.startswith(v.RUN_END_DROPPED_PREFIX) and queue in v.QUEUE_NAMES:
                    dropped[queue] = value
        boundary = attrs.get(v.ATTR_STEP_BOUNDARY)
        if boundary.__class__ is str and boundary in v.STEP_BOUNDARIES:  # advisory, like the outcome
            counts[v.ATTR_STEP_BOUNDARY] = boundary  # kept with the marker's counts (final_counts)
        when = (span.end_time_unix_nano or span.start_time_unix_nano) / 1e9
        # How the process ended is advisory: an unknown outcome or a bad exit code is left
        # out (the marker's counts are kept), never a reason to refuse the marker.
        outcome = attrs.get(v.ATTR_RUN_END_OUTCOME)
        exit_code = attrs.get(v.ATTR_RUN_END_EXIT_CODE)
        return RunEndMarker(run_id, identity.global_rank, completed, identity.world_size, when,
                            counts, dropped,
                            outcome=outcome if outcome in MARKER_OUTCOMES else None,
                            exit_code=exit_code if exit_code.__class__ is int and 0 <= exit_code <= 255 else None,
                            attempt=res.attempt)

    # --- metrics --------------------------------------------------------------------------

    def decode_metrics(self, request) -> DecodedBatch:
        """`ExportMetricsServiceRequest` -> drop counts, and per-step memory rows from the
        step-keyed gauges that exporters sent before peak memory moved onto the step span."""
        batch = DecodedBatch(v.SIGNAL_METRICS)
        limits = self.limits
        for part in getattr(request, "unreadable", ()):  # `otlp_read.PartlyReadable`
            batch.reject(part.reason, part.describe("data points"), part.items)
        memory_names = v.LEGACY_MEMORY_METRICS
        unused = (v.METRIC_EXPORT_FAILURES, v.METRIC_EXPORT_RETRIES)
        for resource_metrics in request.resource_metrics:
            res = None
            # (run, rank, step, device) -> [allocated, reserved, time]; the two gauges merge.
            memory: dict[tuple[str, int, int, str], list] = {}
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    name = metric.name
                    points = _data_points(metric)
                    if name not in memory_names and name != v.METRIC_TELEMETRY_DROPPED:
                        n = max(1, len(points))
                        batch.ignored[IGNORED_UNUSED_METRIC if name in unused else IGNORED_FOREIGN] += n
                        continue
                    if res is None:
                        res = _resource_identity(resource_metrics.resource.attributes, limits)
                    if metric.WhichOneof("data") not in ("gauge", "sum"):
                        for _ in points or [None]:
                            batch.reject(WRONG_TYPE, f"{name} must be a gauge or sum, "
                                                     f"got {metric.WhichOneof('data')}")
                        continue
                    for point in points:
                        try:
                            if res.error is not None:
                                raise res.error
                            if name == v.METRIC_TELEMETRY_DROPPED:
                                batch.drops.append(self._drop_point(point, res))
                            else:
                                self._memory_point(point, res, name, memory)
                        except _Reject as exc:
                            batch.reject(exc.reason, f"{name} point: {exc.detail}")
            for (run_id, rank, step, device), (alloc, reserved, when) in memory.items():
                batch.memory_records.append(StepMemoryIngestRecord(
                    run_id=run_id, global_rank=rank, step=step, device=device,
                    peak_allocated_bytes=alloc, peak_reserved_bytes=reserved, sample_time=when))
        return batch

    def _point_value(self, point, name: str) -> float:
        kind = point.WhichOneof("value")
        if kind == "as_int":
            value = point.as_int
        elif kind == "as_double":
            value = point.as_double
        else:
            raise _Reject(WRONG_TYPE, f"{name} data point has no value")
        if isinstance(value, float) and not math.isfinite(value):
            raise _Reject(NON_FINITE, f"{name} is {value}")
        if value < 0:
            raise _Reject(NEGATIVE, f"{name} is {value}")
        return value

    def _memory_point(self, point, res: _Resource, name: str, memory: dict) -> None:
        limits = self.limits
        attrs = _attributes(point.attributes, limits)
        run_id, identity = self._span_identity(attrs, res)
        step = _int_attr(attrs, v.ATTR_STEP, allow_string=False, minimum=0, maximum=limits.max_step)
        if step is None:
            raise _Reject(MISSING_STEP, f"no {v.ATTR_STEP} attribute")
        value = self._point_value(point, name)
        if value > limits.max_memory_bytes:
            raise _Reject(ABSURD, f"{name} is {value} bytes")
        device = attrs.get(v.ATTR_DEVICE, "")
        if not isinstance(device, str):
            raise _Reject(WRONG_TYPE, f"{v.ATTR_DEVICE} must be a string, got {device!r}")
        if point.time_unix_nano == 0:
            raise _Reject(MISSING_TIMESTAMP, "time is zero")
        key = (run_id, identity.global_rank, step, device)
        slot = memory.setdefault(key, [None, None, 0.0])
        slot[0 if name == v.METRIC_MEMORY_PEAK_ALLOCATED else 1] = int(value)
        slot[2] = max(slot[2], point.time_unix_nano / 1e9)

    def _drop_point(self, point, res: _Resource) -> DropReport:
        attrs = _attributes(point.attributes, self.limits)
        run_id, identity = self._span_identity(attrs, res)
        queue = attrs.get(v.ATTR_QUEUE)
        if not isinstance(queue, str) or queue not in v.QUEUE_NAMES:
            raise _Reject(WRONG_TYPE, f"{v.ATTR_QUEUE} must be one of {list(v.QUEUE_NAMES)}, got {queue!r}")
        value = self._point_value(point, v.METRIC_TELEMETRY_DROPPED)
        if value > 2**53:
            raise _Reject(ABSURD, f"dropped count {value}")
        return DropReport(run_id, identity.global_rank, queue, int(value), point.time_unix_nano / 1e9)


def _data_points(metric) -> list:
    kind = metric.WhichOneof("data")
    if kind == "gauge":
        return list(metric.gauge.data_points)
    if kind == "sum":
        return list(metric.sum.data_points)
    if kind == "histogram":
        return list(metric.histogram.data_points)
    if kind == "exponential_histogram":
        return list(metric.exponential_histogram.data_points)
    if kind == "summary":
        return list(metric.summary.data_points)
    return []
