"""Shared pieces of the reliability tests and benchmarks.

Deterministic OTLP builders (span and trace ids derive from run/rank/step, so a
re-sent request is byte-identical, as a client retry is) and a Prometheus text
parser. The processor subprocess, ports and waiting live in `harness`, the
SQLite read-backs in `harness.stored_rows`.
"""
from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path
from typing import Iterable, Mapping

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_svc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_svc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2 as metric_data
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2 as span_data

from traceml.schema import vocabulary as v

ROOT = Path(__file__).resolve().parents[2]

# Milliseconds per step and event, as stored (`step_attrs` sends them in seconds, as the exporter does).
EVENTS_MS: Mapping[str, float] = {
    v.RAW_DATALOADER_NEXT: 4.0,
    v.RAW_FORWARD: 30.0,
    v.RAW_BACKWARD: 45.0,
    v.RAW_OPTIMIZER_STEP: 10.0,
    v.RAW_STEP_TIME: 95.0,
}
BASE_TIME_S = 1_790_000_000.0  # fixed, so spans are reproducible byte for byte


def any_value(value) -> common_pb2.AnyValue:
    if isinstance(value, common_pb2.AnyValue):
        return value
    if isinstance(value, bool):
        return common_pb2.AnyValue(bool_value=value)
    if isinstance(value, int):
        return common_pb2.AnyValue(int_value=value)
    if isinstance(value, float):
        return common_pb2.AnyValue(double_value=value)
    if isinstance(value, str):
        return common_pb2.AnyValue(string_value=value)
    if value is None:
        return common_pb2.AnyValue()
    raise TypeError(value)


def kvs(attrs: Mapping[str, object]) -> list[common_pb2.KeyValue]:
    return [common_pb2.KeyValue(key=k, value=any_value(val)) for k, val in attrs.items()]


def resource_attrs(run_id: str | None, rank: int | None, world_size: int | None = None) -> dict:
    attrs: dict = {v.RES_SERVICE_NAME: v.DEFAULT_SERVICE_NAME, v.RES_HOST_NAME: "node-0",
                   v.ATTR_TRAINING_STRATEGY: v.STRATEGY_DDP}
    if run_id is not None:
        attrs[v.ATTR_RUN_ID] = run_id
    if rank is not None:
        attrs[v.ATTR_RANK] = rank
        attrs[v.ATTR_LOCAL_RANK] = rank % 8
        attrs[v.ATTR_NODE_RANK] = rank // 8
    if world_size is not None:
        attrs[v.ATTR_WORLD_SIZE] = world_size
    return attrs


def _ids(*parts) -> tuple[bytes, bytes]:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=24).digest()
    return digest[:16], digest[16:]


def step_attrs(step: int, rank: int, events_ms: Mapping[str, float] | None = None) -> dict:
    attrs: dict = {v.ATTR_STEP: step, v.ATTR_RANK: rank}
    for raw, ms in (EVENTS_MS if events_ms is None else events_ms).items():
        attrs[v.event_attribute(raw, v.EVENT_FIELD_CPU)] = float(ms) / 1000.0  # seconds on the wire
        attrs[v.event_attribute(raw, v.EVENT_FIELD_COUNT)] = 1
    return attrs


def step_span(run_id: str, rank: int, step: int, events_ms: Mapping[str, float] | None = None, *,
              attrs: Mapping[str, object] | None = None, end_s: float | None = None,
              start_ns: int | None = None, end_ns: int | None = None) -> span_data.Span:
    """One `traceml.step` span; `attrs` replaces the attribute list when given."""
    events = EVENTS_MS if events_ms is None else events_ms
    end_s = BASE_TIME_S + (step % 10**6) * 0.1 if end_s is None else end_s
    end = int(end_s * 1e9) if end_ns is None else end_ns
    start = end - int(events.get(v.RAW_STEP_TIME, 100.0) * 1e6) if start_ns is None else start_ns
    trace_id, span_id = _ids(run_id, rank, step)
    body = step_attrs(step, rank, events) if attrs is None else attrs
    return span_data.Span(trace_id=trace_id, span_id=span_id, name=v.SPAN_STEP,
                          kind=span_data.Span.SPAN_KIND_INTERNAL, start_time_unix_nano=start,
                          end_time_unix_nano=end,
                          attributes=[common_pb2.KeyValue(key=k, value=any_value(val)) for k, val in body.items()])


def run_end_span(rank: int, steps_completed: int, extra: Mapping[str, int] | None = None) -> span_data.Span:
    now = time.time_ns()
    trace_id, span_id = _ids("end", rank, steps_completed)
    attrs = {v.ATTR_RANK: rank, v.ATTR_STEPS_COMPLETED: steps_completed, **(extra or {})}
    return span_data.Span(trace_id=trace_id, span_id=span_id, name=v.SPAN_RUN_END,
                          start_time_unix_nano=now, end_time_unix_nano=now, attributes=kvs(attrs))


def resource_spans(resource: Mapping[str, object], spans: Iterable[span_data.Span],
                   scope: str = v.INSTRUMENTATION_SCOPE) -> span_data.ResourceSpans:
    return span_data.ResourceSpans(
        resource=resource_pb2.Resource(attributes=kvs(resource)),
        scope_spans=[span_data.ScopeSpans(scope=common_pb2.InstrumentationScope(name=scope), spans=list(spans))])


def trace_request(groups: Iterable[span_data.ResourceSpans]) -> trace_svc.ExportTraceServiceRequest:
    return trace_svc.ExportTraceServiceRequest(resource_spans=list(groups))


def steps_request(run_id: str, rank: int, steps: Iterable[int], events_ms=None, *,
                  world_size: int | None = None, end_s_of=None) -> trace_svc.ExportTraceServiceRequest:
    spans = [step_span(run_id, rank, s, events_ms, end_s=None if end_s_of is None else end_s_of(s))
             for s in steps]
    return trace_request([resource_spans(resource_attrs(run_id, rank, world_size), spans)])


def memory_metric(name: str, points: Iterable[metric_data.NumberDataPoint], kind: str = "gauge"):
    metric = metric_data.Metric(name=name, unit="By", description="peak")
    if kind == "gauge":
        metric.gauge.CopyFrom(metric_data.Gauge(data_points=list(points)))
    elif kind == "sum":
        metric.sum.CopyFrom(metric_data.Sum(data_points=list(points), is_monotonic=True,
                                            aggregation_temporality=metric_data.AGGREGATION_TEMPORALITY_CUMULATIVE))
    else:  # a histogram: a data type TraceML never sends for memory
        metric.histogram.CopyFrom(metric_data.Histogram(data_points=[
            metric_data.HistogramDataPoint(time_unix_nano=1, count=1) for _ in points]))
    return metric


def metrics_request(resource: Mapping[str, object], metrics: Iterable) -> metrics_svc.ExportMetricsServiceRequest:
    return metrics_svc.ExportMetricsServiceRequest(resource_metrics=[metric_data.ResourceMetrics(
        resource=resource_pb2.Resource(attributes=kvs(resource)),
        scope_metrics=[metric_data.ScopeMetrics(scope=common_pb2.InstrumentationScope(name="traceml"),
                                                metrics=list(metrics))])])


def prometheus_samples(text: str, name: str) -> list[tuple[dict, float]]:
    """(labels, value) of every sample of metric `name` in Prometheus text format."""
    out = []
    pattern = re.compile(r"^" + re.escape(name) + r"(?:\{(.*)\})?\s+(\S+)$")
    for line in text.splitlines():
        m = pattern.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(1) or ""))
            out.append((labels, float(m.group(2))))
    return out
