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

Resource metrics (`schema.resources`) leave as `ResourceIngestRecord`s, one value per
(sender, host, device, time) in the convention's unit: a rank's own (run and rank
set), the Collector's `hostmetrics` receiver's and DCGM's exporter's (through the
Collector's Prometheus receiver; run and rank None, joined to runs by host when
stored and read). Per-mode and per-state points are folded here (CPU busy fraction,
`used` memory, CPU seconds busy and total), so a stored value never needs another
point of the same request to mean something. Every value is finite, non-negative and
under its cap (`_RESOURCE_CAPS`: a utilisation at most `MAX_UTILIZATION`, stored at
most 1.0; bytes at most `max_memory_bytes`; temperature, power, CPU counts and CPU
seconds plausible), with a non-zero time.
"""
from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from traceml.processor.resource_folding import ResourceFolder, SampleKey
from traceml.processor.step_time.model import (
    RankIdentity,
    RawEventValue,
    ResourceIngestRecord,
    StepMemoryIngestRecord,
    StepTimeIngestRecord,
)
from traceml.schema import resources as sr
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
IGNORED_NO_VALUE = "no_recorded_value"  # a point flagged "no recorded value" (a Prometheus staleness marker)
IGNORED_UNKNOWN_HOST = "unknown_host"
"""A foreign resource point (`hostmetrics`, DCGM) on a host where no run the store knows has a
rank (or, for a process's figures, no rank with that pid): counted by the ingest queue after
the store said so (`WriteResult.unjoined_resources`), since only the store knows the hosts."""


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
    resource_records: list[ResourceIngestRecord] = field(default_factory=list)
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


# --- resource metrics: what is read, and the caps ------------------------------------------

MAX_UTILIZATION = 1.5
"""Highest utilisation accepted (a fraction): a figure over elapsed time sampled by a busy
host's scheduler can land a little above 1 (a late tick), and is stored as 1.0; one above
1.5 is a sender that did not divide by its CPUs or sent percent, and is rejected."""
MAX_TEMPERATURE_C = 1000.0
MAX_POWER_W = 10_000.0
"""Per device; the largest GPUs draw about a tenth of it."""
MAX_CPU_COUNT = float(1 << 20)
MAX_CPU_SECONDS = 1e13
"""Cumulative CPU seconds summed over a host's CPUs: a thousand CPUs for three centuries."""
_BYTES = None  # cap: `DecodeLimits.max_memory_bytes`

_RESOURCE_CAPS: Mapping[str, float | None] = {
    sr.PROCESS_CPU_UTILIZATION: MAX_UTILIZATION, sr.SYSTEM_CPU_UTILIZATION: MAX_UTILIZATION,
    sr.GPU_UTILIZATION: MAX_UTILIZATION,
    sr.PROCESS_MEMORY_USAGE: _BYTES, sr.SYSTEM_MEMORY_USAGE: _BYTES, sr.SYSTEM_MEMORY_LIMIT: _BYTES,
    sr.GPU_MEMORY_USAGE: _BYTES, sr.GPU_MEMORY_LIMIT: _BYTES,
    sr.CUDA_MEMORY_ALLOCATED: _BYTES, sr.CUDA_MEMORY_RESERVED: _BYTES,
    sr.SYSTEM_CPU_TIME: MAX_CPU_SECONDS, sr.SYSTEM_CPU_TIME_BUSY: MAX_CPU_SECONDS,
    sr.SYSTEM_CPU_TIME_TOTAL: MAX_CPU_SECONDS,
    sr.SYSTEM_CPU_LOGICAL_COUNT: MAX_CPU_COUNT,
    sr.HW_TEMPERATURE: MAX_TEMPERATURE_C, sr.HW_POWER: MAX_POWER_W,
}
"""Every stored resource metric (and `system.cpu.time` as sent) -> its highest plausible value."""
_UTILIZATIONS = frozenset(name for name, cap in _RESOURCE_CAPS.items() if cap == MAX_UTILIZATION)

_RESOURCE_WIRE_NAMES = frozenset(
    (set(sr.STORED_METRICS) - {sr.SYSTEM_CPU_TIME_BUSY, sr.SYSTEM_CPU_TIME_TOTAL})
    | {sr.SYSTEM_CPU_TIME} | set(sr.DCGM_METRICS))
"""Metric names read as resource samples (the stored names as sent, `system.cpu.time`, DCGM's)."""
_HOSTMETRICS_NAMES = frozenset({
    sr.SYSTEM_CPU_UTILIZATION, sr.SYSTEM_CPU_TIME, sr.SYSTEM_CPU_LOGICAL_COUNT, sr.SYSTEM_MEMORY_USAGE,
    sr.SYSTEM_MEMORY_LIMIT, sr.PROCESS_CPU_UTILIZATION, sr.PROCESS_MEMORY_USAGE,
})
"""The names also read from a sender that is not TraceML (the Collector's `hostmetrics`)."""
_GPU_NAMES = frozenset(sr.GPU_METRICS)
_ALLOCATOR_NAMES = frozenset({sr.CUDA_MEMORY_ALLOCATED, sr.CUDA_MEMORY_RESERVED})
_LEGACY_OF = {new: old for old, new in sr.LEGACY_ATTRIBUTES.items()}
_CPU_MODE_KEYS = (sr.ATTR_CPU_MODE, _LEGACY_OF[sr.ATTR_CPU_MODE])
_CPU_NUMBER_KEYS = (sr.ATTR_CPU_LOGICAL_NUMBER, _LEGACY_OF[sr.ATTR_CPU_LOGICAL_NUMBER])
_MEMORY_STATE_KEYS = (sr.ATTR_MEMORY_STATE, _LEGACY_OF[sr.ATTR_CPU_MODE])  # older `state` on memory too
_FLAG_NO_RECORDED_VALUE = 1  # DataPointFlags.DATA_POINT_FLAGS_NO_RECORDED_VALUE_MASK
_MAX_PID = 2**31 - 1


@dataclass(frozen=True, slots=True)
class _Sender:
    """What a resource-metric resource says about its sender, read leniently: a foreign
    resource is judged only on the attributes used (`host.name`, `process.pid`)."""

    traceml: bool  # it names a TraceML run (its points are a rank's own)
    host: str | None
    host_error: _Reject | None
    pid: int | None  # `process.pid` when an int


def _sender(kvs, limits: DecodeLimits) -> _Sender:
    traceml, host, error, pid = False, None, None, None
    for kv in kvs:
        key = kv.key
        if key == v.ATTR_RUN_ID or v.RESOURCE_ALIASES.get(key) == v.ATTR_RUN_ID:
            traceml = True
        elif key == v.RES_HOST_NAME:
            if kv.value.WhichOneof("value") == "string_value":
                text = kv.value.string_value
                if len(text) > limits.max_attribute_bytes:
                    error = _Reject(ATTRIBUTE_TOO_LARGE, f"{key} is {len(text)} characters "
                                                         f"(cap {limits.max_attribute_bytes})")
                else:
                    host = text.strip() or None
        elif key == sr.RES_PROCESS_PID:
            if kv.value.WhichOneof("value") == "int_value" and 0 <= kv.value.int_value <= _MAX_PID:
                pid = kv.value.int_value
    return _Sender(traceml, host, error, pid)


def _str_attr(attrs: Mapping, keys: tuple[str, ...]) -> str | None:
    """The first of `keys` present, a non-empty string (stripped); None when absent or empty."""
    for key in keys:
        value = attrs.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise _Reject(WRONG_TYPE, f"{key} must be a string, got {value!r}")
        return value.strip() or None
    return None


def _label_attr(attrs: Mapping, keys: tuple[str, ...]) -> str | int | None:
    """The first of `keys` present, a string or an integer (a CPU or GPU number, as sent)."""
    for key in keys:
        value = attrs.get(key)
        if value is None:
            continue
        if isinstance(value, str):
            return value.strip()
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Reject(WRONG_TYPE, f"{key} must be a string or an integer, got {value!r}")
    return None


def _judged_resource_value(metric: str, value: float, limits: DecodeLimits) -> float:
    """A finite, non-negative value (checked by the caller) under its metric's cap; a
    utilisation up to `MAX_UTILIZATION` leaves as at most 1.0."""
    cap = _RESOURCE_CAPS[metric]
    if cap is None:
        cap = limits.max_memory_bytes
    if not value <= cap:
        raise _Reject(ABSURD, f"{metric} is {value:g} (cap {cap:g})")
    if value < 0:
        raise _Reject(NEGATIVE, f"{metric} is {value:g}")
    value = float(value)
    return min(value, 1.0) if metric in _UTILIZATIONS else value


def _resource_record(key: SampleKey, device: str, metric: str, value: float) -> ResourceIngestRecord:
    return ResourceIngestRecord(run_id=key.run_id, global_rank=key.global_rank, host=key.host, device=device,
                                metric=metric, sample_time=key.time_ns / 1e9, value=value,
                                source=key.source, pid=key.pid, attempt=key.attempt)


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
        """`ExportMetricsServiceRequest` -> drop counts, resource samples (`schema.resources`:
        a rank's own, `hostmetrics`' and DCGM's), and per-step memory rows from the
        step-keyed gauges that exporters sent before peak memory moved onto the step span."""
        batch = DecodedBatch(v.SIGNAL_METRICS)
        limits = self.limits
        for part in getattr(request, "unreadable", ()):  # `otlp_read.PartlyReadable`
            batch.reject(part.reason, part.describe("data points"), part.items)
        memory_names = v.LEGACY_MEMORY_METRICS
        unused = (v.METRIC_EXPORT_FAILURES, v.METRIC_EXPORT_RETRIES)
        folder = ResourceFolder()  # split points of the whole request, folded at its end
        for resource_metrics in request.resource_metrics:
            res = None
            sender = None
            # (run, rank, step, device) -> [allocated, reserved, time]; the two gauges merge.
            memory: dict[tuple[str, int, int, str], list] = {}
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    name = metric.name
                    points = _data_points(metric)
                    if name in _RESOURCE_WIRE_NAMES:
                        if sender is None:
                            sender = _sender(resource_metrics.resource.attributes, limits)
                            if sender.traceml:
                                res = res or _resource_identity(resource_metrics.resource.attributes, limits)
                        self._resource_metric(metric, name, points, sender, res, resource_metrics, folder, batch)
                        continue
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
        folded, unused_points = folder.fold()
        if unused_points:
            batch.ignored[IGNORED_UNUSED_METRIC] += unused_points
        for item in folded:
            try:
                value = _judged_resource_value(item.metric, item.value, limits)
            except _Reject as exc:
                batch.reject(exc.reason, f"{item.metric} (folded over {item.points} points): {exc.detail}",
                             max(1, item.points))
                continue
            batch.resource_records.append(_resource_record(item.key, "", item.metric, value))
        return batch

    # --- resource metrics (schema.resources) -----------------------------------------------

    def _resource_metric(self, metric, name: str, points: list, sender: "_Sender", res: "_Resource | None",
                         resource_metrics, folder: ResourceFolder, batch: DecodedBatch) -> None:
        """One resource metric's points -> records (or, split by mode or state, into `folder`)."""
        kind = metric.WhichOneof("data")
        if kind not in ("gauge", "sum"):
            for _ in points or [None]:
                batch.reject(WRONG_TYPE, f"{name} must be a gauge or sum, got {kind}")
            return
        for point in points:
            if point.flags & _FLAG_NO_RECORDED_VALUE:
                batch.ignored[IGNORED_NO_VALUE] += 1
                continue
            try:
                attrs = _attributes(point.attributes, self.limits)
                if res is None and not sender.traceml and attrs.get(v.ATTR_RUN_ID) is not None:
                    res = _resource_identity(resource_metrics.resource.attributes, self.limits)
                ignored = self._resource_point(point, name, attrs, sender, res, folder, batch)
                if ignored is not None:
                    batch.ignored[ignored] += 1
            except _Reject as exc:
                batch.reject(exc.reason, f"{name} point: {exc.detail}")

    def _resource_point(self, point, name: str, attrs: dict, sender: "_Sender", res: "_Resource | None",
                        folder: ResourceFolder, batch: DecodedBatch) -> str | None:
        """Judge one point and store or fold it; returns the reason it was ignored, if it was."""
        dcgm = sr.DCGM_METRICS.get(name)
        if dcgm is not None:
            return self._dcgm_point(point, name, dcgm, attrs, sender, batch)
        if sender.traceml or attrs.get(v.ATTR_RUN_ID) is not None:
            if res.error is not None:
                raise res.error
            run_id, identity = self._span_identity(attrs, res)
            if sender.host_error is not None:
                raise sender.host_error
            key_head = (sr.SOURCE_TRACEML, run_id, identity.global_rank, sender.host or "", sender.pid,
                        res.attempt)
        elif name in _HOSTMETRICS_NAMES:
            if sender.host_error is not None:
                raise sender.host_error
            if not sender.host:
                return IGNORED_FOREIGN  # nothing to join it to a run by
            key_head = (sr.SOURCE_HOSTMETRICS, None, None, sender.host, sender.pid, 0)
        else:
            return IGNORED_FOREIGN  # a GPU or allocator figure only a rank's own sampler sends
        time_ns = point.time_unix_nano
        if time_ns == 0:
            raise _Reject(MISSING_TIMESTAMP, "time is zero")
        value = _judged_resource_value(name, self._point_value(point, name), self.limits)
        key = SampleKey(*key_head, time_ns)
        if name == sr.SYSTEM_CPU_UTILIZATION or name == sr.SYSTEM_CPU_TIME:
            mode = _str_attr(attrs, _CPU_MODE_KEYS)
            cpu = _label_attr(attrs, _CPU_NUMBER_KEYS)
            add = folder.add_cpu_utilization if name == sr.SYSTEM_CPU_UTILIZATION else folder.add_cpu_time
            add(key, cpu, mode, value)
        elif name == sr.SYSTEM_MEMORY_USAGE:
            state = _str_attr(attrs, _MEMORY_STATE_KEYS)
            if state is None:
                return IGNORED_UNUSED_METRIC  # which part of the memory: unknown
            folder.add_memory_usage(key, state, value)
        elif name == sr.PROCESS_CPU_UTILIZATION:
            folder.add_process_cpu(key, _str_attr(attrs, _CPU_MODE_KEYS), value)
        else:
            device = ""
            if name in _GPU_NAMES:
                hw_type = attrs.get(sr.ATTR_HW_TYPE)
                if hw_type is not None and hw_type != sr.HW_TYPE_GPU:
                    return IGNORED_UNUSED_METRIC  # another component's temperature or power
                device = _str_attr(attrs, (sr.ATTR_HW_ID,)) or ""
            elif name in _ALLOCATOR_NAMES:
                device = _str_attr(attrs, (v.ATTR_DEVICE,)) or ""
            if name == sr.SYSTEM_MEMORY_LIMIT:
                folder.saw_memory_limit(key)
            batch.resource_records.append(_resource_record(key, device, name, value))
        return None

    def _dcgm_point(self, point, name: str, dcgm: tuple[str, float], attrs: dict, sender: "_Sender",
                    batch: DecodedBatch) -> str | None:
        """A DCGM exporter field as the Collector's Prometheus receiver passes it on: the host
        from its `Hostname` label (else the resource's `host.name`), the device from `UUID`
        (else `index:<gpu>`), the value scaled to the convention's unit."""
        metric, factor = dcgm
        host = _str_attr(attrs, (sr.DCGM_LABEL_HOST,))
        if host is None:
            if sender.host_error is not None:
                raise sender.host_error
            host = sender.host
        if not host:
            return IGNORED_FOREIGN
        device = _str_attr(attrs, (sr.DCGM_LABEL_UUID,))
        if device is None:
            index = _label_attr(attrs, (sr.DCGM_LABEL_INDEX,))
            if index is None:
                return IGNORED_UNUSED_METRIC  # a GPU figure that names no GPU
            device = f"{sr.DEVICE_INDEX_PREFIX}{index}"
        if point.time_unix_nano == 0:
            raise _Reject(MISSING_TIMESTAMP, "time is zero")
        value = _judged_resource_value(metric, self._point_value(point, name) * factor, self.limits)
        key = SampleKey(sr.SOURCE_DCGM, None, None, host, None, 0, point.time_unix_nano)
        batch.resource_records.append(_resource_record(key, device, metric, value))
        return None

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
