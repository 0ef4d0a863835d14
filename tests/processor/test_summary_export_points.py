"""The push and `/metrics` share one series grouping; the push keeps no state across pushes."""
from __future__ import annotations

from opentelemetry.sdk.metrics.export import AggregationTemporality, Gauge, Sum
from opentelemetry.sdk.resources import Resource

from traceml.processor.summary_export import Point, build_metrics_data, processor_resource, render_prometheus
from traceml.schema import vocabulary as v

RESOURCE = Resource.create({v.RES_SERVICE_NAME: "t"})


def _metrics(points):
    data = build_metrics_data(points, resource=RESOURCE, start_time_ns=1, now_ns=2)
    [resource_metrics] = data.resource_metrics
    [scope_metrics] = resource_metrics.scope_metrics
    return {m.name: m for m in scope_metrics.metrics}


def test_an_ended_run_is_absent_from_the_next_push():
    first = _metrics([Point("traceml.window.steps", {v.ATTR_RUN_ID: "a"}, 10.0),
                      Point("traceml.window.steps", {v.ATTR_RUN_ID: "b"}, 20.0)])
    second = _metrics([Point("traceml.window.steps", {v.ATTR_RUN_ID: "b"}, 21.0)])
    assert [p.attributes for p in first["traceml.window.steps"].data.data_points] == [
        {v.ATTR_RUN_ID: "a"}, {v.ATTR_RUN_ID: "b"}]
    assert [(p.attributes, p.value) for p in second["traceml.window.steps"].data.data_points] == [
        ({v.ATTR_RUN_ID: "b"}, 21.0)]


def test_counters_are_cumulative_monotonic_sums_and_gauges_gauges():
    metrics = _metrics([Point("traceml.processor.export.failures", {}, 3.0),
                        Point("traceml.processor.runs", {}, 2.0)])
    failures = metrics["traceml.processor.export.failures"].data
    assert isinstance(failures, Sum) and failures.is_monotonic
    assert failures.aggregation_temporality is AggregationTemporality.CUMULATIVE
    assert failures.data_points[0].start_time_unix_nano == 1
    assert isinstance(metrics["traceml.processor.runs"].data, Gauge)


def test_one_point_per_series_in_both_renderings_the_first_wins():
    points = [Point("traceml.window.steps", {v.ATTR_RUN_ID: "a"}, 1.0),
              Point("traceml.window.steps", {v.ATTR_RUN_ID: "a"}, 2.0),
              Point("not.a.summary.metric", {}, 5.0)]
    assert [p.value for p in _metrics(points)["traceml.window.steps"].data.data_points] == [1.0]
    assert set(_metrics(points)) == {"traceml.window.steps"}
    text = render_prometheus(points)
    assert 'traceml_window_steps{traceml_run_id="a"} 1\n' in text and " 2\n" not in text


def test_each_processor_process_is_its_own_instance(monkeypatch):
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    one, two = processor_resource(), processor_resource()
    assert one.attributes[v.RES_SERVICE_NAME] == "traceml-processor"
    assert one.attributes[v.RES_SERVICE_INSTANCE_ID] != two.attributes[v.RES_SERVICE_INSTANCE_ID]
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=eu-1")
    assert processor_resource().attributes[v.RES_SERVICE_INSTANCE_ID] == "eu-1"
