"""Older exporters' wire names and today's store the same rows (issue 17 item 8).

Today's exporter sends durations in seconds under canonical phase names
(`traceml.phase.forward.cpu.duration`); exporters in the field still send
milliseconds under raw infixes (`traceml.event.forward_time.cpu_ms`). The same
steps, sent both ways to real processors over gRPC, must give identical rows,
column for column, and a step re-sent in the other format is a duplicate (its
content digest is the same).
"""
from __future__ import annotations

import math
import random
import sqlite3
import struct

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from harness.exporter_records import identity, memory_record, step_record
from harness.processor_service import make_service

from traceml.exporter import resolve_settings
from traceml.exporter.encoding import OtlpEncoder
from traceml.processor.decode import Decoder
from traceml.records import EventTotals, PhaseInterval
from traceml.schema import vocabulary as v

_LEGACY_FIELD = {v.EVENT_FIELD_CPU: "cpu_ms", v.EVENT_FIELD_GPU: "gpu_ms", v.EVENT_FIELD_COUNT: "count"}


def _records():
    records = [step_record(s, gpu=s % 2 == 0, zero_forward=s == 3) for s in range(8)]
    # A region of the job's own, and the traced-step occurrence the samplers publish as a phase.
    extra = records[5]
    events = {**extra.events, "_traceml_internal:my_region": EventTotals(1.75, None, 2)}
    phases = (PhaseInterval(v.RAW_STEP_TIME, extra.start_time_ns, extra.end_time_ns), *extra.phases)
    records[5] = extra._replace(events=events, phases=phases)
    return records


def _current_request(run_id: str, records):
    encoder = OtlpEncoder(identity(run_id, 1, 2), resolve_settings("http://127.0.0.1:4317", "grpc", environ={}))
    request, spans = encoder.new_trace_request()
    for record in records:
        encoder.add_step_spans(spans, record, memory_record(record.step, cuda=record.step != 4))
    return request


def _as_older_exporter(request, records):
    """The same request as an exporter before the OpenTelemetry names sent it: milliseconds
    as measured under `traceml.event.<raw key>.<cpu_ms|gpu_ms|count>`, raw-named phase
    children, scope version `1`, no `telemetry.*` resource keys."""
    legacy = type(request)()
    legacy.CopyFrom(request)
    by_step = {r.step: r for r in records}
    rs = legacy.resource_spans[0]
    keep = [kv for kv in rs.resource.attributes if not kv.key.startswith("telemetry.")]
    del rs.resource.attributes[:]
    rs.resource.attributes.extend(keep)
    scope = rs.scope_spans[0]
    scope.scope.version = "1"
    for span in scope.spans:
        step = next(kv.value.int_value for kv in span.attributes if kv.key == v.ATTR_STEP)
        if span.name != v.SPAN_STEP:
            raw = v.raw_event_of_phase(span.name[len(v.SPAN_PHASE_PREFIX):])
            span.name = v.SPAN_PHASE_PREFIX + v.raw_event_key(raw)
            for kv in span.attributes:
                if kv.key == v.ATTR_PHASE:
                    kv.key, kv.value.string_value = v.LEGACY_ATTR_PHASE, raw
            continue
        for kv in span.attributes:
            parsed = v.parse_event_attribute(kv.key)
            if parsed is None:
                continue
            raw, field, _ = parsed
            totals = by_step[step].events[raw]
            kv.key = v.legacy_event_attribute(raw, _LEGACY_FIELD[field])
            if field == v.EVENT_FIELD_CPU:
                kv.value.double_value = float(totals.cpu_ms)
            elif field == v.EVENT_FIELD_GPU:
                kv.value.double_value = float(totals.gpu_ms)
    return legacy


def _rows(db, table: str, order: str) -> tuple[list[str], list[tuple]]:
    conn = sqlite3.connect(db)
    try:
        columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")
                   if row[1] not in ("id", "receive_time")]
        return columns, conn.execute(f"SELECT {', '.join(columns)} FROM {table} ORDER BY {order}").fetchall()
    finally:
        conn.close()


def _send(service, request):
    with grpc.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
        return trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=10)


def test_older_and_current_wire_names_store_identical_rows(tmp_path):
    run_id = "wire-compat"
    records = _records()
    current = _current_request(run_id, records)
    legacy = _as_older_exporter(current, records)
    assert not [kv.key for s in legacy.resource_spans[0].scope_spans[0].spans for kv in s.attributes
                if kv.key.startswith(v.EVENT_ATTR_PREFIX)]  # the fixture really is the old format
    tables = {}
    for name, request in (("legacy", legacy), ("current", current)):
        (tmp_path / name).mkdir()
        service = make_service(tmp_path / name)
        try:
            response = _send(service, request)
            assert response.partial_success.rejected_spans == 0, response.partial_success.error_message
            db = service.config.db
            tables[name] = (_rows(db, "step_time_samples", "global_rank, step"),
                            _rows(db, "step_memory_samples", "global_rank, step, device"))
            if name == "legacy":  # the other format, re-sent: recognised as the same rows
                _send(service, current)
                # every step and every memory row (one CPU step has none)
                assert service.stats.snapshot()[("duplicate", "traces")] == 2 * len(records) - 1
        finally:
            service.stop()
    (steps_columns, legacy_steps), (_, legacy_memory) = tables["legacy"]
    (_, current_steps), (_, current_memory) = tables["current"]
    assert len(legacy_steps) == len(records) and len(legacy_memory) == len(records) - 1
    assert current_steps == legacy_steps
    assert current_memory == legacy_memory
    forward = dict(zip(steps_columns, current_steps[0]))
    assert (forward["forward_cpu_ms"], forward["forward_gpu_ms"], forward["input_wait_cpu_ms"]) == (60.25, 30.5, 5.0)
    assert '"_traceml_internal:my_region":[1.75,null,2]' in dict(zip(steps_columns, current_steps[5]))["payload"]


def test_seconds_come_back_as_the_measured_milliseconds_to_one_ulp():
    """The precision claim of docs/wire-format.md, over values shaped as the samplers make them
    (perf_counter_ns deltas / 1e6, and CUDA's float32 elapsed times)."""
    rng = random.Random(17)
    samples = [rng.randrange(1, 10**11) / 1e6 for _ in range(2_000)]
    samples += [struct.unpack("f", struct.pack("f", rng.uniform(0, 5e3)))[0] for _ in range(2_000)]
    encoder = OtlpEncoder(identity("ulp"), resolve_settings("http://127.0.0.1:4317", "grpc", environ={}))
    request, spans = encoder.new_trace_request()
    for i in range(0, len(samples), 2):
        encoder.add_step_spans(spans, step_record(i)._replace(
            events={v.RAW_FORWARD: EventTotals(samples[i], samples[i + 1], 1)}, phases=()))
    decoded = Decoder().decode_traces(request).step_records
    assert len(decoded) == len(samples) // 2
    exact = 0
    for i, record in enumerate(decoded):
        got = record.events[v.RAW_FORWARD]
        for measured, stored in ((samples[2 * i], got.cpu_ms), (samples[2 * i + 1], got.gpu_ms)):
            assert abs(stored - measured) <= math.ulp(measured), (measured, stored)
            exact += stored == measured
    assert exact >= 0.97 * len(samples)  # most come back bit for bit
