"""benchmarks/bench_web.py in a tiny configuration: its JSON figures, and one analysis per tick."""
from __future__ import annotations

import json
import subprocess

import pytest

from harness.child_python import ROOT, child_env, module_command


@pytest.mark.slow
def test_bench_web_reports_one_refresh_and_one_analysis_per_tick_for_ten_pages():
    out = subprocess.run(module_command("benchmarks.bench_web", "--ranks", "4", "--ticks", "2", "--json"),
                         cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    document = json.loads(out.stdout)
    assert document["benchmark"] == "bench_web"
    (row,) = document["figures"]["web"]
    assert row["ranks"] == 4 and row["pages"] == 10
    assert row["refreshes_per_tick"] == 1 and row["analyses_per_tick"] == 1
    assert row["json_bytes"] > 1000 and row["session_refresh_ms"] > 0 and row["web_tick_ms"] > 0
