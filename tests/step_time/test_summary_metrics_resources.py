"""Resource summary metrics: median and worst per run, the exported ranks' own, absent when unmeasured;
their Prometheus names pass promtool and the OTLP push carries the conventions' units."""
from __future__ import annotations

import dataclasses
import shutil
import subprocess

import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from harness.resource_windows import GiB, busy_gpu_run, resource_window
from tests.step_time.handbuilt_windows import rank_values, window
from traceml.processor.diagnosis import diagnose
from traceml.processor.prometheus_exposition import make_registry
from traceml.processor.reporting import summary_metric_points
from traceml.processor.reporting.summary_metrics import (
    RANK_FIGURE_METRICS,
    RUN_NODE_FIGURE_METRICS,
    RUN_RANK_FIGURE_METRICS,
    exported_ranks,
)
from traceml.processor.step_time.model import StepTimeAnalysis
from traceml.processor.summary_export import SeriesLimit, build_metrics_data, processor_resource
from traceml.schema import vocabulary as v

RESOURCE_NAMES = {*RUN_RANK_FIGURE_METRICS.values(), *RUN_NODE_FIGURE_METRICS.values(), *RANK_FIGURE_METRICS.values()}


def analysis(ranks=3, resources=None, steps=24):
    w = window({r: rank_values(bwd=45.0 + r) for r in range(ranks)}, steps=steps)
    return StepTimeAnalysis(window=w, diagnosis=diagnose(w), resources=resources)


def values(points, name):
    return {tuple(p.attributes.values())[1:]: p.value for p in points if p.name == name}


def test_run_gauges_are_the_median_and_the_worst_member_of_each_figure():
    points = summary_metric_points(analysis(resources=busy_gpu_run("run-test")))
    assert values(points, "traceml.run.process.cpu.utilization") == {("median",): 0.45, ("worst",): 0.98}
    assert values(points, "traceml.run.gpu.utilization") == {("median",): 0.62, ("worst",): 0.12}  # least busy
    assert values(points, "traceml.run.process.memory.usage") == {("median",): 2.5 * GiB, ("worst",): 3.5 * GiB}
    assert values(points, "traceml.run.gpu.temperature") == {("median",): 75.5, ("worst",): 81.0}
    assert values(points, "traceml.run.gpu.power") == {("median",): 120.0, ("worst",): 250.0}
    assert values(points, "traceml.run.host.cpu.utilization")[("worst",)] == 0.97
    assert values(points, "traceml.run.host.memory.utilization")[("worst",)] == pytest.approx(90 / 128)
    assert values(points, "traceml.rank.gpu.utilization") == {("0",): 0.91, ("1",): 0.62, ("2",): 0.12}


def test_unmeasured_figures_send_no_point_and_a_measured_zero_does():
    cpu_only = resource_window("run-test", {0: {"cpu_utilization": 0.0, "rss_bytes": GiB},
                                            1: {"cpu_utilization": 0.5, "rss_bytes": 2 * GiB}})
    points = summary_metric_points(analysis(ranks=2, resources=cpu_only))
    names = {p.name for p in points}
    assert not names & {"traceml.run.gpu.utilization", "traceml.run.gpu.temperature", "traceml.run.gpu.power",
                        "traceml.rank.gpu.utilization", "traceml.run.host.cpu.utilization"}
    assert values(points, "traceml.rank.process.cpu.utilization") == {("0",): 0.0, ("1",): 0.5}
    assert values(points, "traceml.run.process.cpu.utilization")[("median",)] == 0.25
    # No resource window at all (a bare analysis): no resource point.
    assert not {p.name for p in summary_metric_points(analysis())} & RESOURCE_NAMES


def test_per_rank_resource_series_exist_only_for_the_ranks_already_exported():
    ranks = 24
    figures = {r: {"cpu_utilization": 0.5, "rss_bytes": GiB, "gpu_utilization": 0.2 + 0.01 * r,
                   "gpu_memory_used_bytes": 10 * GiB} for r in range(ranks)}
    a = analysis(ranks=ranks, resources=resource_window("big", figures))
    exported = {str(r) for r in exported_ranks(a, top_k=2)}
    assert 0 < len(exported) < ranks
    points = summary_metric_points(a, top_k=2)
    for name in RANK_FIGURE_METRICS.values():
        assert {k[0] for k in values(points, name)} == exported, name
    # The job-level gauges cover every rank: the worst GPU is rank 0's 0.20, exported or not.
    assert values(points, "traceml.run.gpu.utilization")[("worst",)] == pytest.approx(0.20)


def _points():
    return summary_metric_points(analysis(resources=busy_gpu_run("run-test")), freshness="live")


def test_prometheus_names_carry_the_unit_suffixes():
    registry = make_registry(_points, SeriesLimit())
    text = generate_latest(registry).decode()
    for name in ("traceml_run_gpu_temperature_celsius", "traceml_run_gpu_power_watts",
                 "traceml_run_process_cpu_utilization_ratio", "traceml_run_process_memory_usage_bytes",
                 "traceml_rank_gpu_utilization_ratio", "traceml_run_host_cpu_utilization_ratio"):
        assert f"\n{name}{{" in text, name
    families = {f.name: f for f in parse_openmetrics(generate_openmetrics(registry).decode())}
    assert families["traceml_run_gpu_temperature_celsius"].unit == "celsius"
    assert families["traceml_run_gpu_power_watts"].unit == "watts"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool")
def test_promtool_check_metrics_passes_on_the_resource_series():
    text = generate_latest(make_registry(_points, SeriesLimit())).decode()
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "traceml_run_gpu" in text


def test_the_otlp_push_carries_the_conventions_units():
    data = build_metrics_data(_points(), resource=processor_resource("test"), start_time_ns=1)
    units = {m.name: m.unit for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert units["traceml.run.gpu.temperature"] == "Cel" and units["traceml.run.gpu.power"] == "W"
    assert units["traceml.rank.process.memory.usage"] == "By"
    assert units["traceml.run.host.cpu.utilization"] == "1"


def test_resource_gauges_never_reuse_a_semantic_convention_name():
    from traceml.schema import resources as r

    conventions = {spec.name for spec in r.RESOURCE_METRICS} | set(r.STORED_METRICS)
    assert not RESOURCE_NAMES & conventions
    assert all(name.startswith(("traceml.run.", "traceml.rank.")) for name in RESOURCE_NAMES)
    assert RESOURCE_NAMES <= {s.name for s in v.SUMMARY_METRICS}


def test_resources_add_only_resource_points():
    # An analysis made without resources and the same one with them differ only in resource points.
    base = analysis()
    with_res = dataclasses.replace(base, resources=busy_gpu_run("run-test"))
    plain = {(p.name, tuple(p.attributes.items())) for p in summary_metric_points(base)}
    full = {(p.name, tuple(p.attributes.items())) for p in summary_metric_points(with_res)}
    assert plain < full and {n for n, _ in full - plain} <= RESOURCE_NAMES
