"""checks/peers_agreement.py's reading and judging of both tools' summaries, on summaries shaped as
each tool writes them, and the runner it hands the original's launcher.

The runs themselves (both tools' `traceml run` on real gloo jobs) are not made here:
`python -m checks.peers_agreement` does that, and reports a wrong diagnosis as a finding.
"""
from __future__ import annotations

import ast

from checks import peers_agreement as pa


def _ours(kind, culprit=None, issues=()):
    primary = {"kind": kind, "culprit_rank": culprit, "summary": "s"}
    return {"diagnosis": primary, "issues": [primary, *issues], "groups": []}


def _original(kind, ranks, issues=None):
    d = {"kind": kind, "ranks": ranks, "summary": "s", "evidence": {}}
    return {"step_time": {"diagnosis": d, "issues": issues if issues is not None else [d], "groups": {"rows": {}}}}


def test_the_original_blames_a_rank_only_in_its_straggler_kinds():
    # Elsewhere its `ranks` holds the slowest rank: COMPUTE_BOUND on a DDP job whose ranks are equal
    # lists one, and reading it as a culprit would credit the original with a straggler it never named.
    bound = pa.original_said(_original("COMPUTE_BOUND", [2]))
    assert bound["culprit_rank"] is None and bound["slowest_rank"] == 2
    assert pa.original_said(_original("COMPUTE_STRAGGLER", [1]))["culprit_rank"] == 1


def test_the_slowed_rank_must_be_the_primary_diagnosis_and_nobody_else_blamed():
    case = pa.COLLECTIVE_CASES["ddp-compute-straggler"]
    assert pa.judged_collective(case, pa.ours_said(_ours("COMPUTE_STRAGGLER", 2))) == "ok"
    assert pa.judged_collective(case, pa.ours_said(_ours("COMPUTE_STRAGGLER", 1))) == "WRONG"
    assert pa.judged_collective(case, pa.original_said(_original("COMPUTE_BOUND", [2]))) == "missed"


def test_a_straggler_named_beside_the_right_finding_is_wrong():
    case = pa.COLLECTIVE_CASES["collective-bound"]
    collective = {"kind": "COLLECTIVE_BOUND", "culprit_rank": None, "summary": "s"}
    assert pa.judged_collective(case, pa.ours_said(_ours("COLLECTIVE_BOUND"))) == "ok"
    straggler = {"kind": "INPUT_STRAGGLER", "culprit_rank": 0, "summary": "s"}
    assert pa.judged_collective(case, pa.ours_said(_ours("RESIDUAL_HEAVY", issues=(collective, straggler)))) == "WRONG"
    assert pa.judged_collective(case, pa.original_said(_original("RESIDUAL_HEAVY", [0]))) == "missed"


def test_a_drift_needs_its_onset_and_the_original_trend_note_counts_for_part():
    case = pa.COLLECTIVE_CASES["drift-60"]
    drift = {"kind": "STEP_TIME_DRIFT", "culprit_rank": None, "summary": "s",
             "evidence": {"onset_step": case.onset_step + pa.ONSET_TOLERANCE}}
    assert pa.judged_collective(case, pa.ours_said(_ours("RESIDUAL_HEAVY", issues=(drift,)))) == "ok"
    late = {**drift, "evidence": {"onset_step": case.onset_step + pa.ONSET_TOLERANCE + 1}}
    assert pa.judged_collective(case, pa.ours_said(_ours("RESIDUAL_HEAVY", issues=(late,)))) == "missed"
    original = pa.original_said(_original("RESIDUAL_HEAVY", [1]))
    assert pa.judged_collective(case, original) == "missed"
    original["note"] = "Trend: residual time is worsening (+88%)."
    assert pa.judged_collective(case, original) == "partly"


def test_the_runner_for_the_original_imports_nothing_of_this_project():
    tree = ast.parse(pa.ORIGINAL_RUNNER.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"runpy", "sys", "traceml_ai", "torch"}, imported
    assert pa.COLLECTIVE_SCRIPT.exists()
