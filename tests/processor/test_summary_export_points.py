"""The push and `/metrics` share one series grouping and one series limit; the push keeps no state."""
from __future__ import annotations

from opentelemetry.sdk.metrics.export import AggregationTemporality, Gauge, Sum
from opentelemetry.sdk.resources import Resource

from prometheus_client.exposition import generate_latest

from traceml.processor.metric_point import MetricPoint
from traceml.processor.prometheus_exposition import make_registry
from traceml.processor.summary_export import SeriesLimit, build_metrics_data, processor_resource
from traceml.schema import vocabulary as v

RESOURCE = Resource.create({v.RES_SERVICE_NAME: "t"})


def _metrics(points):
    data = build_metrics_data(points, resource=RESOURCE, start_time_ns=1, now_ns=2)
    [resource_metrics] = data.resource_metrics
    [scope_metrics] = resource_metrics.scope_metrics
    return {m.name: m for m in scope_metrics.metrics}


def test_an_ended_run_is_absent_from_the_next_push():
    first = _metrics([MetricPoint("traceml.window.steps", {v.ATTR_RUN_ID: "a"}, 10.0),
                      MetricPoint("traceml.window.steps", {v.ATTR_RUN_ID: "b"}, 20.0)])
    second = _metrics([MetricPoint("traceml.window.steps", {v.ATTR_RUN_ID: "b"}, 21.0)])
    assert [p.attributes for p in first["traceml.window.steps"].data.data_points] == [
        {v.ATTR_RUN_ID: "a"}, {v.ATTR_RUN_ID: "b"}]
    assert [(p.attributes, p.value) for p in second["traceml.window.steps"].data.data_points] == [
        ({v.ATTR_RUN_ID: "b"}, 21.0)]


def test_counters_are_cumulative_monotonic_sums_and_gauges_gauges():
    metrics = _metrics([MetricPoint("traceml.processor.export.failures", {}, 3.0),
                        MetricPoint("traceml.processor.runs", {}, 2.0)])
    failures = metrics["traceml.processor.export.failures"].data
    assert isinstance(failures, Sum) and failures.is_monotonic
    assert failures.aggregation_temporality is AggregationTemporality.CUMULATIVE
    assert failures.data_points[0].start_time_unix_nano == 1
    assert isinstance(metrics["traceml.processor.runs"].data, Gauge)


def test_one_point_per_series_in_both_renderings_the_first_wins():
    points = [MetricPoint("traceml.window.steps", {v.ATTR_RUN_ID: "a"}, 1.0),
              MetricPoint("traceml.window.steps", {v.ATTR_RUN_ID: "a"}, 2.0),
              MetricPoint("not.a.summary.metric", {}, 5.0)]
    assert [p.value for p in _metrics(points)["traceml.window.steps"].data.data_points] == [1.0]
    assert set(_metrics(points)) == {"traceml.window.steps"}
    text = generate_latest(make_registry(lambda: points, SeriesLimit())).decode()
    assert 'traceml_window_steps{traceml_run_id="a"} 1.0\n' in text and " 2.0\n" not in text


def test_each_processor_process_is_its_own_instance(monkeypatch):
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    one, two = processor_resource(), processor_resource()
    assert one.attributes[v.RES_SERVICE_NAME] == "traceml-processor"
    assert one.attributes[v.RES_SERVICE_INSTANCE_ID] != two.attributes[v.RES_SERVICE_INSTANCE_ID]
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=eu-1")
    assert processor_resource().attributes[v.RES_SERVICE_INSTANCE_ID] == "eu-1"


def _run_points(run: str, series: int) -> list[MetricPoint]:
    return [MetricPoint("traceml.rank.memory.peak", {v.ATTR_RUN_ID: run, v.ATTR_RANK: str(r)}, 1.0) for r in range(series)]


def test_the_series_limit_leaves_out_whole_runs_the_latest_first_and_counts_them(caplog):
    own = [MetricPoint("traceml.processor.runs", {}, 3.0)]
    points = own + _run_points("old", 4) + _run_points("mid", 4) + _run_points("new", 4)
    limit = SeriesLimit(max_series=10)  # 1 own + 1 left-out count + 8: two whole runs fit
    with caplog.at_level("WARNING", logger="traceml.processor.summary_export"):
        families = limit.select(points)
        limit.select(points)
    runs = {key[0] for key in families["traceml.rank.memory.peak"]}
    assert runs == {"old", "mid"}  # never part of a run: "new" is left out whole
    assert families["traceml.processor.series.left_out"][()].value == 4.0 and limit.left_out_runs == 1
    assert "traceml.processor.runs" in families
    assert sum(len(series) for series in families.values()) <= 10
    assert len([r for r in caplog.records if "series limit" in r.message]) == 1  # logged once
    # Both surfaces apply it: the push carries what /metrics carries.
    pushed = _metrics_limited(points, SeriesLimit(max_series=10))
    assert {dict(p.attributes)[v.ATTR_RUN_ID] for p in pushed["traceml.rank.memory.peak"].data.data_points} == runs
    # Under the limit nothing is left out and the count says 0.
    assert SeriesLimit(1000).select(points)["traceml.processor.series.left_out"][()].value == 0.0


def _metrics_limited(points, limit):
    data = build_metrics_data(points, resource=RESOURCE, start_time_ns=1, now_ns=2, limit=limit)
    return {m.name: m for m in data.resource_metrics[0].scope_metrics[0].metrics}
