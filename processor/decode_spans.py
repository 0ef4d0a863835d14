"""OTLP trace export requests -> step rows, per-step memory and run-end markers.

The span decoder reads TraceML's step span (`traceml.step`: one pass over its
attributes, event keys parsed once per process) and end marker
(`traceml.run.end`); phase spans and every other span are ignored and counted.
What it hands on is valid: run id, rank, step and timestamps; every duration None
or a finite float in [0, `DecodeLimits.max_event_ms`], one day by default; every
count None or an int in [0, `max_event_count`]; every memory peak None or an int in
[0, `max_memory_bytes`]. A span with any other value is rejected whole, with its
reason (`store_records`); the rest of the request is kept.

Step-span durations arrive in seconds (current exporters) or milliseconds (older
ones, `vocabulary.LEGACY_EVENT_FIELDS`); both leave here in milliseconds, the unit
of the store.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from traceml.processor.decode_attributes import (
    MISS,
    Reject,
    ResourceIdentity,
    attributes,
    int_attr,
    ms_value,
    resource_identity,
    span_identity,
    Unsupported,
)
from traceml.processor.mapping.spans import MappingSet
from traceml.processor.step_time.model import RawEventValue, StepMemoryIngestRecord, StepTimeIngestRecord
from traceml.processor.store_records import (
    ATTRIBUTE_TOO_LARGE,
    IGNORED_FOREIGN,
    IGNORED_PHASE_SPAN,
    MISSING_STEP,
    MISSING_TIMESTAMP,
    NEGATIVE,
    NO_EVENTS,
    TOO_MANY_ATTRIBUTES,
    WRONG_TYPE,
    DecodedBatch,
    RunEndMarker,
)
from traceml.schema import vocabulary as v
from traceml.schema.endings import MARKER_OUTCOMES

if TYPE_CHECKING:
    from traceml.processor.admission import RunAdmission
    from traceml.processor.decode import DecodeLimits


_MEMORY_PEAK_KEYS = (v.ATTR_MEMORY_PEAK_ALLOCATED, v.ATTR_MEMORY_PEAK_RESERVED)
_ROW_KEYS = frozenset({v.ATTR_STEP, v.ATTR_RANK, v.ATTR_RUN_ID, v.ATTR_DEVICE, v.ATTR_TRAINING_STRATEGY,
                       *_MEMORY_PEAK_KEYS})
"""The step span's attributes other than `traceml.event.*` that its rows are built from."""
_KNOWN_STRATEGIES = {name: name for name in v.TRAINING_STRATEGIES}


def _step_strategy(ident: Mapping, resource_strategy: str | None) -> str | None:
    """The step span's `traceml.training.strategy` (what the training side recognised from the
    model, e.g. FSDP, after the resource was fixed) over the resource's; a known name becomes
    the vocabulary's own string, so spans of one rank share one strategy object (`normalise`'s
    identity cache compares by identity)."""
    strategy = ident.get(v.ATTR_TRAINING_STRATEGY)
    if strategy is None:
        return resource_strategy
    if not isinstance(strategy, str):
        raise Reject(WRONG_TYPE, f"{v.ATTR_TRAINING_STRATEGY} must be a string, got {strategy!r}")
    return _KNOWN_STRATEGIES.get(strategy, strategy)


_SLOT = {v.EVENT_FIELD_CPU: 0, v.EVENT_FIELD_GPU: 1, v.EVENT_FIELD_COUNT: 2}
_TO_MS = {v.DURATION_UNIT: 1000.0, v.LEGACY_DURATION_UNIT: 1.0}
"""Milliseconds per wire unit: SQLite and every reader keep milliseconds (the row layout,
the summary's `_ms` fields), so seconds from current exporters and milliseconds from
older ones become the same stored value."""
_EVENT_KEY_CACHE: dict[str, tuple[str, int, float] | None] = {}
_EVENT_KEY_CACHE_MAX = 4096


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
            raise Reject(ATTRIBUTE_TOO_LARGE, f"{key} is {len(val)} characters (cap {max_bytes})")
        return val
    if kind == "bool_value":
        return value.bool_value
    if kind is None:
        return None
    return Unsupported(kind)


_new_object = object.__new__
_set_cpu = RawEventValue.cpu_ms.__set__  # slot descriptors: skip the frozen __setattr__ path
_set_gpu = RawEventValue.gpu_ms.__set__
_set_count = RawEventValue.count.__set__


class SpanDecoder:
    """Stateless per request except for the shared run/rank admission caps."""

    def __init__(self, limits: "DecodeLimits", admission: "RunAdmission", mappings: MappingSet | None = None):
        self.limits = limits
        self.admission = admission
        # The foreign-step mapping layer (`processor/mapping`): the built-in mappings unless told.
        self.mappings = MappingSet() if mappings is None else mappings

    def decode_traces(self, request) -> DecodedBatch:
        """`ExportTraceServiceRequest` -> step rows and run-end markers; spans that are not
        TraceML's go to the mapping layer (`processor/mapping`), which places the steps it
        recognises and counts the rest."""
        batch = DecodedBatch(v.SIGNAL_TRACES)
        limits = self.limits
        mappings = self.mappings
        foreign_steps: list = []
        for part in getattr(request, "unreadable", ()):  # `otlp_read.PartlyReadable`
            batch.reject(part.reason, part.describe("spans"), part.items)
        phase_prefix = v.SPAN_PHASE_PREFIX
        for resource_spans in request.resource_spans:
            # One pass, each name read once: a step's phase children (most of our spans) are
            # only counted, and the rest split into ours and what the mapping layer is offered.
            traceml: list = []
            foreign: list = []
            phase_children = 0
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    name = span.name
                    if not name.startswith("traceml."):
                        foreign.append(span)
                    elif name.startswith(phase_prefix):
                        phase_children += 1
                    else:
                        traceml.append((span, name))
            if phase_children:
                batch.ignored[IGNORED_PHASE_SPAN] += phase_children
            if foreign:
                mappings.offer(resource_spans.resource, foreign, batch, limits, foreign_steps)
            if not traceml:
                continue
            res = resource_identity(resource_spans.resource.attributes, limits)
            for span, name in traceml:
                if name != v.SPAN_STEP and name != v.SPAN_RUN_END:
                    batch.ignored[IGNORED_FOREIGN] += 1
                    continue
                try:
                    if res.error is not None:
                        raise res.error
                    if name == v.SPAN_STEP:
                        record, memory = self._step_span(span, res)
                        batch.step_records.append(record)
                        mappings.own.add(record.run_id, record.identity.global_rank)
                        if memory is not None:
                            batch.memory_records.append(memory)
                    else:
                        batch.run_ends.append(self._run_end_span(span, res))
                    if res.identity is not None and res.identity.world_size is not None:
                        batch.world_sizes[res.run_id] = res.identity.world_size
                except Reject as exc:
                    batch.reject(exc.reason, f"span {name!r}: {exc.detail}")
        if foreign_steps:
            mappings.settle(foreign_steps, batch, limits, self.admission)
        return batch

    def _step_span(self, span, res: ResourceIdentity) -> tuple[StepTimeIngestRecord, StepMemoryIngestRecord | None]:
        """The hot path: one pass over the span's attributes, event keys parsed once per process.

        Returns the step's timing record and, when the span carries a measured peak,
        its memory record (timestamped at the span's end).
        """
        limits = self.limits
        kvs = span.attributes
        if len(kvs) > limits.max_attributes:
            raise Reject(TOO_MANY_ATTRIBUTES, f"{len(kvs)} attributes (cap {limits.max_attributes})")
        ident: dict = {}
        fields: dict[str, list] = {}  # raw event -> [cpu, gpu, count]
        cached = _EVENT_KEY_CACHE.get
        max_ms, max_count, max_bytes = limits.max_event_ms, limits.max_event_count, limits.max_attribute_bytes
        for kv in kvs:
            key = kv.key
            value = kv.value
            parsed = cached(key, MISS)
            if parsed is MISS:
                parsed = _event_key(key)
            if parsed is None:
                val = _kv_value(value, key, max_bytes)
                if key in _ROW_KEYS:
                    ident[key] = val
                elif len(key) > max_bytes:
                    raise Reject(ATTRIBUTE_TOO_LARGE, f"attribute key of {len(key)} characters")
                continue
            raw_event, slot, to_ms = parsed
            # A oneof member reads as its default (0) unless it is the one set, so a
            # non-zero in-range read proves the type without a WhichOneof call.
            if slot == 2:
                val = value.int_value
                if not 0 < val <= max_count:
                    val = int_attr({key: _kv_value(value, key, max_bytes)}, key,
                                    allow_string=False, minimum=0, maximum=max_count)
            else:
                val = value.double_value * to_ms
                if not 0.0 < val <= max_ms:
                    val = ms_value(_kv_value(value, key, max_bytes), key, limits, to_ms)
            entry = fields.get(raw_event)
            if entry is None:
                fields[raw_event] = entry = [None, None, None]
            entry[slot] = val
        run_id, identity = span_identity(ident, res, self.limits, self.admission)
        step = int_attr(ident, v.ATTR_STEP, allow_string=False, minimum=0, maximum=limits.max_step)
        if step is None:
            raise Reject(MISSING_STEP, f"no {v.ATTR_STEP} attribute")
        start_ns, end_ns = span.start_time_unix_nano, span.end_time_unix_nano
        if start_ns == 0 or end_ns == 0:
            raise Reject(MISSING_TIMESTAMP, "start or end time is zero")
        if end_ns < start_ns:
            raise Reject(NEGATIVE, "end time before start time")
        events = {}
        for raw, (cpu, gpu, count) in fields.items():
            if cpu is not None or gpu is not None:
                value = _new_object(RawEventValue)
                _set_cpu(value, cpu)
                _set_gpu(value, gpu)
                _set_count(value, count)
                events[raw] = value
        if not events:
            raise Reject(NO_EVENTS, f"step {step} carries no {v.EVENT_ATTR_PREFIX}*.duration "
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
            training_strategy=_step_strategy(ident, res.strategy),
            attempt=res.attempt,
            trace_id=span.trace_id or None,  # kept for exemplars (the worst step's span)
            span_id=span.span_id or None,
        ), memory

    def _span_memory(self, attrs: Mapping, run_id: str, rank: int, step: int,
                     when: float, attempt: int = 0) -> StepMemoryIngestRecord:
        """The step span's peak memory (bytes, per device); an absent peak stays None."""
        cap = self.limits.max_memory_bytes
        allocated, reserved = (int_attr(attrs, key, allow_string=False, minimum=0, maximum=cap)
                               for key in _MEMORY_PEAK_KEYS)
        device = attrs.get(v.ATTR_DEVICE, "")
        if not isinstance(device, str):
            raise Reject(WRONG_TYPE, f"{v.ATTR_DEVICE} must be a string, got {device!r}")
        return StepMemoryIngestRecord(run_id=run_id, global_rank=rank, step=step, device=device,
                                      peak_allocated_bytes=allocated, peak_reserved_bytes=reserved,
                                      sample_time=when, attempt=attempt)

    def _run_end_span(self, span, res: ResourceIdentity) -> RunEndMarker:
        attrs = attributes(span.attributes, self.limits)
        run_id, identity = span_identity(attrs, res, self.limits, self.admission)
        completed = int_attr(attrs, v.ATTR_STEPS_COMPLETED, allow_string=False, minimum=0,
                              maximum=self.limits.max_step)
        counts: dict[str, int] = {}
        dropped: dict[str, int] = {}
        count_keys = (v.ATTR_STEPS_COMPLETED, v.ATTR_STEP, v.ATTR_RUN_END_EXPORT_FAILURES,
                      v.ATTR_RUN_END_EXPORT_RETRIES)
        for key in attrs:
            if key in count_keys or key.startswith(v.RUN_END_DROPPED_PREFIX):
                value = int_attr(attrs, key, allow_string=False, minimum=0, maximum=self.limits.max_step)
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
