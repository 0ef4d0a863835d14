"""Public-schema golden: the key set and, per scenario, which values are null.

The golden (`golden/step_time_public_schema.json`) stores the schema version, the
union of public key paths (list indices written `[]`), and per scenario every
leaf path with `null` or `value`. A renamed key or a changed null pattern fails
with a diff. To accept an intended change: bump SCHEMA_VERSION in
schema/summary.py, add a CHANGELOG entry, and run

    pytest tests/step_time/test_public_schema_golden.py --update-golden

which refuses to rewrite a key or null-pattern change at an unchanged version.
A new scenario that brings no new key needs no bump.

Besides the contract scenarios (whose stores hold no resource samples, so their
`resources` sections are the all-null shape), one summary is made with a hand-built
`ResourceWindow` (`WITH_RESOURCES`), so the key set holds every resource key and the
golden pins which of them a measured run fills.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest

from harness.captures import capture_records
from harness.resource_windows import busy_gpu_run
from tests.step_time.scenarios import SCENARIOS
from traceml.processor.reporting import RunMetadata, project_final_summary
from traceml.processor.step_time.pipeline import PROFILE_SUMMARY, StepTimePipeline, StepTimeRequest
from traceml.schema.summary import SCHEMA_VERSION, final_summary_json_schema_text

GOLDEN = Path(__file__).parent / "golden" / "step_time_public_schema.json"
WITH_RESOURCES = "complete_gpu_with_resources"
"""complete_gpu's analysis with process, host and GPU figures of three ranks on two hosts."""
WITH_CAPTURES = "ddp_rank_straggler_with_captures"
"""ddp_rank_straggler's analysis with a done capture of its finding and a failed manual one."""


# --- Pattern extraction and comparison (pure, tested below) ----------------------------------


OPAQUE_SUFFIXES = (".evidence", "telemetry.rejected_rows")
"""Objects whose keys are data or rule-specific (documented in DIAGNOSIS.md): one leaf each."""
DIAGNOSIS_PREFIXES = ("diagnosis", "issues[")
"""Which issues fire is diagnosis, not schema: their keys count, their null pattern does not."""


def leaf_patterns(value, prefix: str = "") -> dict[str, str]:
    """Every leaf path -> "null" or "value"; empty containers and opaque objects are leaves."""
    out: dict[str, str] = {}
    if isinstance(value, dict) and value and not prefix.endswith(OPAQUE_SUFFIXES):
        for key, child in value.items():
            out.update(leaf_patterns(child, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(value, list) and value:
        for i, child in enumerate(value):
            out.update(leaf_patterns(child, f"{prefix}[{i}]"))
    else:
        out[prefix] = "null" if value is None else "value"
    return out


def key_set(patterns: dict[str, str]) -> set[str]:
    import re
    return {re.sub(r"\[\d+\]", "[]", path) for path in patterns}


def build_golden(summaries: dict[str, dict], version: str) -> dict:
    patterns = {name: leaf_patterns(summary) for name, summary in sorted(summaries.items())}
    keys = sorted(set().union(*(key_set(p) for p in patterns.values()))) if patterns else []
    scenarios = {name: {path: v for path, v in p.items() if not path.startswith(DIAGNOSIS_PREFIXES)}
                 for name, p in patterns.items()}
    return {"schema_version": version, "keys": keys, "scenarios": scenarios}


def golden_changes(old: dict, new: dict) -> list[str]:
    """Key and null-pattern differences that need a schema version bump.

    A scenario present only in `new` counts only through new keys; a scenario
    only in `old` is not a public change (its keys stay in the key set or not).
    """
    changes = [f"key removed: {k}" for k in sorted(set(old["keys"]) - set(new["keys"]))]
    changes += [f"key added: {k}" for k in sorted(set(new["keys"]) - set(old["keys"]))]
    for name in sorted(set(old["scenarios"]) & set(new["scenarios"])):
        before, after = old["scenarios"][name], new["scenarios"][name]
        for path in sorted(set(before) | set(after)):
            if before.get(path) != after.get(path):
                changes.append(f"{name}: {path}: {before.get(path, 'absent')} -> {after.get(path, 'absent')}")
    return changes


def update_refusal(old: dict | None, new: dict) -> str | None:
    """Why `--update-golden` must not rewrite, or None when it may."""
    if old is None:
        return None
    changes = golden_changes(old, new)
    if changes and new["schema_version"] == old["schema_version"]:
        return (f"refusing to rewrite the golden: {len(changes)} key/null-pattern change(s) at unchanged "
                f"SCHEMA_VERSION {new['schema_version']}; bump it in schema/summary.py and add a "
                "CHANGELOG entry first:\n  " + "\n  ".join(changes[:50]))
    return None


# --- The scenario summaries ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def summaries(scenario_db) -> dict[str, dict]:
    """Each scenario's final summary over the window the final report resolves (summary profile)."""
    pipeline = StepTimePipeline()
    out = {}
    for name in SCENARIOS:
        analysis = pipeline.run(StepTimeRequest(scenario_db(name), name, profile=PROFILE_SUMMARY))
        out[name] = project_final_summary(
            analysis, RunMetadata(run_id=name, generated_at=1_700_000_000.0, traceml_version="test"))
        if name == "complete_gpu":
            out[WITH_RESOURCES] = project_final_summary(
                dataclasses.replace(analysis, resources=busy_gpu_run(name)),
                RunMetadata(run_id=name, generated_at=1_700_000_000.0, traceml_version="test"))
        if name == "ddp_rank_straggler":
            primary = analysis.diagnosis.primary
            out[WITH_CAPTURES] = project_final_summary(
                analysis, RunMetadata(run_id=name, generated_at=1_700_000_000.0, traceml_version="test"),
                captures=capture_records(name, primary.kind, primary.culprit_rank, 1 - primary.culprit_rank))
    return out


def test_public_schema_matches_golden(summaries, request):
    new = build_golden(summaries, SCHEMA_VERSION)
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else None
    if request.config.getoption("--update-golden"):
        refusal = update_refusal(old, new)
        if refusal:
            pytest.fail(refusal)
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
        return
    assert old is not None, f"{GOLDEN} is missing: run pytest {__file__} --update-golden"
    assert old["schema_version"] == SCHEMA_VERSION, (
        "SCHEMA_VERSION changed: regenerate the golden with --update-golden")
    assert sorted(old["scenarios"]) == sorted(new["scenarios"]), "scenario set changed: run --update-golden"
    changes = golden_changes(old, new)
    assert not changes, "public schema changed:\n  " + "\n  ".join(changes[:80])


@pytest.mark.slow
def test_each_scenario_final_summary_validates_against_the_json_schema(summaries):
    schema = json.loads(final_summary_json_schema_text())
    for name, summary in summaries.items():
        jsonschema.validate(json.loads(json.dumps(summary, allow_nan=False)), schema)


def test_every_scenario_has_the_same_fixed_section_keys(summaries):
    tops = {name: (list(s), list(s["global"]), list(s["groups"][0]["metrics"])) for name, s in summaries.items()}
    assert len({json.dumps(v) for v in tops.values()}) == 1


# --- The refusal rule itself ------------------------------------------------------------------------


def _golden(version, scenarios):
    return build_golden(scenarios, version)


def test_refuses_a_renamed_key_at_an_unchanged_version():
    old = _golden("1.0", {"a": {"metrics": {"forward_ms": 1.0}}})
    new = _golden("1.0", {"a": {"metrics": {"fwd_ms": 1.0}}})
    refusal = update_refusal(old, new)
    assert refusal and "key removed: metrics.forward_ms" in refusal and "key added: metrics.fwd_ms" in refusal


def test_refuses_a_null_pattern_change_at_an_unchanged_version():
    old = _golden("1.0", {"a": {"metrics": {"forward_ms": 1.0}}})
    new = _golden("1.0", {"a": {"metrics": {"forward_ms": None}}})
    assert "a: metrics.forward_ms: value -> null" in update_refusal(old, new)


def test_accepts_the_same_change_after_a_version_bump():
    old = _golden("1.0", {"a": {"metrics": {"forward_ms": 1.0}}})
    new = _golden("1.1", {"a": {"metrics": {"fwd_ms": None}}})
    assert update_refusal(old, new) is None


def test_accepts_a_new_scenario_without_new_keys_and_refuses_one_with_new_keys():
    old = _golden("1.0", {"a": {"metrics": {"forward_ms": 1.0}}})
    assert update_refusal(old, _golden("1.0", {"a": {"metrics": {"forward_ms": 1.0}},
                                               "b": {"metrics": {"forward_ms": None}}})) is None
    assert update_refusal(old, _golden("1.0", {"a": {"metrics": {"forward_ms": 1.0}},
                                               "b": {"metrics": {"forward_ms": None, "new_ms": 2.0}}}))


def test_list_indices_collapse_in_the_key_set_but_not_in_patterns():
    patterns = leaf_patterns({"groups": [{"x": None}, {"x": 1.0}], "caps": [],
                              "issues": [{"evidence": {"share": 0.2}, "score": None}]})
    assert patterns == {"groups[0].x": "null", "groups[1].x": "value", "caps": "value",
                        "issues[0].evidence": "value", "issues[0].score": "null"}
    assert key_set(patterns) == {"groups[].x", "caps", "issues[].evidence", "issues[].score"}


def test_diagnosis_outcomes_are_not_part_of_the_null_pattern():
    old = _golden("1.0", {"a": {"issues": [{"score": 0.2}], "m": 1.0}})
    new = _golden("1.0", {"a": {"issues": [{"score": None}], "m": 1.0}})
    assert update_refusal(old, new) is None
