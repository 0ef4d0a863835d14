"""The final-summary projector on hand-built analyses: key set, null vs 0.0, files, schema."""
from __future__ import annotations

import json
import math

import jsonschema
import pytest

from tests.step_time.handbuilt_windows import rank_values, window
from traceml.processor.diagnosis import diagnose
from traceml.processor.reporting import (
    FINAL_SUMMARY_FILE,
    PUBLIC_METRIC_KEYS,
    SUMMARY_CARD_FILE,
    RankMemory,
    RankTelemetry,
    RunMetadata,
    RunTelemetry,
    project_final_summary,
    write_summary_files,
)
from traceml.processor.step_time.model import StepTimeAnalysis
from traceml.schema.summary import SCHEMA_VERSION, final_summary_json_schema_text

SCHEMA = json.loads(final_summary_json_schema_text())


def analysis_of(w):
    return StepTimeAnalysis(window=w, diagnosis=diagnose(w))


def straggler_analysis():
    return analysis_of(window({
        0: rank_values(iw=100.0, h2d=0.0, fwd=20.0, bwd=20.0, opt=0.0, traced=40.0),
        1: rank_values(iw=0.0, h2d=0.0, fwd=20.0, bwd=120.0, opt=0.0, traced=140.0),
    }, steps=24))


def test_every_top_level_section_is_present_and_validates():
    summary = project_final_summary(straggler_analysis(), RunMetadata("run-x", generated_at=0.0))
    assert list(summary) == ["schema_version", "metadata", "diagnosis", "issues", "global", "groups",
                             "memory", "resources", "telemetry", "badput", "captures", "units", "card"]
    assert summary["schema_version"] == SCHEMA_VERSION
    assert summary["metadata"]["generated_at"] == "1970-01-01T00:00:00Z"
    assert list(summary["global"]) == ["window", "average", "median", "cross_rank_median", "worst", "skew"]
    jsonschema.validate(summary, SCHEMA)


def test_diagnosis_is_the_first_issue_and_issues_keep_order():
    summary = project_final_summary(straggler_analysis(), RunMetadata("run-x"))
    assert summary["diagnosis"] == summary["issues"][0]
    assert [i["kind"] for i in summary["issues"]] == ["INPUT_STRAGGLER"]  # its input wait is not the job's
    first = summary["diagnosis"]
    assert (first["severity"], first["status"], first["culprit_rank"], first["victim_rank"],
            first["component"]) == ("crit", "confirmed", 0, 1, "input_wait")
    assert first["score"] == pytest.approx(5 / 7, abs=1e-4)
    assert first["evidence"]["excess_ms"]["input_wait"] == pytest.approx(100.0)


def test_unmeasured_is_null_and_measured_zero_is_zero():
    w = window({0: rank_values(h2d=0.0, clock="cpu"), 1: rank_values(fwd=None, clock="cpu")}, clock="cpu")
    summary = project_final_summary(analysis_of(w), RunMetadata("run-x"))
    g0, g1 = summary["groups"]
    assert g0["metrics"]["h2d_ms"] == 0.0 and isinstance(g0["metrics"]["h2d_ms"], float)
    assert g1["metrics"]["forward_ms"] is None
    assert g1["metrics"]["compute_ms"] is None and g1["metrics"]["residual_ms"] is None
    assert g1["metrics"]["backward_ms"] == 45.0
    assert g0["metrics"]["step_time_gpu_ms"] is None  # CPU run: no GPU clock
    assert summary["global"]["median"]["forward_ms"] == {"value": 30.0, "rank": 0}
    assert summary["global"]["worst"]["forward_ms"] == {"value": None, "rank": None}  # one measured rank
    assert summary["global"]["window"]["coverage"]["forward_ms"] == {"measured_ranks": 1, "expected_ranks": 2}
    for group in summary["groups"]:
        assert list(group["metrics"]) == list(PUBLIC_METRIC_KEYS)
    jsonschema.validate(summary, SCHEMA)


def test_median_is_the_representative_rank_and_worst_names_its_own_rank():
    w = window({0: rank_values(bwd=40.0), 1: rank_values(bwd=45.0), 2: rank_values(bwd=70.0)})
    summary = project_final_summary(analysis_of(w), RunMetadata("run-x"))
    assert summary["global"]["median"]["backward_ms"] == {"value": 45.0, "rank": 1}
    assert summary["global"]["worst"]["backward_ms"] == {"value": 70.0, "rank": 2}
    assert summary["global"]["skew"]["backward_ms"] == pytest.approx(25 / 45, abs=1e-4)
    assert summary["global"]["average"]["backward_ms"] == pytest.approx(155 / 3, abs=1e-3)


def test_silent_expected_rank_keeps_its_group_with_nulls():
    w = window({0: rank_values(), 1: None})
    summary = project_final_summary(analysis_of(w), RunMetadata("run-x"))
    silent = summary["groups"][1]
    assert silent["global_rank"] == 1 and silent["steps"] == 0
    assert all(v is None for v in silent["metrics"].values())
    assert summary["metadata"]["world_size"] == 2
    jsonschema.validate(summary, SCHEMA)


def test_empty_window_projects_warmup_with_null_window_bounds():
    summary = project_final_summary(analysis_of(window({0: None}, steps=0, clock=None)), RunMetadata("run-x"))
    assert summary["diagnosis"]["kind"] == "WARMUP"
    assert summary["global"]["window"]["first_step"] is None and summary["metadata"]["clock"] is None
    assert "no aligned steps" in summary["card"]
    jsonschema.validate(summary, SCHEMA)


def test_memory_and_telemetry_parts():
    memory = [RankMemory(0, "cuda:0", 3 * 2**30, 4 * 2**30), RankMemory(1, "cuda:1", 5 * 2**30, None)]
    telemetry = RunTelemetry(
        ranks=[RankTelemetry(0, True, {"spans": 2}), RankTelemetry(1, False, {"timing": 1, "spans": 1})],
        rejected_rows={"negative_duration": 3})
    summary = project_final_summary(straggler_analysis(), RunMetadata("run-x"), memory=memory, telemetry=telemetry)
    assert summary["memory"] == {"available": True,
                                 "peak_allocated_bytes": {"value": 5 * 2**30, "rank": 1},
                                 "peak_reserved_bytes": {"value": 4 * 2**30, "rank": 0}}
    assert summary["groups"][1]["memory"] == {"device": "cuda:1", "peak_allocated_bytes": 5 * 2**30,
                                              "peak_reserved_bytes": None}
    tel = summary["telemetry"]
    assert tel["ranks_finished"] == [0] and tel["ranks_reporting_drops"] == [0, 1]
    assert tel["dropped"] == {"timing": 1, "memory": 0, "spans": 3, "metrics": 0}
    assert tel["rejected_rows"] == {"negative_duration": 3}
    assert summary["groups"][1]["telemetry"] == {"finished": False,
                                                 "dropped": {"timing": 1, "memory": 0, "spans": 1, "metrics": 0},
                                                 "ending": {"outcome": "lost", "exit_code": None}}
    assert "5.0 GiB (r1)" in summary["card"] and "1/2 rank(s) finished" in summary["card"]
    assert "1 lost (no end marker, no exit code) (r1)" in summary["card"]
    jsonschema.validate(summary, SCHEMA)


def test_telemetry_explains_missing_steps_by_export_failures():
    telemetry = RunTelemetry(ranks=[
        RankTelemetry(0, True, {"spans": 4}, export_failures=30, steps_completed=100, steps_stored=90),
        RankTelemetry(1, True, {}, export_failures=0, steps_completed=100, steps_stored=100),
        RankTelemetry(2, False, {}, steps_stored=40),  # no end marker: nothing known about its losses
    ])
    summary = project_final_summary(straggler_analysis(), RunMetadata("run-x"), telemetry=telemetry)
    tel = summary["telemetry"]
    assert tel["export_failures"] == {"0": 30, "1": 0}
    assert tel["steps_missing"] == {"0": 10, "1": 0}
    assert "export failures r0 30 step(s)" in summary["card"] and "steps missing r0 10" in summary["card"]
    jsonschema.validate(summary, SCHEMA)
    quiet = project_final_summary(straggler_analysis(), RunMetadata("run-x"))
    assert quiet["telemetry"]["export_failures"] == {} and quiet["telemetry"]["steps_missing"] == {}
    assert "Telemetry losses" not in quiet["card"]


def test_memory_unavailable_is_null_not_zero():
    summary = project_final_summary(straggler_analysis(), RunMetadata("run-x"),
                                    memory=[RankMemory(0, "cpu", None, None)])
    assert summary["memory"]["available"] is False
    assert summary["memory"]["peak_allocated_bytes"] == {"value": None, "rank": None}
    assert summary["groups"][0]["memory"]["peak_allocated_bytes"] is None
    assert summary["groups"][1]["telemetry"]["finished"] is None  # nothing reported


def test_non_finite_values_never_reach_the_file():
    w = window({0: rank_values(iw=math.nan)})
    summary = project_final_summary(analysis_of(w), RunMetadata("run-x"))
    assert summary["groups"][0]["metrics"]["input_wait_ms"] is None
    json.dumps(summary, allow_nan=False)


def test_write_summary_files_round_trips(tmp_path):
    summary = project_final_summary(straggler_analysis(), RunMetadata("run-x", generated_at=1.0))
    json_path, card_path = write_summary_files(tmp_path / "out", summary)
    assert json_path.name == FINAL_SUMMARY_FILE and card_path.name == SUMMARY_CARD_FILE
    assert json.loads(json_path.read_text()) == summary
    assert card_path.read_text() == summary["card"]
    assert "INPUT_STRAGGLER [crit, confirmed] score 0.714 rank 0" in summary["card"]
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]


def test_json_schema_lists_exactly_the_public_metric_keys():
    metric_props = SCHEMA["properties"]["global"]["properties"]["average"]["properties"]
    assert list(metric_props) == list(PUBLIC_METRIC_KEYS)
    assert set(PUBLIC_METRIC_KEYS) == {
        "input_wait_ms", "step_time_ms", "traced_step_time_ms", "step_time_cpu_ms", "step_time_gpu_ms",
        "traced_step_time_cpu_ms", "traced_step_time_gpu_ms", "dataloader_fetch_cpu_ms", "h2d_ms",
        "collective_wait_ms",
        "compute_ms", "residual_ms", "forward_ms", "backward_ms", "optimizer_ms"}


@pytest.mark.slow
def test_schema_rejects_a_missing_key_and_a_wrong_type():
    summary = project_final_summary(straggler_analysis(), RunMetadata("run-x"))
    broken = json.loads(json.dumps(summary))
    del broken["groups"][0]["metrics"]["forward_ms"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMA)
    broken = json.loads(json.dumps(summary))
    broken["diagnosis"]["severity"] = "fatal"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMA)


def test_numpy_scalars_in_evidence_become_plain_json():
    import numpy as np

    from traceml.processor.reporting.final_summary import project_issue
    from traceml.processor.step_time.model import DiagnosisIssue

    issue = DiagnosisIssue("STRAGGLER", "warn", "confirmed", np.float64(0.15), "s", culprit_rank=np.int64(3),
                           evidence={"worst_rank": np.int64(2), "share": np.float32(0.5), "caps": ("fsdp",)})
    projected = project_issue(issue)
    assert projected["culprit_rank"] == 3 and type(projected["culprit_rank"]) is int
    assert projected["evidence"] == {"worst_rank": 2, "share": 0.5, "caps": ["fsdp"]}
    assert type(projected["evidence"]["worst_rank"]) is int
    json.dumps(projected, allow_nan=False)
