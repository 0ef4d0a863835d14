"""bench_resources runs end to end and reports its figures (a tiny configuration; the figures
themselves are not judged on a shared machine, only that each estimator produced one)."""
from __future__ import annotations

import json
import subprocess

import pytest

from harness.child_python import ROOT, child_env, module_command


ROUNDS = "4"
"""Each round's sampler block lasts about three 0.1 s intervals, so it holds about two ticks; with
two rounds a clean-clone CI run once saw none at all (on_block_ticks 0), so four rounds give the
per-tick figures more than one chance."""


@pytest.mark.slow
def test_bench_resources_prints_its_figures_as_json():
    out = subprocess.run(module_command("benchmarks.bench_resources", "--rounds", ROUNDS, "--interval", "0.1",
                                        "--tick-seconds", "3", "--hidden", "64", "--json"),
                         cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    document = json.loads(out.stdout)
    assert document["benchmark"] == "bench_resources" and document["config"]["interval"] == 0.1
    figures = document["figures"]
    assert figures["tick_cpu_us_local_rank0"] > figures["tick_cpu_us_other_rank"] > 0  # the host part costs
    assert figures["tick_count"] >= 10 and figures["on_block_ticks"] >= 2
    for key in ("throughput_ratio_on", "throughput_ratio_control", "tick_throughput_ratio"):
        assert 0.5 < figures[key] < 2.0, key
    assert figures["encode_snapshot_us"] > 0 and figures["thread_tick_cpu_us"] > 0
