"""The step spans the exporter writes as bytes (`OtlpEncoder.encode_step_spans`, issue 37) are
the bytes protobuf itself serialises for the same messages, built field by field here the way
the encoder built them before it wrote bytes. Records cover every optional part: GPU clocks or
none, a zero value, memory with both, one or no peak, a job's parent span with and without
trace state, a strategy of the step's own, a collective wait, no phase children, ints past one
byte, zero times, a step with 70 phase children."""
from __future__ import annotations

from dataclasses import replace

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from harness.exporter_records import identity, memory_record, step_record
from traceml.exporter import resolve_settings
from traceml.exporter.encoding import EncodedRequest, OtlpEncoder, _id, collective_last_entry, parent_of
from traceml.records import EventTotals, PhaseInterval, StepMemorySnapshot
from traceml.schema import vocabulary as v


class _Context:
    """A SpanContext by duck typing, as `parent_of` reads it."""

    def __init__(self, remote: bool, state: str):
        self.is_valid, self.trace_flags, self.is_remote = True, 1, remote
        self.trace_id, self.span_id = 0x1234_5678_9ABC_DEF0_1122_3344_5566_7788, 0x0102_0304_0506_0708
        self.trace_state = _State(state) if state else None


class _State:
    def __init__(self, header: str):
        self.header = header

    def to_header(self) -> str:
        return self.header

    def __bool__(self) -> bool:
        return bool(self.header)


def _reference(encoder: OtlpEncoder, spans, record, memory) -> None:
    """The step span and its children as protobuf messages, field by field (the encoder's former way)."""
    ident = encoder.identity
    run_id, rank, step = ident.run_id, ident.rank, record.step
    KV, AV = common_pb2.KeyValue, common_pb2.AnyValue
    run_kv, rank_kv = KV(key=v.ATTR_RUN_ID, value=AV(string_value=run_id)), KV(key=v.ATTR_RANK, value=AV(int_value=rank))
    step_kv = KV(key=v.ATTR_STEP, value=AV(int_value=step))
    attrs = [run_kv, rank_kv, step_kv]
    for raw_event, totals in record.events.items():
        attrs.append(KV(key=v.event_attribute(raw_event, v.EVENT_FIELD_CPU), value=AV(double_value=totals.cpu_ms / 1000.0)))
        if totals.gpu_ms is not None:
            attrs.append(KV(key=v.event_attribute(raw_event, v.EVENT_FIELD_GPU),
                            value=AV(double_value=totals.gpu_ms / 1000.0)))
        attrs.append(KV(key=v.event_attribute(raw_event, v.EVENT_FIELD_COUNT), value=AV(int_value=int(totals.count))))
    last_entry = collective_last_entry(record)
    if last_entry is not None:
        attrs.append(KV(key=v.ATTR_COLLECTIVE_LAST_ENTRY, value=AV(double_value=last_entry)))
    if memory is not None and (memory.peak_allocated_bytes is not None or memory.peak_reserved_bytes is not None):
        attrs.append(KV(key=v.ATTR_DEVICE, value=AV(string_value=str(memory.device))))
        if memory.peak_allocated_bytes is not None:
            attrs.append(KV(key=v.ATTR_MEMORY_PEAK_ALLOCATED, value=AV(int_value=memory.peak_allocated_bytes)))
        if memory.peak_reserved_bytes is not None:
            attrs.append(KV(key=v.ATTR_MEMORY_PEAK_RESERVED, value=AV(int_value=memory.peak_reserved_bytes)))
    if record.strategy is not None and record.strategy != ident.strategy:
        attrs.append(KV(key=v.ATTR_TRAINING_STRATEGY, value=AV(string_value=record.strategy)))
    span_id = _id(8, run_id, rank, step)
    parent = parent_of(record.parent)
    common = dict(span_id=span_id, name=v.SPAN_STEP, kind=trace_pb2.Span.SpanKind.SPAN_KIND_INTERNAL,
                  start_time_unix_nano=record.start_time_ns, end_time_unix_nano=record.end_time_ns, attributes=attrs)
    if parent is None:
        trace_id = _id(16, run_id, step)
        spans.add(trace_id=trace_id, **common)
    else:
        trace_id, parent_span_id, flags, trace_state = parent
        spans.add(trace_id=trace_id, parent_span_id=parent_span_id, flags=flags, trace_state=trace_state, **common)
    if not encoder.phase_spans:
        return
    for index, phase in enumerate(record.phases):
        if phase.raw_event == v.RAW_STEP_TIME:
            continue
        name = v.phase_name(phase.raw_event)
        spans.add(trace_id=trace_id, span_id=_id(8, run_id, rank, step, index), parent_span_id=span_id,
                  name=v.SPAN_PHASE_PREFIX + name, kind=trace_pb2.Span.SpanKind.SPAN_KIND_INTERNAL,
                  start_time_unix_nano=phase.start_time_ns, end_time_unix_nano=phase.end_time_ns,
                  attributes=[rank_kv, step_kv, KV(key=v.ATTR_PHASE, value=AV(string_value=name))])


def _cases():
    collective = step_record(3)._replace(
        events={**step_record(3).events, v.RAW_COLLECTIVE_WAIT: EventTotals(2.5, None, 4)},
        phases=(*step_record(3).phases, PhaseInterval(v.RAW_COLLECTIVE_WAIT, step_record(3).start_time_ns + 7, 0),
                PhaseInterval(v.RAW_STEP_TIME, 1, 2)))
    yield step_record(0), memory_record(0)
    yield step_record(1, gpu=False, zero_forward=True), memory_record(1, cuda=False)
    yield step_record(2, zero_forward=True), None
    yield collective, StepMemorySnapshot(3, "cuda:1", None, 2**40, 5)
    yield step_record(4)._replace(parent=_Context(remote=True, state="k=v,a=b"), strategy=v.STRATEGY_FSDP), \
        StepMemorySnapshot(4, "cuda:0", 5, None, 5)
    yield step_record(5)._replace(parent=_Context(remote=False, state=""), strategy=v.STRATEGY_SINGLE), None
    yield step_record(300_000, phases=False)._replace(start_time_ns=0), memory_record(7)
    many = step_record(9)
    yield many._replace(phases=tuple(PhaseInterval(v.RAW_FORWARD, many.start_time_ns + i, many.start_time_ns + i + 1)
                                     for i in range(70))), None  # child indexes past the encoder's spelled ones
    yield step_record(2**33)._replace(events={"user_region": EventTotals(-1.0, 1e300, 2**31)}), \
        StepMemorySnapshot(2**33, "cuda:0", -3, 2**63 - 1, 5)


@pytest.mark.parametrize("phase_spans", [True, False])
def test_the_written_bytes_are_protobufs_own_for_the_same_messages(phase_spans):
    settings = replace(resolve_settings("http://127.0.0.1:4317", "grpc", environ={}), phase_spans=phase_spans)
    encoder = OtlpEncoder(identity("bytes \u00e9 run", rank=3, world_size=4), settings)
    expected, target = encoder.new_trace_request()
    written: list[bytes] = []
    added = 0
    for record, memory in _cases():
        before = len(written)
        added += encoder.encode_step_spans(written, record, memory)
        assert added == len(written)
        _reference(encoder, target, record, memory)
        for i in range(before, len(written)):  # span by span, so a difference names its span
            assert written[i] == target[i].SerializeToString(), (record.step, i - before)
    body = encoder.trace_request_bytes(written)
    assert body == expected.SerializeToString()
    assert EncodedRequest(body).SerializeToString() == body
    assert trace_service_pb2.ExportTraceServiceRequest.FromString(body) == expected
    assert len(written) == (sum(1 + sum(p.raw_event != v.RAW_STEP_TIME for p in r.phases) for r, _ in _cases())
                            if phase_spans else len(list(_cases())))
    # The message path (tests, tools) is the same bytes parsed.
    again, spans = encoder.new_trace_request()
    for record, memory in _cases():
        encoder.add_step_spans(spans, record, memory)
    assert again == expected


def test_a_value_protobuf_cannot_hold_is_refused_like_protobuf_refuses_it():
    encoder = OtlpEncoder(identity("refuse"), resolve_settings("http://127.0.0.1:4317", "grpc", environ={}))
    out: list[bytes] = []
    with pytest.raises(ValueError):
        encoder.encode_step_spans(out, step_record(0), StepMemorySnapshot(0, "cuda:0", 2**64, None, 5))
    with pytest.raises(Exception):
        encoder.encode_step_spans(out, step_record(1)._replace(end_time_ns=-1), None)
