"""The summary-metrics projection: vocabulary-only names and attributes, seconds, no step."""
from __future__ import annotations

import dataclasses

import pytest

from harness.resource_windows import busy_gpu_run
from tests.step_time.handbuilt_windows import rank_values, window
from traceml.processor.diagnosis import diagnose
from traceml.processor.metric_point import make_point
from traceml.processor.reporting import RankMemory, RankTelemetry, summary_metric_points
from traceml.processor.step_time.model import FRESHNESS_STATES, StepTimeAnalysis
from traceml.schema.vocabulary import ATTR_STEP, SUMMARY_METRICS


def analysis_of(w):
    return StepTimeAnalysis(window=w, diagnosis=diagnose(w))


def straggler():
    return analysis_of(window({
        0: rank_values(iw=100.0, h2d=0.0, fwd=20.0, bwd=20.0, opt=0.0, traced=40.0),
        1: rank_values(iw=0.0, h2d=0.0, fwd=20.0, bwd=120.0, opt=0.0, traced=140.0),
        2: None,
    }, steps=24))


def by_name(points, name):
    return [p for p in points if p.name == name]


def test_only_vocabulary_names_and_attribute_keys_and_never_a_step():
    specs = {s.name: s for s in SUMMARY_METRICS}
    from traceml.processor.diagnosis.ledger import window_ledger
    from traceml.processor.reporting.step_exemplars import StepTotals, advance

    analysis = dataclasses.replace(straggler(), resources=busy_gpu_run("run-test"))
    points = summary_metric_points(
        analysis, freshness="live",
        memory=[RankMemory(0, "cuda:0", 1024, 2048)],
        telemetry=[RankTelemetry(1, False, {"spans": 4})], first_step_stored=0,
        totals=advance(StepTotals(), analysis.window, ledger=window_ledger(analysis.window, analysis.diagnosis)))
    assert {p.name for p in points} == set(specs)  # every summary metric is produced here
    for p in points:
        assert p.check() is p
        assert tuple(p.attributes) == specs[p.name].attributes
        assert ATTR_STEP not in p.attributes
        assert all(isinstance(v, str) for v in p.attributes.values())
        assert isinstance(p.value, float)


def test_window_statistics_are_seconds_and_unmeasured_emit_nothing():
    w = window({0: rank_values(h2d=0.0, fwd=None), 1: rank_values(h2d=0.0, fwd=None)})
    points = summary_metric_points(analysis_of(w))
    stats = {(p.attributes["traceml.metric"], p.attributes["traceml.statistic"]): p.value
             for p in by_name(points, "traceml.window.metric")}
    assert stats[("step_time", "median")] == pytest.approx(0.100)
    assert stats[("h2d", "worst")] == 0.0  # measured zero stays a point
    assert not any(m == "forward" for m, _ in stats)  # unmeasured: no point at all
    ranks = {(p.attributes["traceml.rank"], p.attributes["traceml.metric"]) for p in by_name(points, "traceml.rank.metric")}
    assert ("0", "backward") in ranks and ("0", "forward") not in ranks


def test_window_shape_points():
    points = summary_metric_points(straggler())
    assert by_name(points, "traceml.window.steps")[0].value == 24.0
    assert by_name(points, "traceml.window.ranks")[0].value == 3.0
    assert by_name(points, "traceml.window.last_step")[0].value == 24.0
    assert by_name(points, "traceml.run.first_step") == []  # coverage not given: no point
    skew = {p.attributes["traceml.metric"]: p.value for p in by_name(points, "traceml.window.skew")}
    assert skew["backward"] == pytest.approx((120 - 70) / 70)


def test_diagnosis_points_follow_issue_order():
    analysis = straggler()
    active = by_name(summary_metric_points(analysis), "traceml.diagnosis.active")
    assert [(p.attributes["traceml.diagnosis.kind"], p.attributes["traceml.diagnosis.severity"],
             p.attributes["traceml.diagnosis.culprit_rank"]) for p in active] == [
        ("INPUT_STRAGGLER", "crit", "0")]
    assert active[0].value == pytest.approx(5 / 7)
    assert active[0].attributes["traceml.diagnosis.status"] == "confirmed"


def test_balanced_is_an_active_point_with_zero_value():
    active = by_name(summary_metric_points(analysis_of(window({0: rank_values()}))), "traceml.diagnosis.active")
    assert len(active) == 1 and active[0].attributes["traceml.diagnosis.kind"] == "BALANCED"
    assert active[0].value == 0.0


@pytest.mark.parametrize("state", FRESHNESS_STATES)
def test_exactly_one_freshness_state_is_one(state):
    fresh = by_name(summary_metric_points(straggler(), freshness=state), "traceml.run.fresh")
    assert {p.attributes["traceml.freshness"]: p.value for p in fresh} == {
        s: (1.0 if s == state else 0.0) for s in FRESHNESS_STATES}


def test_memory_and_drops():
    points = summary_metric_points(straggler(), memory=[RankMemory(0, "cuda:0", 1024, 2048),
                                                        RankMemory(1, "cpu", None, None)],
                                   telemetry=[RankTelemetry(1, False, {"spans": 4})])
    assert [(p.attributes["traceml.rank"], p.value) for p in by_name(points, "traceml.rank.memory.peak")] == [("0", 1024.0)]
    drops = {p.attributes["traceml.queue"]: p.value for p in by_name(points, "traceml.rank.telemetry.dropped")}
    assert drops == {"timing": 0.0, "memory": 0.0, "spans": 4.0, "metrics": 0.0}


def test_bad_points_and_states_are_refused():
    with pytest.raises(ValueError):
        make_point("traceml.window.steps", {"traceml.run.id": "r", "traceml.step": "3"}, 1.0)
    with pytest.raises(ValueError):
        make_point("traceml.unknown", {}, 1.0)
    assert make_point("traceml.window.steps", {"traceml.run.id": "r"}, 3).value == 3.0
    with pytest.raises(ValueError):
        summary_metric_points(straggler(), freshness="stale")


def test_a_run_first_seen_part_way_exports_its_first_stored_step():
    [point] = by_name(summary_metric_points(straggler(), first_step_stored=500), "traceml.run.first_step")
    assert point.attributes == {"traceml.run.id": point.attributes["traceml.run.id"]} and point.value == 500.0
