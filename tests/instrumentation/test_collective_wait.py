"""Collective wait on real gloo process groups (ranks started here, each a real process).

- explicit collectives in a plain loop: the rank that arrives late waits little,
  the other waits for it; async calls are timed at `wait()`, nested calls once;
- DDP, 3 ranks, one slowed inside backward by a slow gradient hook: the others'
  wait is larger and the slow rank's graph end (`last_entry`) is latest;
- a user's own comm hook (before the first forward, and after it) keeps working, and
  the wait is measured the same way (TraceML registers no hook of its own).
"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys

import pytest

from harness import free_port

SCRIPT = pathlib.Path(__file__).with_name("collective_rank_script.py")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(tmp_path, scenario: str, world: int) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT))
        env.pop("TRACEML_DISABLE", None)
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), scenario, str(tmp_path / f"r{rank}.json")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
    return [json.loads((tmp_path / f"r{rank}.json").read_text()) for rank in range(world)]


def _median(result: dict, key: str, skip: int = 1) -> float:
    return statistics.median(s[key] for s in result["steps"][skip:])


@pytest.mark.slow
def test_explicit_collectives_in_a_plain_loop_are_timed(tmp_path):
    fast, slow = _run(tmp_path, "explicit", 2)
    assert fast["sum"] == slow["sum"] == 2.0
    for result in (fast, slow):
        assert len(result["steps"]) == 8
        # all_reduce + the async all_reduce's wait() + all_gather_object (its inner all_gather
        # is nested: counted once); the async call itself is not timed.
        assert {s["wait_count"] for s in result["steps"]} == {3}, result["steps"]
        assert all(s["last_entry_s"] is not None and s["last_entry_s"] >= 0 for s in result["steps"])
        assert "foreign_thread" not in result["misuse"]
    # Rank 1 sleeps 50 ms before its all_reduce: rank 0 waits for it there, and rank 1 waits
    # clearly less (by 20 of those 50 ms: its other two collectives wait on a busy machine too).
    assert _median(fast, "wait_ms") >= 40.0, fast["steps"]
    assert _median(slow, "wait_ms") < _median(fast, "wait_ms") - 20.0, (fast["steps"], slow["steps"])


@pytest.mark.slow
def test_ddp_rank_slowed_in_backward_waits_least_and_enters_last(tmp_path):
    results = _run(tmp_path, "ddp", 3)
    slow = results[2]
    for result in results:
        assert all(s["wait_count"] == 1 for s in result["steps"]), result["steps"]
        assert all(s["wait_ms"] <= s["backward_ms"] for s in result["steps"]), "a sub-interval of backward"
    assert len({round(r["param_sum"], 4) for r in results}) == 1, "DDP still averages the gradients"
    for fast in results[:2]:
        assert _median(fast, "wait_ms") >= 30.0, fast["steps"]
        assert _median(fast, "wait_ms") > _median(slow, "wait_ms") + 20.0, (fast["steps"], slow["steps"])
        assert _median(slow, "last_entry_s") > _median(fast, "last_entry_s") + 0.02
    assert results[0]["hook_calls"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["user_hook", "late_user_hook"])
def test_a_users_comm_hook_keeps_working_and_is_timed(tmp_path, scenario):
    results = _run(tmp_path, scenario, 2)
    assert len({round(r["param_sum"], 4) for r in results}) == 1
    for result in results:
        assert result["hook_calls"] >= (8 if scenario == "user_hook" else 6)
        assert all(s["wait_count"] == 1 for s in result["steps"]), result["steps"]
        assert "foreign_thread" not in result["misuse"]
