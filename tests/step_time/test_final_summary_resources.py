"""The final summary's resource evidence on hand-built resource windows: shape, nulls, card, findings."""
from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from harness.resource_windows import GiB, MiB, busy_gpu_run, resource_window
from tests.step_time.test_final_summary import SCHEMA, straggler_analysis
from tests.step_time.test_public_schema_golden import key_set, leaf_patterns
from traceml.processor.reporting import RunMetadata, project_final_summary
from traceml.processor.reporting.resources import TREND_KEYS
from traceml.processor.resources.model import NODE_FIGURES, RANK_FIGURES, ResourceWindow
from traceml.processor.step_time.model import DiagnosisIssue, StepTimeDiagnosis
from traceml.schema import diagnosis as d

HOSTILE = "evil\x1b]0;owned\x07\nhost\u202e"


def summary_with(resources, analysis=None, **kwargs):
    analysis = analysis or straggler_analysis()
    return project_final_summary(dataclasses.replace(analysis, resources=resources),
                                 RunMetadata("run-x", generated_at=0.0), **kwargs)


def three_rank_analysis():
    from tests.step_time.handbuilt_windows import rank_values, window
    from traceml.processor.diagnosis import diagnose

    w = window({r: rank_values() for r in range(3)}, steps=40)
    from traceml.processor.step_time.model import StepTimeAnalysis
    return StepTimeAnalysis(window=w, diagnosis=diagnose(w))


@pytest.mark.slow
def test_a_run_without_resource_data_has_the_whole_section_with_nulls():
    for resources in (None, ResourceWindow.empty("run-x")):
        summary = summary_with(resources)
        section = summary["resources"]
        assert section["available"] is False
        assert section["window"] == {"start_time": None, "end_time": None}
        assert section["sources"] == [] and section["nodes"] == [] and section["memory_trends"] == []
        assert list(section["global"]["ranks"]) == list(RANK_FIGURES)
        assert list(section["global"]["nodes"]) == list(NODE_FIGURES)
        for stat in section["global"]["ranks"].values():
            assert stat == {"median": {"value": None, "rank": None}, "worst": {"value": None, "rank": None},
                            "measured": 0}
        for stat in section["global"]["nodes"].values():
            assert stat == {"median": {"value": None, "host": None}, "worst": {"value": None, "host": None},
                            "measured": 0}
        for group in summary["groups"]:
            assert group["resources"] == {"host": None, "device": None, "samples": 0,
                                          **dict.fromkeys(RANK_FIGURES)}
        assert "Resources: not measured" in summary["card"]
        jsonschema.validate(summary, SCHEMA)


def test_the_shape_never_changes_with_what_was_measured():
    empty = summary_with(None, three_rank_analysis())
    full = summary_with(busy_gpu_run("run-x"), three_rank_analysis())
    # Lists collapse to `[]` in the key set; the measured run's lists hold entries, the empty one's none.
    lists = ("resources.nodes", "resources.memory_trends", "resources.sources")

    def keys(summary):
        return {k for k in key_set(leaf_patterns(summary)) if not k.startswith(lists)}

    assert keys(empty) == keys(full)


def test_figures_medians_and_worst_members_come_from_the_window():
    summary = summary_with(busy_gpu_run("run-x"), three_rank_analysis())
    section = summary["resources"]
    ranks, nodes = section["global"]["ranks"], section["global"]["nodes"]
    assert ranks["cpu_utilization"] == {"median": {"value": 0.45, "rank": 0}, "worst": {"value": 0.98, "rank": 1},
                                        "measured": 3}
    # GPU utilisation: the worst is the lowest (an idling GPU), as the analysis says.
    assert ranks["gpu_utilization"] == {"median": {"value": 0.62, "rank": 1}, "worst": {"value": 0.12, "rank": 2},
                                        "measured": 3}
    assert ranks["rss_bytes"]["worst"] == {"value": int(3.5 * GiB), "rank": 1}
    assert isinstance(ranks["rss_bytes"]["worst"]["value"], int)
    assert ranks["gpu_temperature_c"]["measured"] == 2  # rank 2 has no temperature
    assert nodes["cpu_utilization"]["worst"] == {"value": 0.97, "host": "node-b"}
    assert nodes["memory_utilization"]["worst"] == {"value": round(90 / 128, 4), "host": "node-b"}
    assert nodes["cpu_count"]["median"]["value"] == 16 and isinstance(nodes["cpu_count"]["median"]["value"], int)
    assert section["available"] is True
    assert section["sources"] == ["traceml", "hostmetrics"]
    assert section["window"] == {"start_time": "2023-11-14T22:13:20Z", "end_time": "2023-11-14T22:14:20Z"}
    jsonschema.validate(json.loads(json.dumps(summary, allow_nan=False)), SCHEMA)


def test_unmeasured_is_null_and_a_measured_zero_is_zero_in_each_rank_group():
    summary = summary_with(busy_gpu_run("run-x"), three_rank_analysis())
    g0, g1, g2 = (g["resources"] for g in summary["groups"])
    assert list(g0) == ["host", "device", "samples", *RANK_FIGURES]
    assert g0["gpu_power_w"] == 0.0 and isinstance(g0["gpu_power_w"], float)
    assert g2["gpu_temperature_c"] is None and g2["gpu_power_w"] == 120.0
    assert (g1["host"], g1["device"], g1["samples"]) == ("node-b", "GPU-0001", 12)
    assert g1["cpu_utilization"] == 0.98 and g1["gpu_memory_used_bytes"] == 31 * (1 << 30)


def test_a_cpu_only_rank_has_null_gpu_figures_never_zero():
    w = resource_window("run-x", {0: {"cpu_utilization": 0.5, "rss_bytes": GiB}, 1: {"cpu_utilization": 0.0,
                                                                                     "rss_bytes": GiB}})
    summary = summary_with(w)
    g0, g1 = (g["resources"] for g in summary["groups"])
    assert g0["gpu_utilization"] is None and g0["device"] is None and g0["gpu_power_w"] is None
    assert g1["cpu_utilization"] == 0.0
    gpu = summary["resources"]["global"]["ranks"]["gpu_utilization"]
    assert gpu["median"]["value"] is None and gpu["measured"] == 0
    assert "GPU" not in summary["card"].split("Resources:")[1].split("Telemetry")[0]


def test_nodes_and_memory_trends_are_listed_in_order_with_every_key():
    section = summary_with(busy_gpu_run("run-x"), three_rank_analysis())["resources"]
    assert [n["host"] for n in section["nodes"]] == ["node-a", "node-b"]
    b = section["nodes"][1]
    assert list(b) == ["host", "ranks", "samples", "sources", *NODE_FIGURES]
    assert b["ranks"] == [1, 2] and b["cpu_utilization"] == 0.97 and b["memory_total_bytes"] == 128 * (1 << 30)
    assert [t["rank"] for t in section["memory_trends"]] == [0, 1]
    creep = section["memory_trends"][1]
    assert list(creep) == list(TREND_KEYS)
    assert (creep["signal"], creep["onset_step"], creep["slope_bytes_per_step"]) == ("rss", 10, 12 * MiB)
    assert creep["growth_bytes"] == int(12 * MiB * 30)


def test_the_card_shows_median_and_worst_of_process_gpu_and_host_and_the_steepest_trend():
    card = summary_with(busy_gpu_run("run-x"), three_rank_analysis())["card"]
    assert "Resources: process CPU median 45% (r0), worst 98% (r1) | RSS median 2.5 GiB (r2), worst 3.5 GiB (r1)" \
        in card
    assert "GPU util median 62% (r1), worst 12% (r2)" in card
    assert "host CPU median" in card and "worst 97% (node-b)" in card
    assert "memory trend (steepest rank): r1 rss +12.0 MiB/step from step 10 (+360.0 MiB, +18%, fit r² 0.97)" in card


def test_a_hostile_host_name_is_escaped_on_the_card_and_kept_in_the_json():
    summary = summary_with(busy_gpu_run("run-x", hostile_host=HOSTILE), three_rank_analysis())
    card = summary["card"]
    assert "\x1b" not in card and "\x07" not in card and "\u202e" not in card
    assert "evil\\x1b]0;owned\\x07\\x0ahost\\u202e" in card
    resource_lines = card.split("Resources: ")[1].split("Telemetry")[0].splitlines()
    assert len(resource_lines) == 4  # the host's newline made no line of its own
    assert summary["resources"]["nodes"][0]["host"] == HOSTILE  # sorted: "evil..." < "node-a"
    assert summary["groups"][1]["resources"]["host"] == HOSTILE


def test_the_new_findings_are_shown_as_every_issue_is_with_their_evidence():
    analysis = three_rank_analysis()
    creep = DiagnosisIssue(
        kind=d.MEMORY_CREEP, severity=d.SEVERITY_WARN, status=d.STATUS_CONFIRMED, score=0.18,
        summary="rank 1's RSS rises 12.0 MiB per step from step 10", culprit_rank=1, component="rss",
        evidence={"signal": "rss", "rank": 1, "onset_step": 10, "slope_bytes_per_step": 12 * MiB,
                  "growth_bytes": 360 * MiB, "growth_ratio": 0.176, "level_bytes": 2 * GiB, "fit_r2": 0.97,
                  "ranks_rising": [1], "steps": 40})
    idle = DiagnosisIssue(
        kind=d.LOW_GPU_UTILIZATION, severity=d.SEVERITY_WARN, status=d.STATUS_CONFIRMED, score=None,
        summary="the GPUs ran kernels 62% of the time (rank 2: 12%)",
        evidence={"gpu_utilization": 0.62, "worst_rank": 2, "worst_gpu_utilization": 0.12, "ranks_measured": 3,
                  "threshold": 0.5})
    analysis = dataclasses.replace(analysis, diagnosis=StepTimeDiagnosis((creep, idle)))
    summary = summary_with(busy_gpu_run("run-x"), analysis)
    assert [i["kind"] for i in summary["issues"]] == ["MEMORY_CREEP", "LOW_GPU_UTILIZATION"]
    assert summary["issues"][0]["evidence"]["ranks_rising"] == [1]
    assert summary["issues"][0]["component"] == "rss"
    card = summary["card"]
    assert "Diagnosis: MEMORY_CREEP [warn, confirmed] score 0.180 rank 1\n  rank 1's RSS rises 12.0 MiB" in card
    assert "Also: LOW_GPU_UTILIZATION [warn, confirmed]\n  the GPUs ran kernels 62% of the time" in card
    jsonschema.validate(json.loads(json.dumps(summary, allow_nan=False)), SCHEMA)


def test_host_cpu_evidence_of_an_input_finding_survives_projection():
    analysis = straggler_analysis()
    first = analysis.diagnosis.issues[0]
    host_cpu = {"state": d.HOST_CPU_SATURATED, "utilization": 0.9712, "host": HOSTILE, "idle_cpus": 0.46}
    issue = dataclasses.replace(first, evidence={**first.evidence, "host_cpu": host_cpu})
    summary = summary_with(None, dataclasses.replace(analysis, diagnosis=StepTimeDiagnosis((issue,))))
    assert summary["diagnosis"]["evidence"]["host_cpu"] == host_cpu


def test_units_name_every_resource_unit():
    units = summary_with(None)["units"]
    assert units["*_utilization"].startswith("ratio") and units["*_c"] == "degrees Celsius"
    assert units["*_w"] == "watts" and units["*_bytes"] == "bytes" and units["start_time"] == "ISO 8601, UTC"


@pytest.mark.parametrize("value,expected", [(float("nan"), None), (float("inf"), None)])
def test_non_finite_figures_are_null(value, expected):
    w = resource_window("run-x", {0: {"gpu_power_w": value}})
    assert summary_with(w)["groups"][0]["resources"]["gpu_power_w"] is expected
