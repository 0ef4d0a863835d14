"""Property tests: any window diagnoses without crashing, in order, and projects to a valid summary."""
from __future__ import annotations

import pytest

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jsonschema

from tests.step_time.handbuilt_windows import rank_values, window
from traceml.processor.diagnosis import diagnose, issue_order_key
from traceml.processor.presenters import format_live_line, issue_rows
from traceml.processor.reporting import RunMetadata, project_final_summary, summary_metric_points
from traceml.processor.step_time.model import LiveStepTimeResult, StepTimeAnalysis
from traceml.processor.step_time.pipeline import StepTimePipeline
from traceml.schema import diagnosis as d
from traceml.schema.summary import final_summary_json_schema_text

SCHEMA = json.loads(final_summary_json_schema_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)  # built once: validation per example stays cheap
ms = st.one_of(st.none(), st.just(0.0), st.floats(min_value=0.0, max_value=500.0, allow_nan=False))


@st.composite
def windows(draw):
    clock = draw(st.sampled_from(["cpu", "gpu"]))
    n = draw(st.integers(min_value=1, max_value=6))
    ranks = {}
    for r in range(n):
        if draw(st.booleans()) and r > 0 and draw(st.integers(0, 4)) == 0:
            ranks[r] = None  # expected but silent
        else:
            ranks[r] = rank_values(iw=draw(ms), h2d=draw(ms), fwd=draw(ms), bwd=draw(ms), opt=draw(ms),
                                   traced=draw(ms), clock=clock)
    return window(ranks, steps=draw(st.integers(0, 30)), clock=clock,
                  strategy=draw(st.sampled_from(["ddp", "fsdp", "single"])))


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(windows())
def test_any_window_diagnoses_in_order_and_every_surface_agrees(w):
    diag = diagnose(w)
    assert diag.issues and diag.primary is diag.issues[0]
    assert list(diag.issues) == sorted(diag.issues, key=issue_order_key)
    kinds = [i.kind for i in diag.issues]
    assert len(kinds) == len(set(kinds))
    for issue in diag.issues:
        assert issue.kind in d.DIAGNOSIS_KINDS and issue.status in d.DIAGNOSIS_STATUSES
        json.dumps(dict(issue.evidence), allow_nan=False)
        if w.step_count < 20 or w.training_strategy == "fsdp":
            assert issue.severity != d.SEVERITY_CRIT
    if w.step_count < 2:
        assert kinds == [d.WARMUP]
    if d.BALANCED in kinds:
        assert kinds == [d.BALANCED]
    if w.clock != "gpu":
        assert d.H2D_BOUND not in kinds

    analysis = StepTimeAnalysis(w, diag)
    summary = project_final_summary(analysis, RunMetadata(w.run_id))
    VALIDATOR.validate(json.loads(json.dumps(summary, allow_nan=False)))
    live = LiveStepTimeResult(analysis, "live", 0.0)
    assert [r.kind for r in issue_rows(live)] == [i["kind"] for i in summary["issues"]] == [
        p.attributes["traceml.diagnosis.kind"] for p in summary_metric_points(analysis)
        if p.name == "traceml.diagnosis.active"]
    assert format_live_line(live)


def test_the_pipelines_canonical_empty_analysis_projects_and_validates():
    analysis = StepTimePipeline().empty_analysis("run-cold")
    assert analysis.diagnosis.primary.kind == d.WARMUP
    summary = project_final_summary(analysis, RunMetadata("run-cold"))
    jsonschema.validate(summary, SCHEMA)
    assert summary["groups"] == [] and summary["global"]["window"]["steps"] == 0
