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


def test_mean_interval_brackets_the_mean_and_narrows_with_more_blocks():
    few = bench_peers.mean_interval([0.001, 0.003, 0.002, 0.002])
    many = bench_peers.mean_interval([0.001, 0.003, 0.002, 0.002] * 25)
    assert few[1] < few[0] == 0.002 < few[2]
    assert many[2] - many[1] < few[2] - few[1]


@pytest.mark.slow
def test_background_in_place_reads_the_other_threads_cpu_in_training_and_idle_blocks():
    """A thread beside the steps burning CPU now and then: its share shows while training, its steps are
    marked, and the idle blocks (with the thread stopped) read about nothing."""
    import threading
    import time

    stop, busy = threading.Event(), threading.Event()

    def other():
        while not stop.is_set():
            if busy.is_set():
                t0 = time.thread_time()
                while time.thread_time() - t0 < 0.002:  # 2 ms of CPU
                    pass
            time.sleep(0.02)

    class Helper:
        def cpu_s(self) -> float:
            return 0.0

    def run(steps, out, clock):
        for _ in range(steps):
            t0 = clock()
            time.sleep(0.005)
            out.append(clock() - t0)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    busy.set()
    try:
        original = bench_peers.BACKGROUND_BLOCK_S
        bench_peers.BACKGROUND_BLOCK_S = 0.2
        got = bench_peers.background_in_place(
            lambda steps, out, clock: (run(steps, out, clock), busy.clear() if len(out) > 40 else None),
            Helper(), train_s=0.6, idle_s=0.4, settle_s=0.0)
    finally:
        bench_peers.BACKGROUND_BLOCK_S = original
        stop.set()
        thread.join()
    assert len(got["train"]) >= 2 and len(got["idle"]) == 2
    assert got["train"][0]["threads_cpu_s"] > 0.005 and got["train"][0]["steps"] > 0
    assert sum(got["marked"]) > 0 and len(got["marked"]) == len(got["durations"])
    assert all(b["threads_cpu_s"] < 0.002 for b in got["idle"])
