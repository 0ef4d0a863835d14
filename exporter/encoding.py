"""Records -> OTLP protobuf messages, built directly (no SDK tracer, meter or encoder).

Why not the SDK objects: measured here, an SDK span costs about 30 us to create and
35 us to encode, so a step with six phase children (seven spans) would cost about
240 us of background CPU; building the protobuf messages directly costs about a
third of that, and the step spans, written as protobuf bytes (`encode_step_spans`, the
bytes protobuf would serialise), about a third of the messages again. The metrics are the cumulative telemetry counters and the resource
sampler's figures (`schema.resources`: gauges and non-monotonic cumulative sums), all
with bounded attributes (run, rank, one closed set or one device): per-step peak
memory rides on the step span, so nothing here makes a new metric series per step.

Durations go out in seconds (`traceml.phase.<phase>.cpu.duration`), as OpenTelemetry's
conventions use; the samplers measure milliseconds, divided here by 1000 (a
correctly rounded division: the processor's `* 1000` gives the measured value back
to within one unit in the last place). Users see phase names (`forward`), never the
raw `_traceml_internal:` names; the traced-step event has no phase child, since
the step span itself covers it.

Span and trace ids are derived from (run, step[, rank, child index]) so a re-sent
step carries the same ids, and every rank's span for step N shares one trace;
unless the job had its own OpenTelemetry span active when the step began: then the
step span is that span's child, in its trace.
"""
from __future__ import annotations

import hashlib
import os
import struct
import sys
from typing import Mapping, Sequence

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from .identity import RunIdentity
from traceml.records import ResolvedStepTime, ResourceSnapshot, StepMemorySnapshot
from traceml.schema import resources as r
from traceml.schema import vocabulary as v
from traceml.schema.distribution import package_version

from .settings import ExporterSettings

SCOPE_VERSION = package_version()
_SPAN_KIND_INTERNAL = trace_pb2.Span.SpanKind.SPAN_KIND_INTERNAL
_CUMULATIVE = metrics_pb2.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
_SPECS = {spec.name: spec for spec in (*v.TRAINING_METRICS, *r.RESOURCE_METRICS)}
_SUM_KINDS = {"counter": True, "updowncounter": False}  # kind -> is_monotonic (cumulative sums)
_CACHE_MAX = 256
_FLAGS_HAS_IS_REMOTE = trace_pb2.SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_FLAGS_IS_REMOTE = trace_pb2.SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
_OTEL_TRACE = "opentelemetry.trace"
_UNSET_SERVICE_PREFIX = "unknown_service"
_WHOLE_STEP = v.RAW_STEP_TIME


def any_value(value) -> common_pb2.AnyValue:
    if isinstance(value, bool):
        return common_pb2.AnyValue(bool_value=value)
    if isinstance(value, int):
        return common_pb2.AnyValue(int_value=value)
    if isinstance(value, float):
        return common_pb2.AnyValue(double_value=value)
    return common_pb2.AnyValue(string_value=str(value))


def key_values(attributes: Mapping[str, object]) -> list[common_pb2.KeyValue]:
    return [common_pb2.KeyValue(key=k, value=any_value(val)) for k, val in attributes.items()]


def user_provider_resource() -> dict[str, object]:
    """Scalar attributes of the job's own global SDK TracerProvider's resource, else {}.

    Read only when the job imported OpenTelemetry itself (never imported here); a
    provider without a resource (the API's default proxy) gives {}. `telemetry.*`
    is left out: it describes the SDK (and agent) that made the job's spans, not
    what made TraceML's.
    """
    otel = sys.modules.get(_OTEL_TRACE)
    if otel is None:
        return {}
    try:
        attributes = getattr(getattr(otel.get_tracer_provider(), "resource", None), "attributes", None) or {}
        return {key: value for key, value in attributes.items()
                if isinstance(key, str) and not key.startswith(v.TELEMETRY_PREFIX)
                and isinstance(value, (str, bool, int, float))}
    except Exception:  # someone else's provider must never stop the export
        return {}


def resource_attributes(identity: RunIdentity, settings: ExporterSettings,
                        user_resource: Mapping[str, object] | None = None) -> dict[str, object]:
    """The rank's resource, merged with the job's own OpenTelemetry resource.

    Precedence, lowest first: `OTEL_RESOURCE_ATTRIBUTES`; the job's SDK TracerProvider
    resource (`user_resource`: the SDK built it from the same variables plus what the
    code passed, so it is the job's final word); then TraceML's identity keys, which
    always win. `service.name`: the job's resource unless the SDK only defaulted it
    (`unknown_service...`), else `OTEL_SERVICE_NAME`, else `service.name` from
    `OTEL_RESOURCE_ATTRIBUTES`, else `traceml-training`. `service.instance.id`: the
    job's own when it set one, so TraceML's spans and the job's share an instance;
    else `{run_id}-rank{rank}`. `host.name`: the job's when it set one (a pod's hostname
    is the pod's, so on Kubernetes the node's name set through the downward API is what
    names the machine the fleet view and the repeat-offender rule count), else the detected
    hostname, as an OTel resource detector's value yields to the user's. `telemetry.*`
    always says what made these spans.
    """
    user = dict(user_resource or {})
    attrs: dict[str, object] = dict(settings.resource_attributes)
    attrs.update(user)
    user_service = user.get(v.RES_SERVICE_NAME)
    if not isinstance(user_service, str) or user_service.startswith(_UNSET_SERVICE_PREFIX):
        user_service = None
    attrs[v.RES_SERVICE_NAME] = (user_service or settings.service_name
                                 or settings.resource_attributes.get(v.RES_SERVICE_NAME)
                                 or v.DEFAULT_SERVICE_NAME)
    attrs[v.RES_SERVICE_INSTANCE_ID] = attrs.get(v.RES_SERVICE_INSTANCE_ID) or identity.service_instance_id
    attrs[v.RES_HOST_NAME] = _nonempty_str(attrs.get(v.RES_HOST_NAME)) or identity.hostname
    attrs[v.ATTR_RUN_ID] = identity.run_id
    attrs[v.ATTR_RANK] = identity.rank
    attrs[v.ATTR_LOCAL_RANK] = identity.local_rank
    attrs[v.ATTR_NODE_RANK] = identity.node_rank
    attrs[v.ATTR_WORLD_SIZE] = identity.world_size
    attrs[v.ATTR_LOCAL_WORLD_SIZE] = identity.local_world_size
    attrs[v.ATTR_TRAINING_STRATEGY] = identity.strategy
    attrs[v.ATTR_RUN_ATTEMPT] = identity.attempt
    attrs[r.RES_PROCESS_PID] = os.getpid()  # how a foreign `process.*` sender's points find the rank
    attrs.update(telemetry_attributes())
    return attrs


def _nonempty_str(value: object) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def telemetry_attributes() -> dict[str, str]:
    """`telemetry.sdk.*` and `telemetry.distro.*`: TraceML's encoder made these spans (not
    the OpenTelemetry SDK, whose reserved name `opentelemetry` is not claimed), and
    TraceML is the agent that instrumented the job; both at the package's version."""
    version = package_version()
    return {v.RES_TELEMETRY_SDK_NAME: v.TELEMETRY_SDK_NAME, v.RES_TELEMETRY_SDK_LANGUAGE: v.TELEMETRY_SDK_LANGUAGE,
            v.RES_TELEMETRY_SDK_VERSION: version, v.RES_TELEMETRY_DISTRO_NAME: v.TELEMETRY_DISTRO_NAME,
            v.RES_TELEMETRY_DISTRO_VERSION: version}


def _id(nbytes: int, *parts: object) -> bytes:
    digest = hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=nbytes).digest()
    return digest if any(digest) else b"\x01" * nbytes  # all-zero ids are invalid in OTLP


def _id_of(nbytes: int, data: bytes) -> bytes:
    """`_id` of parts already joined and encoded (the encoder keeps the per-rank prefix)."""
    digest = _blake2b(data, digest_size=nbytes).digest()
    return digest if digest.strip(b"\0") else b"\x01" * nbytes


# --- protobuf wire format, written directly -------------------------------------------
# The step spans are written as bytes (issue 37: building the messages cost about 65 us of
# the exporter thread per step, writing the bytes about a quarter of that). Fields go out
# in the order protobuf's own serializer writes them, so the bytes are the ones
# `SerializeToString` gives for the same message (tests/exporter/test_span_bytes.py).

_VARINT_1 = [bytes((n,)) for n in range(128)]
_INDEX_TEXT = [str(n).encode() for n in range(64)]  # a phase child's index, as its id's input spells it
_blake2b = hashlib.blake2b
_PACK_D = struct.Struct("<d").pack
_PACK_Q = struct.Struct("<Q").pack
_PACK_TIMES = struct.Struct("<BQBQ").pack  # start (field 7) and end (field 8), both fixed64


def _varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _VARINT_1[n]
    if 0 < n < 16384:  # span lengths, step numbers
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    if not -(1 << 63) <= n < (1 << 63):
        raise ValueError(f"{n} is out of int64's range")
    if n < 0:
        n += 1 << 64  # int64 as protobuf writes it: two's complement, ten bytes
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    return tag + _varint(len(payload)) + payload


def _attribute(kv: common_pb2.KeyValue) -> bytes:
    """A KeyValue as a span's `attributes` field (9)."""
    return _field(b"\x4a", kv.SerializeToString())


def _int_attribute_head(key: str) -> tuple[bytes, int]:
    """(the bytes of an int attribute before its value's varint, the length the KeyValue has
    without that varint): the value's varint length completes both lengths."""
    key_field = _field(b"\x0a", key.encode())
    return key_field, len(key_field) + 3  # value field tag + AnyValue length + int_value tag


def _int_attribute(head: tuple[bytes, int], value: int) -> bytes:
    value_bytes = _varint(value)
    n = len(value_bytes)
    return (b"\x4a" + _varint(head[1] + n) + head[0] + b"\x12" + _VARINT_1[n + 1] + b"\x18"
            + value_bytes)


def _double_attribute_head(key: str) -> bytes:
    """An attribute whose value is a double, up to the value's 8 bytes (its length is fixed)."""
    key_field = _field(b"\x0a", key.encode())
    return b"\x4a" + _varint(len(key_field) + 11) + key_field + b"\x12\x09\x21"


_STEP_HEAD = _int_attribute_head(v.ATTR_STEP)
_KIND_INTERNAL = b"\x30" + _varint(_SPAN_KIND_INTERNAL)
_PEAK_ALLOCATED_HEAD = _int_attribute_head(v.ATTR_MEMORY_PEAK_ALLOCATED)
_PEAK_RESERVED_HEAD = _int_attribute_head(v.ATTR_MEMORY_PEAK_RESERVED)


def _times(start_ns: int, end_ns: int) -> bytes:
    """Start and end (fields 7 and 8, fixed64); a zero is left out, as protobuf does."""
    if start_ns and end_ns:
        return _PACK_TIMES(0x39, start_ns, 0x41, end_ns)
    return (b"\x39" + _PACK_Q(start_ns) if start_ns else b"") + (b"\x41" + _PACK_Q(end_ns) if end_ns else b"")


class EncodedRequest:
    """An OTLP request already serialised (the exporter's step spans): the transports send
    `SerializeToString()` of what they are given, a message or this."""

    __slots__ = ("body",)

    def __init__(self, body: bytes):
        self.body = body

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name, which the transports call)
        return self.body


def collective_last_entry(record: ResolvedStepTime) -> float | None:
    """Seconds from the step's first timed event to the start of its last collective wait (None: none)."""
    if v.RAW_COLLECTIVE_WAIT not in record.events:
        return None
    starts = [phase.start_time_ns for phase in record.phases if phase.raw_event == v.RAW_COLLECTIVE_WAIT]
    return max(0, max(starts) - record.start_time_ns) / 1e9 if starts else None


def parent_of(span_context) -> tuple[bytes, bytes, int, str] | None:
    """(trace id, parent span id, span flags, trace state) of the job's span active when
    the step began, or None (no OpenTelemetry, no span active, or not a valid context).

    `span_context` is an OpenTelemetry `SpanContext`, read by duck typing: the
    instrumentation captured it without importing OpenTelemetry. Flags carry the
    parent's W3C trace flags and whether it is remote, as OTLP's `Span.flags` says.
    """
    if span_context is None:
        return None
    try:
        if not span_context.is_valid:
            return None
        flags = (int(span_context.trace_flags) & 0xFF) | _FLAGS_HAS_IS_REMOTE
        if span_context.is_remote:
            flags |= _FLAGS_IS_REMOTE
        trace_state = span_context.trace_state
        return (int(span_context.trace_id).to_bytes(16, "big"), int(span_context.span_id).to_bytes(8, "big"),
                flags, trace_state.to_header() if trace_state else "")
    except Exception:  # not a SpanContext after all: the step stays a root span
        return None


class OtlpEncoder:
    """Builds the protobuf requests for one rank.

    Holds only per-rank constants and small caches keyed by raw event name and device
    (capped at `_CACHE_MAX` entries): nothing grows with the number of steps.
    """

    def __init__(self, identity: RunIdentity, settings: ExporterSettings):
        self.identity = identity
        self.settings = settings
        self.phase_spans = settings.phase_spans
        self._resource: resource_pb2.Resource | None = None
        self.scope = common_pb2.InstrumentationScope(name=v.INSTRUMENTATION_SCOPE, version=SCOPE_VERSION)
        self._run_kv = common_pb2.KeyValue(key=v.ATTR_RUN_ID, value=any_value(identity.run_id))
        self._rank_kv = common_pb2.KeyValue(key=v.ATTR_RANK, value=any_value(identity.rank))
        self._strategy_kv: common_pb2.KeyValue | None = None  # the step span's, once one is sent
        self._event_keys: dict[str, tuple[str, str, str]] = {}
        self._resource_kvs: dict[tuple[str, str], common_pb2.KeyValue] = {}
        # The step spans' constant parts, as bytes (see `encode_step_spans`).
        self._span_id_prefix = f"{identity.run_id}\0{identity.rank}\0".encode()
        self._trace_id_prefix = f"{identity.run_id}\0".encode()
        self._run_attr = _attribute(self._run_kv)
        self._rank_attr = _attribute(self._rank_kv)
        self._step_name = _field(b"\x2a", v.SPAN_STEP.encode()) + _KIND_INTERNAL
        self._event_heads: dict[str, tuple[bytes, bytes, tuple[bytes, int], bytes]] = {}
        self._phase_parts: dict[str, tuple[bytes, bytes]] = {}  # raw event -> (name and kind, phase attribute)
        self._device_attrs: dict[str, bytes] = {}
        self._strategy_attr: tuple[str, bytes] | None = None
        self._request_head: tuple[bytes, bytes] | None = None  # resource and scope fields, once built

    @property
    def resource(self) -> resource_pb2.Resource:
        """Built on first use, on the export thread: by the first step's export the job has
        usually set up its own TracerProvider, whose resource this one merges with."""
        if self._resource is None:
            self._resource = resource_pb2.Resource(attributes=key_values(
                resource_attributes(self.identity, self.settings, user_provider_resource())))
        return self._resource

    # --- traces ------------------------------------------------------------------------

    def _keys(self, raw_event: str) -> tuple[str, str, str]:
        keys = self._event_keys.get(raw_event)
        if keys is None:
            keys = (v.event_attribute(raw_event, v.EVENT_FIELD_CPU),
                    v.event_attribute(raw_event, v.EVENT_FIELD_GPU),
                    v.event_attribute(raw_event, v.EVENT_FIELD_COUNT))
            if len(self._event_keys) < _CACHE_MAX:
                self._event_keys[raw_event] = keys
        return keys

    def add_step_spans(self, spans, record: ResolvedStepTime, memory: StepMemorySnapshot | None = None) -> int:
        """Append the step span and its phase children to `spans` (a repeated Span field) in place.

        The messages `encode_step_spans` writes as bytes, for callers that want messages (the
        exporter sends the bytes). Returns the number of spans added.
        """
        encoded: list[bytes] = []
        added = self.encode_step_spans(encoded, record, memory)
        for span in encoded:
            spans.add().MergeFromString(span)
        return added

    def encode_step_spans(self, out: list, record: ResolvedStepTime,
                          memory: StepMemorySnapshot | None = None) -> int:
        """Append the step span and its phase children to `out`, each a serialised `Span`.

        `memory` is the step's peak-memory snapshot when the exporter has it: its measured
        peaks and device go on the step span (None peaks add nothing). Only what varies per
        step is written here (ids, times, values); names, keys and the run and rank attributes
        are bytes kept per rank. Returns the number of spans added.
        """
        step = record.step
        step_text = str(step).encode()
        span_id = _id_of(8, self._span_id_prefix + step_text)
        parent = parent_of(record.parent)
        step_attr = _int_attribute(_STEP_HEAD, step)
        parts = [self._run_attr, self._rank_attr, step_attr]
        heads = self._event_heads
        for raw_event, totals in record.events.items():
            head = heads.get(raw_event)
            if head is None:
                cpu_key, gpu_key, count_key = self._keys(raw_event)
                count_head = _int_attribute_head(count_key)
                head = (_double_attribute_head(cpu_key), _double_attribute_head(gpu_key), count_head,
                        _int_attribute(count_head, 1))  # a region once a step: the usual count
                if len(heads) < _CACHE_MAX:
                    heads[raw_event] = head
            parts += (head[0], _PACK_D(totals.cpu_ms / 1000.0))
            if totals.gpu_ms is not None:
                parts += (head[1], _PACK_D(totals.gpu_ms / 1000.0))
            count = int(totals.count)
            parts.append(head[3] if count == 1 else _int_attribute(head[2], count))
        last_entry = collective_last_entry(record)
        if last_entry is not None:
            parts.append(_double_attribute_head(v.ATTR_COLLECTIVE_LAST_ENTRY) + _PACK_D(last_entry))
        if memory is not None:
            self._memory_attributes(parts, memory)
        strategy = record.strategy
        if strategy is not None and strategy != self.identity.strategy:
            kept = self._strategy_attr
            if kept is None or kept[0] != strategy:
                kept = self._strategy_attr = (strategy, _attribute(self._step_strategy_kv(strategy)))
            parts.append(kept[1])
        attributes = b"".join(parts)
        if parent is None:
            trace_id = _id_of(16, self._trace_id_prefix + step_text)
            head = b"\x0a\x10" + trace_id + b"\x12\x08" + span_id
            flags = 0
        else:
            trace_id, parent_span_id, flags, trace_state = parent
            head = b"\x0a\x10" + trace_id + b"\x12\x08" + span_id
            if trace_state:
                head += _field(b"\x1a", trace_state.encode())
            head += b"\x22\x08" + parent_span_id
        span = head + self._step_name + _times(record.start_time_ns, record.end_time_ns) + attributes
        if flags:
            span += b"\x85\x01" + struct.pack("<I", flags)  # flags (16, fixed32)
        out.append(span)
        if not self.phase_spans:
            return 1
        added = 1
        child_head = b"\x0a\x10" + trace_id
        child_parent = b"\x22\x08" + span_id
        child_attrs = self._rank_attr + step_attr
        id_prefix = self._span_id_prefix + step_text + b"\0"
        names = self._phase_parts
        for index, phase in enumerate(record.phases):
            raw_event = phase.raw_event
            if raw_event == _WHOLE_STEP:
                continue  # the step span itself: a child would only repeat it
            cached = names.get(raw_event)
            if cached is None:
                name = v.phase_name(raw_event)
                phase_kv = common_pb2.KeyValue(key=v.ATTR_PHASE, value=common_pb2.AnyValue(string_value=name))
                cached = (_field(b"\x2a", (v.SPAN_PHASE_PREFIX + name).encode()) + _KIND_INTERNAL,
                          _attribute(phase_kv))
                if len(names) < _CACHE_MAX:
                    names[raw_event] = cached
            added += 1
            index_text = _INDEX_TEXT[index] if index < len(_INDEX_TEXT) else str(index).encode()
            out.append(child_head + b"\x12\x08" + _id_of(8, id_prefix + index_text) + child_parent
                       + cached[0] + _times(phase.start_time_ns, phase.end_time_ns) + child_attrs + cached[1])
        return added

    def _memory_attributes(self, parts: list, memory: StepMemorySnapshot) -> None:
        """The device and each measured peak (bytes); nothing at all when no peak was measured."""
        allocated, reserved = memory.peak_allocated_bytes, memory.peak_reserved_bytes
        if allocated is None and reserved is None:
            return
        device_attr = self._device_attrs.get(memory.device)
        if device_attr is None:
            device_attr = _attribute(common_pb2.KeyValue(key=v.ATTR_DEVICE, value=any_value(str(memory.device))))
            if len(self._device_attrs) < _CACHE_MAX:
                self._device_attrs[memory.device] = device_attr
        parts.append(device_attr)
        if allocated is not None:
            parts.append(_int_attribute(_PEAK_ALLOCATED_HEAD, int(allocated)))
        if reserved is not None:
            parts.append(_int_attribute(_PEAK_RESERVED_HEAD, int(reserved)))

    def _step_strategy_kv(self, strategy: str) -> common_pb2.KeyValue:
        """`traceml.training.strategy` on the step span: the strategy the training side recognised
        from the model (FSDP, `traceml.sharding`) where it differs from the resource's, which was
        fixed before the model existed; the processor prefers the step's."""
        kv = self._strategy_kv
        if kv is None or kv.value.string_value != strategy:
            kv = self._strategy_kv = common_pb2.KeyValue(key=v.ATTR_TRAINING_STRATEGY,
                                                         value=any_value(strategy))
        return kv

    def run_end_span(self, start_ns: int, end_ns: int, steps_completed: int, last_step: int | None,
                     dropped: Mapping[str, int], failures: int, retries: int,
                     ending=None) -> trace_pb2.Span:
        """`ending`: how the script ended (`process_ending.ProcessEnding`), when it was noted."""
        run_id, rank = self.identity.run_id, self.identity.rank
        attrs: dict[str, object] = {v.ATTR_RUN_ID: run_id, v.ATTR_RANK: rank,
                                    v.ATTR_STEPS_COMPLETED: int(steps_completed)}
        if last_step is not None:
            attrs[v.ATTR_STEP] = int(last_step)
        for queue in v.QUEUE_NAMES:
            attrs[v.run_end_dropped_attribute(queue)] = int(dropped.get(queue, 0))
        attrs[v.ATTR_RUN_END_EXPORT_FAILURES] = int(failures)
        attrs[v.ATTR_RUN_END_EXPORT_RETRIES] = int(retries)
        if ending is not None:
            attrs[v.ATTR_RUN_END_OUTCOME] = str(ending.outcome)
            if ending.exit_code is not None:
                attrs[v.ATTR_RUN_END_EXIT_CODE] = int(ending.exit_code)
        return trace_pb2.Span(
            trace_id=_id(16, run_id, "run.end"), span_id=_id(8, run_id, rank, "run.end"),
            name=v.SPAN_RUN_END, kind=_SPAN_KIND_INTERNAL,
            start_time_unix_nano=start_ns, end_time_unix_nano=max(end_ns, start_ns),
            attributes=key_values(attrs))

    def new_trace_request(self):
        """(empty request carrying this rank's resource and scope, its repeated `spans` field)."""
        request = trace_service_pb2.ExportTraceServiceRequest()
        resource_spans = request.resource_spans.add()
        resource_spans.resource.CopyFrom(self.resource)
        scope_spans = resource_spans.scope_spans.add()
        scope_spans.scope.CopyFrom(self.scope)
        return request, scope_spans.spans

    def trace_request_bytes(self, spans: Sequence[bytes]) -> bytes:
        """A serialised ExportTraceServiceRequest of this rank's resource and scope around `spans`
        (serialised Spans, as `encode_step_spans` writes them)."""
        head = self._request_head
        if head is None:
            head = self._request_head = (_field(b"\x0a", self.resource.SerializeToString()),
                                         _field(b"\x0a", self.scope.SerializeToString()))
        scope_spans = head[1] + b"".join([b"\x12" + _varint(len(span)) + span for span in spans])
        return _field(b"\x0a", head[0] + _field(b"\x12", scope_spans))

    def trace_request(self, spans: Sequence[trace_pb2.Span]) -> trace_service_pb2.ExportTraceServiceRequest:
        request, target = self.new_trace_request()
        target.extend(spans)
        return request

    # --- metrics -----------------------------------------------------------------------

    def new_metrics_batch(self) -> "MetricsBatch":
        return MetricsBatch(self)

    def add_counter_points(self, batch: "MetricsBatch", name: str, attribute: str, values: Mapping[str, int],
                           start_ns: int, now_ns: int) -> int:
        points = batch.points(name)
        for label, count in values.items():
            points.add(start_time_unix_nano=start_ns, time_unix_nano=now_ns, as_int=int(count),
                       attributes=(self._run_kv, self._rank_kv,
                                   common_pb2.KeyValue(key=attribute, value=any_value(label))))
        return len(values)

    def _kv(self, key: str, value: str) -> common_pb2.KeyValue:
        """A cached string attribute (modes, states, the device): a handful per rank."""
        kv = self._resource_kvs.get((key, value))
        if kv is None:
            kv = common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value))
            if len(self._resource_kvs) < _CACHE_MAX:
                self._resource_kvs[(key, value)] = kv
        return kv

    def add_resource_points(self, batch: "MetricsBatch", snapshot: ResourceSnapshot, start_ns: int) -> int:
        """One resource snapshot's points (`schema.resources.RESOURCE_METRICS`); returns how many.

        A field that was not measured (None) sends no point, so an absent GPU or a rank
        other than the node's local rank 0 shows as no series, never as zeros. Sums are
        cumulative from `start_ns` (the exporter's start), gauges carry only their time.
        Every point has run and rank, as the telemetry counters do. All of a snapshot's
        values are converted before its first point is added: a bad one adds nothing.
        """
        gauges: list[tuple[str, float, tuple]] = []
        levels: list[tuple[str, int, tuple]] = []
        if snapshot.process_cpu_utilization is not None:
            gauges.append((r.PROCESS_CPU_UTILIZATION, float(snapshot.process_cpu_utilization), ()))
        if snapshot.process_rss_bytes is not None:
            levels.append((r.PROCESS_MEMORY_USAGE, int(snapshot.process_rss_bytes), ()))
        for mode, share in (snapshot.host_cpu_modes or {}).items():
            gauges.append((r.SYSTEM_CPU_UTILIZATION, float(share), (self._kv(r.ATTR_CPU_MODE, str(mode)),)))
        if snapshot.host_cpu_count is not None:
            levels.append((r.SYSTEM_CPU_LOGICAL_COUNT, int(snapshot.host_cpu_count), ()))
        states = dict(snapshot.host_memory_by_state or {})
        if snapshot.host_memory_used_bytes is not None:
            states.setdefault(r.MEMORY_STATE_USED, snapshot.host_memory_used_bytes)
        for state, size in states.items():
            levels.append((r.SYSTEM_MEMORY_USAGE, int(size), (self._kv(r.ATTR_MEMORY_STATE, str(state)),)))
        if snapshot.host_memory_total_bytes is not None:
            levels.append((r.SYSTEM_MEMORY_LIMIT, int(snapshot.host_memory_total_bytes), ()))
        gpu = snapshot.gpu
        if gpu is not None:
            hw = (self._kv(r.ATTR_HW_ID, str(gpu.hw_id)), self._kv(r.ATTR_HW_TYPE, r.HW_TYPE_GPU))
            if gpu.utilization is not None:
                gauges.append((r.GPU_UTILIZATION, float(gpu.utilization), hw))
            if gpu.memory_used_bytes is not None:
                levels.append((r.GPU_MEMORY_USAGE, int(gpu.memory_used_bytes), hw))
            if gpu.memory_total_bytes is not None:
                levels.append((r.GPU_MEMORY_LIMIT, int(gpu.memory_total_bytes), hw))
            if gpu.temperature_c is not None:
                gauges.append((r.HW_TEMPERATURE, float(gpu.temperature_c), hw))
            if gpu.power_w is not None:
                gauges.append((r.HW_POWER, float(gpu.power_w), hw))
        if snapshot.cuda_device is not None:
            device = (self._kv(v.ATTR_DEVICE, str(snapshot.cuda_device)),)
            if snapshot.cuda_allocated_bytes is not None:
                levels.append((r.CUDA_MEMORY_ALLOCATED, int(snapshot.cuda_allocated_bytes), device))
            if snapshot.cuda_reserved_bytes is not None:
                levels.append((r.CUDA_MEMORY_RESERVED, int(snapshot.cuda_reserved_bytes), device))
        now = int(snapshot.time_ns)
        run_rank = (self._run_kv, self._rank_kv)
        for name, value, extra in gauges:
            batch.points(name).add(time_unix_nano=now, as_double=value, attributes=(*run_rank, *extra))
        for name, value, extra in levels:
            batch.points(name).add(start_time_unix_nano=start_ns, time_unix_nano=now, as_int=value,
                                   attributes=(*run_rank, *extra))
        return len(gauges) + len(levels)


class MetricsBatch:
    """One ExportMetricsServiceRequest being filled in place, each metric created on first use
    as its spec's kind says: `counter` a cumulative monotonic sum, `updowncounter` a cumulative
    non-monotonic sum, `gauge` a gauge."""

    def __init__(self, encoder: OtlpEncoder):
        self.request = metrics_service_pb2.ExportMetricsServiceRequest()
        resource_metrics = self.request.resource_metrics.add()
        resource_metrics.resource.CopyFrom(encoder.resource)
        scope_metrics = resource_metrics.scope_metrics.add()
        scope_metrics.scope.CopyFrom(encoder.scope)
        self._metrics = scope_metrics.metrics
        self._points: dict[str, object] = {}

    def points(self, name: str):
        points = self._points.get(name)
        if points is None:
            spec = _SPECS[name]
            metric = self._metrics.add(name=spec.name, unit=spec.unit, description=spec.description)
            if spec.kind in _SUM_KINDS:
                metric.sum.is_monotonic = _SUM_KINDS[spec.kind]
                metric.sum.aggregation_temporality = _CUMULATIVE
                points = metric.sum.data_points
            else:
                points = metric.gauge.data_points
            self._points[name] = points
        return points

    def __len__(self) -> int:
        return sum(len(p) for p in self._points.values())
