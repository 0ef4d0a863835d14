"""Hand-built OTLP requests that follow `traceml.schema.vocabulary` (what the exporter sends).

Used by the receiver tests and the ingest benchmark to drive the processor without
a training process. Values are given in milliseconds per step (what SQLite stores);
`step_span` sends them in seconds under the current names, or as milliseconds
under the names older exporters used (`legacy=True`).
"""
from __future__ import annotations

import os
import time
from typing import Iterable, Mapping

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2 as metric_data
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2 as span_data

from traceml.schema import vocabulary as v

BASE_EVENTS_MS: Mapping[str, float] = {
    v.RAW_DATALOADER_NEXT: 5.0,
    v.RAW_H2D: 5.0,
    v.RAW_FORWARD: 30.0,
    v.RAW_BACKWARD: 45.0,
    v.RAW_OPTIMIZER_STEP: 10.0,
    v.RAW_STEP_TIME: 95.0,
}


def kv(key: str, value) -> common_pb2.KeyValue:
    any_value = common_pb2.AnyValue()
    if isinstance(value, bool):
        any_value.bool_value = value
    elif isinstance(value, int):
        any_value.int_value = value
    elif isinstance(value, float):
        any_value.double_value = value
    elif isinstance(value, str):
        any_value.string_value = value
    elif value is None:
        pass
    else:
        raise TypeError(value)
    return common_pb2.KeyValue(key=key, value=any_value)


def resource(run_id: str | None, rank: int | None, *, world_size: int | None = 2,
             strategy: str = v.STRATEGY_DDP, aliases: bool = False, extra: Mapping | None = None):
    attrs = {v.RES_SERVICE_NAME: v.DEFAULT_SERVICE_NAME, v.RES_HOST_NAME: "host-a"}
    if aliases:
        if run_id is not None:
            attrs["nemo.run.id"] = run_id
        if rank is not None:
            attrs["dl.rank"] = rank
            attrs["dl.local_rank"] = rank
        if world_size is not None:
            attrs["dl.world_size"] = world_size
    else:
        if run_id is not None:
            attrs[v.ATTR_RUN_ID] = run_id
        if rank is not None:
            attrs[v.ATTR_RANK] = rank
            attrs[v.ATTR_LOCAL_RANK] = rank
            attrs[v.ATTR_NODE_RANK] = 0
        if world_size is not None:
            attrs[v.ATTR_WORLD_SIZE] = world_size
            attrs[v.ATTR_LOCAL_WORLD_SIZE] = world_size
    attrs[v.ATTR_TRAINING_STRATEGY] = strategy
    attrs.update(extra or {})
    return resource_pb2.Resource(attributes=[kv(k, val) for k, val in attrs.items()])


def step_span(step: int, rank: int, events_ms: Mapping[str, float] | None = None, *,
              end_s: float | None = None, extra: Mapping | None = None, gpu: bool = False,
              drop: Iterable[str] = (), legacy: bool = False) -> span_data.Span:
    events = dict(BASE_EVENTS_MS if events_ms is None else events_ms)
    end_s = time.time() if end_s is None else end_s
    step_ms = events.get(v.RAW_STEP_TIME, 100.0)
    attrs: dict = {v.ATTR_STEP: step, v.ATTR_RANK: rank}
    for raw, value in events.items():
        cpu = (2 * value) if gpu else value
        if legacy:
            attrs[v.legacy_event_attribute(raw, "cpu_ms")] = cpu
            if gpu:
                attrs[v.legacy_event_attribute(raw, "gpu_ms")] = value
            attrs[v.legacy_event_attribute(raw, "count")] = 1
            continue
        attrs[v.event_attribute(raw, v.EVENT_FIELD_CPU)] = cpu / 1000.0
        if gpu:
            attrs[v.event_attribute(raw, v.EVENT_FIELD_GPU)] = value / 1000.0
        attrs[v.event_attribute(raw, v.EVENT_FIELD_COUNT)] = 1
    for key in drop:
        attrs.pop(key, None)
    attrs.update(extra or {})
    end_ns = int(end_s * 1e9)
    return span_data.Span(
        trace_id=os.urandom(16), span_id=os.urandom(8), name=v.SPAN_STEP,
        kind=span_data.Span.SPAN_KIND_INTERNAL,
        start_time_unix_nano=end_ns - int(step_ms * 1e6), end_time_unix_nano=end_ns,
        attributes=[kv(k, val) for k, val in attrs.items()],
    )


def run_end_span(rank: int, steps_completed: int) -> span_data.Span:
    now = time.time_ns()
    return span_data.Span(
        trace_id=os.urandom(16), span_id=os.urandom(8), name=v.SPAN_RUN_END,
        start_time_unix_nano=now, end_time_unix_nano=now,
        attributes=[kv(v.ATTR_RANK, rank), kv(v.ATTR_STEPS_COMPLETED, steps_completed)],
    )


def trace_request(run_id: str | None, rank: int | None, spans: Iterable[span_data.Span], *,
                  world_size: int | None = 2, scope: str = v.INSTRUMENTATION_SCOPE,
                  **resource_kwargs) -> trace_pb2.ExportTraceServiceRequest:
    return trace_pb2.ExportTraceServiceRequest(resource_spans=[span_data.ResourceSpans(
        resource=resource(run_id, rank, world_size=world_size, **resource_kwargs),
        scope_spans=[span_data.ScopeSpans(scope=common_pb2.InstrumentationScope(name=scope),
                                          spans=list(spans))],
    )])


def steps_request(run_id: str, rank: int, steps: Iterable[int], events_ms=None, *,
                  world_size: int = 2, end_s: float | None = None, **kwargs):
    end = time.time() if end_s is None else end_s
    spans = [step_span(s, rank, events_ms, end_s=end + s * 0.1, **kwargs) for s in steps]
    return trace_request(run_id, rank, spans, world_size=world_size)


def foreign_request(n: int = 3) -> trace_pb2.ExportTraceServiceRequest:
    """Spans from some other instrumented service: must be ignored, never fatal."""
    now = time.time_ns()
    spans = [span_data.Span(trace_id=os.urandom(16), span_id=os.urandom(8), name=f"GET /items/{i}",
                            start_time_unix_nano=now - 1000, end_time_unix_nano=now,
                            attributes=[kv("http.method", "GET")]) for i in range(n)]
    return trace_pb2.ExportTraceServiceRequest(resource_spans=[span_data.ResourceSpans(
        resource=resource_pb2.Resource(attributes=[kv(v.RES_SERVICE_NAME, "web-shop")]),
        scope_spans=[span_data.ScopeSpans(scope=common_pb2.InstrumentationScope(name="flask"),
                                          spans=spans)],
    )])


def memory_request(run_id: str, rank: int, steps: Iterable[int], *, allocated: int = 1 << 30,
                   reserved: int = 2 << 30, device: str = "cuda:0", drops: Mapping[str, int] | None = None,
                   world_size: int = 2) -> metrics_pb2.ExportMetricsServiceRequest:
    now = time.time_ns()
    metrics = []
    for name, value in ((v.METRIC_MEMORY_PEAK_ALLOCATED, allocated), (v.METRIC_MEMORY_PEAK_RESERVED, reserved)):
        points = [metric_data.NumberDataPoint(
            time_unix_nano=now, as_int=value + step,
            attributes=[kv(v.ATTR_RANK, rank), kv(v.ATTR_STEP, step), kv(v.ATTR_DEVICE, device)])
            for step in steps]
        metrics.append(metric_data.Metric(name=name, unit="By", description="peak",
                                          gauge=metric_data.Gauge(data_points=points)))
    if drops:
        points = [metric_data.NumberDataPoint(time_unix_nano=now, as_int=n,
                                              attributes=[kv(v.ATTR_RANK, rank), kv(v.ATTR_QUEUE, q)])
                  for q, n in drops.items()]
        metrics.append(metric_data.Metric(
            name=v.METRIC_TELEMETRY_DROPPED, unit="{record}", description="dropped",
            sum=metric_data.Sum(data_points=points, is_monotonic=True,
                                aggregation_temporality=metric_data.AGGREGATION_TEMPORALITY_CUMULATIVE)))
    return metrics_pb2.ExportMetricsServiceRequest(resource_metrics=[metric_data.ResourceMetrics(
        resource=resource(run_id, rank, world_size=world_size),
        scope_metrics=[metric_data.ScopeMetrics(scope=common_pb2.InstrumentationScope(name="traceml"),
                                                metrics=metrics)],
    )])
