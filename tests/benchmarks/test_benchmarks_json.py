"""Benchmarks' `--json`: one JSON object on stdout, of the shape `benchmarks/lib/json_output.py` promises.

Runs the cheapest benchmarks in tiny configurations; the figures themselves are not
judged here (a shared CI machine says nothing about them), only that they are there.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from harness.child_python import ROOT, child_env, module_command


def _run_json(module: str, *args: str) -> dict:
    out = subprocess.run(module_command(module, *args, "--json"), cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    document = json.loads(out.stdout)  # stdout holds the object alone: the table went to stderr
    assert document["benchmark"] == module.rsplit(".", 1)[1]
    assert "json" not in document["config"]
    return document


@pytest.mark.slow
def test_bench_surfaces_prints_its_figures_as_json():
    document = _run_json("benchmarks.bench_surfaces", "--ranks", "1", "2", "--repeats", "1")
    assert document["config"]["ranks"] == [1, 2]
    rows = document["figures"]["surfaces"]
    assert [row["ranks"] for row in rows] == [1, 2]
    for row in rows:
        for key in ("analyzer_ms", "diagnose_ms", "final_summary_ms", "summary_metric_points_ms", "render_live_ms"):
            assert row[key] > 0


@pytest.mark.slow
def test_bench_step_time_prints_its_figures_as_json():
    document = _run_json("benchmarks.bench_step_time", "--ranks", "1", "--summary-ranks", "1",
                         "--summary-steps", "50")
    (live,) = document["figures"]["live"]
    assert live["ranks"] == 1 and live["live_ms"] > 0 and live["cold_ms"] > 0
    summary = document["figures"]["summary"]
    assert summary["ranks"] == 1 and summary["steps"] == 50 and summary["wall_s"] > 0


def test_every_benchmark_takes_json():
    """The promise covers every benchmark, not only the two cheap enough to run here."""
    import ast

    missing = []
    for path in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        tree = ast.parse(path.read_text())
        calls = {node.func.id for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        if not {"add_json_flag", "print_json"} <= calls:
            missing.append(path.name)
    assert missing == [], f"benchmarks without --json (add_json_flag + print_json): {missing}"


@pytest.mark.slow
def test_bench_cold_cache_steps_against_another_checkout_print_as_json():
    """Both step sections, this checkout against a second copy of itself (`--against`)."""
    document = _run_json("benchmarks.bench_cold_cache", "--samples", "0", "--phase-rounds", "1",
                         "--marked-rounds", "1", "--against", str(ROOT))
    figures = document["figures"]
    for section, modes in (("phase_steps", ("manual", "manual_hooks", "auto", "auto_first_step", "control")),
                           ("marked_steps", ("manual", "manual_hooks", "auto", "control"))):
        assert set(figures[section]) == {"against", "this"}
        for row in figures[section].values():
            assert row["sampler_us_per_traced_step"] > 0
            assert all(value > 0 for value in row["plain_us"].values())
            for mode in modes:
                assert "step" in row[mode]
    assert "glue" in figures["marked_steps"]["this"]["manual"]
