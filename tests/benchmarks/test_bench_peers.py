"""bench_peers' wiring that runs without the peer environment: its worker protocol over a real
subprocess of this project's venv, the shim benchmarks/lib/peers.py hands the original's launcher,
its interval.

The peer environment itself (a pip install from the registry) and the peers' figures are
not built or judged here: `python -m benchmarks.bench_peers --quick` does that.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from benchmarks import bench_peers
from benchmarks.lib import peers


def test_the_shim_for_the_original_is_python_and_serves_what_the_workload_calls():
    tree = ast.parse(peers.ORIGINAL_SHIM)
    names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    names |= {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets}
    workload = ast.parse(peers.WORKLOAD.read_text())
    called = {node.func.attr for node in ast.walk(workload)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "traceml"}
    assert called and called <= names, f"the workload calls traceml.{sorted(called - names)}, which the shim lacks"


def test_bootstrap_interval_brackets_the_median():
    diffs = [float(i % 11) for i in range(200)]
    lo, hi = bench_peers.bootstrap_median(diffs)
    assert lo <= sorted(diffs)[100] <= hi
    assert hi - lo < 5


@pytest.mark.slow
def test_our_analysis_worker_answers_over_its_pipe():
    worker = bench_peers.Worker(Path(sys.executable), ["--analysis", "ours"], peers.our_env())
    try:
        built = worker.ask("build", ranks=2, steps=120)
        assert built["rows_per_s"] > 0 and built["cold_s"] > 0
        assert worker.ask("live", ranks=2) > 0
        assert worker.ask("summary", ranks=2) > 0
        with pytest.raises(RuntimeError, match="worker"):
            worker.ask("live", ranks=3)  # no store built for 3 ranks: the error comes back, the worker lives
        assert worker.ask("live", ranks=2) > 0
    finally:
        worker.close()
    assert worker.proc.returncode == 0


@pytest.mark.slow
def test_torch_profiler_training_worker_times_each_variant():
    worker = bench_peers.Worker(Path(sys.executable), ["--worker", "torch-profiler", "--shape", "small"],
                                peers.our_env())
    try:
        variants = worker.ask("variants")
        assert variants == ["plain", "control", "torch.profiler", "torch.profiler, schedule"]
        for name in variants:
            steps = worker.ask("run", variant=name, steps=5)
            assert len(steps) == 5 and all(wall > 0 and cpu > 0 for wall, cpu in steps)
        cpu = worker.ask("cpu")
        assert cpu["process_cpu_s"] >= cpu["thread_cpu_s"] > 0
    finally:
        worker.close()
