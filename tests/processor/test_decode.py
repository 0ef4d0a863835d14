"""The decoder alone: what each span and data point becomes, and why something is refused."""
from __future__ import annotations

import gzip
import json

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2 as metric_data
from harness.otlp_payloads import kv, memory_request, run_end_span, step_span, steps_request, trace_request

from traceml.processor.decode import DecodeLimits, Decoder
from traceml.processor.otlp_read import parse_otlp_json
from traceml.processor.receiver_http import BodyTooLarge, gunzip_capped
from traceml.schema import vocabulary as v


def test_step_span_becomes_one_typed_record_with_resource_identity():
    batch = Decoder().decode_traces(steps_request("r", 1, [7], gpu=True))
    (record,) = batch.step_records
    assert (record.run_id, record.step, record.training_strategy) == ("r", 7, "ddp")
    assert record.identity.global_rank == 1 and record.identity.world_size == 2
    assert record.identity.hostname == "host-a"
    forward = record.events[v.RAW_FORWARD]
    assert (forward.cpu_ms, forward.gpu_ms, forward.count) == (60.0, 30.0, 1)
    assert record.sample_time - record.start_time == pytest.approx(0.095, abs=1e-6)


def test_seconds_on_the_wire_and_legacy_milliseconds_decode_to_the_same_record():
    events = {v.RAW_DATALOADER_NEXT: 4.125, v.RAW_H2D: 0.0, v.RAW_FORWARD: 30.5, v.RAW_BACKWARD: 45.0,
              v.RAW_STEP_TIME: 95.25, "_traceml_internal:my_region": 2.0, "user.region": 1.5}
    end = 1_790_000_000.0
    new = Decoder().decode_traces(steps_request("r", 1, [3], events, end_s=end, gpu=True)).step_records
    old = Decoder().decode_traces(steps_request("r", 1, [3], events, end_s=end, gpu=True, legacy=True)).step_records
    assert len(new) == len(old) == 1
    assert new[0].events == old[0].events  # milliseconds, exactly
    assert {k: (e.cpu_ms, e.gpu_ms) for k, e in new[0].events.items()}[v.RAW_FORWARD] == (61.0, 30.5)
    assert set(new[0].events) == {*events} - {"user.region"} | {"_traceml_internal:user.region"}


def test_event_attribute_names_are_canonical_and_parse_back_in_both_formats():
    for raw in (*v.RAW_EVENTS, "_traceml_internal:my.region", "plain_region"):
        for field in v.EVENT_FIELDS:
            key = v.event_attribute(raw, field)
            assert v.RAW_EVENT_PREFIX not in key and key.startswith("traceml.phase.")
            unit = "{occurrence}" if field == v.EVENT_FIELD_COUNT else "s"
            expected_raw = raw if raw.startswith(v.RAW_EVENT_PREFIX) else v.RAW_EVENT_PREFIX + raw
            assert v.parse_event_attribute(key) == (expected_raw, field, unit)
        for legacy, (field, unit) in v.LEGACY_EVENT_FIELDS.items():
            key = v.legacy_event_attribute(raw, legacy)
            expected_raw = raw if raw.startswith(v.RAW_EVENT_PREFIX) else v.RAW_EVENT_PREFIX + raw
            assert v.parse_event_attribute(key) == (expected_raw, field, unit)
    assert v.event_attribute(v.RAW_FORWARD, v.EVENT_FIELD_CPU) == "traceml.phase.forward.cpu.duration"
    assert v.event_attribute(v.RAW_STEP_TIME, v.EVENT_FIELD_COUNT) == "traceml.phase.traced_step_time.count"
    for key in ("traceml.phase.name", "traceml.phase..count", "traceml.phase.forward", "traceml.event.x.cpu_s"):
        assert v.parse_event_attribute(key) is None, key
    with pytest.raises(ValueError):
        v.event_attribute(v.RAW_FORWARD, "cpu_ms")


def test_measured_zero_stays_zero_and_missing_gpu_stays_none():
    events = {v.RAW_FORWARD: 0.0, v.RAW_STEP_TIME: 10.0}
    (record,) = Decoder().decode_traces(steps_request("r", 0, [0], events)).step_records
    assert record.events[v.RAW_FORWARD].cpu_ms == 0.0
    assert record.events[v.RAW_FORWARD].gpu_ms is None
    assert v.RAW_BACKWARD not in record.events


def test_resource_identity_from_env_style_strings_and_aliases():
    request = trace_request("nemo", 5, [step_span(0, 5, drop=[v.ATTR_RANK])], aliases=True, world_size=8)
    (record,) = Decoder().decode_traces(request).step_records
    assert (record.run_id, record.identity.global_rank, record.identity.local_rank,
            record.identity.world_size) == ("nemo", 5, 5, 8)
    request = trace_request("strs", None, [step_span(0, 3, drop=[v.ATTR_RANK])],
                            extra={v.ATTR_RANK: "3", v.ATTR_WORLD_SIZE: "4"}, world_size=None)
    (record,) = Decoder().decode_traces(request).step_records
    assert (record.identity.global_rank, record.identity.world_size) == (3, 4)
    # TraceML's own key wins over the alias.
    request = trace_request("both", 2, [step_span(0, 2)], extra={"dl.rank": 9})
    assert Decoder().decode_traces(request).step_records[0].identity.global_rank == 2


CPU, GPU, COUNT = (v.event_attribute(v.RAW_FORWARD, f) for f in v.EVENT_FIELDS)


@pytest.mark.parametrize("extra, reason", [
    ({CPU: float("inf")}, "non_finite_value"),
    ({CPU: "0.03"}, "wrong_attribute_type"),
    ({COUNT: 1.5}, "wrong_attribute_type"),
    ({COUNT: -1}, "negative_value"),
    ({CPU: -0.000001}, "negative_value"),  # timer noise too
    ({GPU: 2e5}, "absurd_value"),
    ({CPU: 86_400.0005}, "absurd_value"),  # seconds: over one day
    ({CPU: 1e306}, "absurd_value"),  # finite in seconds, infinite in milliseconds
    ({v.legacy_event_attribute(v.RAW_FORWARD, "cpu_ms"): float("inf")}, "non_finite_value"),
    ({v.legacy_event_attribute(v.RAW_FORWARD, "cpu_ms"): "30"}, "wrong_attribute_type"),
    ({v.legacy_event_attribute(v.RAW_FORWARD, "cpu_ms"): 86_400_000.5}, "absurd_value"),  # milliseconds
    ({v.legacy_event_attribute(v.RAW_FORWARD, "count"): -1}, "negative_value"),
    ({v.ATTR_STEP: 2**60}, "absurd_value"),
    ({v.ATTR_STEP: True}, "wrong_attribute_type"),
    ({v.ATTR_RANK: 1.0}, "wrong_attribute_type"),
    ({"note": "x" * 5000}, "attribute_too_large"),
])
def test_each_bad_value_rejects_its_span_with_a_reason(extra, reason):
    request = trace_request("r", None, [step_span(0, 0, extra=extra), step_span(1, 0)], world_size=None)
    batch = Decoder().decode_traces(request)
    assert dict(batch.rejected) == {reason: 1}
    assert [r.step for r in batch.step_records] == [1]
    assert reason in batch.message()


def test_too_many_attributes_and_span_without_timing():
    extra = {f"k{i}": i for i in range(600)}
    only_count = {COUNT: 1}
    spans = [step_span(0, 0, extra=extra), step_span(1, 0, events_ms={}, extra=only_count)]
    batch = Decoder().decode_traces(trace_request("r", 0, spans))
    assert dict(batch.rejected) == {"too_many_attributes": 1, "no_events": 1}


def test_phase_spans_and_foreign_spans_are_ignored_not_rejected():
    phase, legacy_phase = step_span(0, 0), step_span(3, 0)
    phase.name = v.SPAN_PHASE_PREFIX + v.phase_name(v.RAW_FORWARD)
    legacy_phase.name = v.SPAN_PHASE_PREFIX + "forward_time"  # what older exporters named it
    other = step_span(1, 0)
    other.name = "SELECT users"
    batch = Decoder().decode_traces(trace_request("r", 0, [phase, legacy_phase, other, step_span(2, 0)]))
    assert dict(batch.ignored) == {"phase_span": 2, "not_traceml": 1}
    assert batch.rejected_count == 0 and len(batch.step_records) == 1


def test_run_end_marker_carries_final_counts_and_drops():
    span = run_end_span(1, 40)
    span.attributes.extend([kv(v.run_end_dropped_attribute("spans"), 3), kv(v.ATTR_RUN_END_EXPORT_RETRIES, 2)])
    (marker,) = Decoder().decode_traces(trace_request("r", 1, [span], world_size=4)).run_ends
    assert (marker.run_id, marker.global_rank, marker.steps_completed, marker.world_size) == ("r", 1, 40, 4)
    assert marker.dropped == {"spans": 3}
    assert marker.final_counts[v.ATTR_RUN_END_EXPORT_RETRIES] == 2


def test_memory_gauges_merge_per_step_and_drop_sums_are_read():
    batch = Decoder().decode_metrics(memory_request("r", 0, [4, 5], drops={"memory": 9}))
    assert [(m.step, m.peak_allocated_bytes, m.peak_reserved_bytes) for m in batch.memory_records] == [
        (4, (1 << 30) + 4, (2 << 30) + 4), (5, (1 << 30) + 5, (2 << 30) + 5)]
    assert [(d.queue, d.dropped) for d in batch.drops] == [("memory", 9)]


def test_bad_memory_points_are_rejected_and_other_metrics_ignored():
    request = memory_request("r", 0, [0])
    gauge = request.resource_metrics[0].scope_metrics[0].metrics[0].gauge
    gauge.data_points.add(time_unix_nano=1, as_double=float("nan"),
                          attributes=[kv(v.ATTR_RANK, 0), kv(v.ATTR_STEP, 1), kv(v.ATTR_DEVICE, "cuda:0")])
    gauge.data_points.add(time_unix_nano=1, as_int=5, attributes=[kv(v.ATTR_RANK, 0), kv(v.ATTR_DEVICE, "cuda:0")])
    metrics = request.resource_metrics[0].scope_metrics[0].metrics
    metrics.add(name="http.server.duration", gauge=metric_data.Gauge(data_points=[metric_data.NumberDataPoint(as_int=1)]))
    metrics.add(name=v.METRIC_MEMORY_PEAK_RESERVED, histogram=metric_data.Histogram(
        data_points=[metric_data.HistogramDataPoint(count=1)]))
    batch = Decoder().decode_metrics(request)
    assert dict(batch.rejected) == {"non_finite_value": 1, "missing_step": 1, "wrong_attribute_type": 1}
    assert dict(batch.ignored) == {"not_traceml": 1}
    assert len(batch.memory_records) == 1


def test_run_and_rank_caps():
    decoder = Decoder(DecodeLimits(max_runs=1, max_ranks_per_run=1))
    assert len(decoder.decode_traces(steps_request("a", 0, [0])).step_records) == 1
    assert dict(decoder.decode_traces(steps_request("b", 0, [0])).rejected) == {"too_many_runs": 1}
    assert dict(decoder.decode_traces(steps_request("a", 1, [0])).rejected) == {"too_many_ranks": 1}


def test_otlp_json_metrics_with_string_int64_and_int_enums():
    doc = json_format.MessageToDict(memory_request("j", 0, [0], drops={"timing": 1}), use_integers_for_enums=True)
    point = doc["resourceMetrics"][0]["scopeMetrics"][0]["metrics"][0]["gauge"]["dataPoints"][0]
    assert isinstance(point["asInt"], str)  # int64 travels as a JSON string
    doc["resourceMetrics"][0]["unknownThing"] = [1, 2]
    request = parse_otlp_json(json.dumps(doc).encode(), metrics_pb2.ExportMetricsServiceRequest())
    batch = Decoder().decode_metrics(request)
    assert len(batch.memory_records) == 1 and batch.drops[0].dropped == 1


def test_bad_json_ids_and_shapes_raise_value_error():
    with pytest.raises(ValueError, match="not hex"):
        parse_otlp_json(b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"zz"}]}]}]}',
                        metrics_pb2.ExportMetricsServiceRequest())
    with pytest.raises(ValueError):
        parse_otlp_json(b"[1, 2]", metrics_pb2.ExportMetricsServiceRequest())


def test_gunzip_cap_refuses_bombs_and_truncation():
    assert gunzip_capped(gzip.compress(b"abc")) == b"abc"
    with pytest.raises(BodyTooLarge):
        gunzip_capped(gzip.compress(b"\0" * 2000), cap=1000)
    with pytest.raises(ValueError, match="truncated"):
        gunzip_capped(gzip.compress(b"x" * 5000)[:20])


def test_a_step_span_strategy_of_the_wrong_type_is_refused():
    request = steps_request("r", 1, [7])
    span = request.resource_spans[0].scope_spans[0].spans[0]
    span.attributes.append(kv(v.ATTR_TRAINING_STRATEGY, 3))
    batch = Decoder().decode_traces(request)
    assert batch.step_records == [] and batch.rejected_count == 1
