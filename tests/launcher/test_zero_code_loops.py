"""`traceml run` on scripts that never mention TraceML: steps from the optimizer updates.

Real launcher runs (torch's elastic launcher, 2 gloo ranks, the embedded processor)
of unmodified loops: a plain loop gets one step per update and the diagnosis the
same loop gets when marked with `trace_step`; gradient accumulation and two
optimizers give one step per update (round); an inference loop gets no step and
says why; a marked script gets no inferred step on top; a plain Accelerate loop
gets Accelerate's accumulation groups. Per-step counts are read back from the
run's SQLite database (`<metric>_count` columns).
"""
from __future__ import annotations

import importlib.util

import pytest

from harness.stored_rows import finished_ranks
from tests.launcher.launcher_helpers import PLAIN_DDP_STEPS, SCRIPTS, traceml
from traceml.processor.sqlite_layout import connect_readonly

# gloo's teardown can abort on a loaded CPU (see plain_ddp.py): leave after the flush.
EXIT = {"TRACEML_EXIT_AFTER_FLUSH": "1"}
NO_STEP_WARNING = "TraceML: no step was recorded in this process"


def _per_step(run, column: str) -> dict[int, list]:
    """rank -> the column's value for each of its steps, in step order."""
    db = run.run_dir / "traceml.sqlite"
    conn = connect_readonly(db)
    try:
        rows = conn.execute(f"SELECT global_rank, step, {column} FROM step_time_samples "
                            "ORDER BY global_rank, step").fetchall()
    finally:
        conn.close()
    out: dict[int, list] = {}
    for rank, _step, value in rows:
        out.setdefault(rank, []).append(value)
    return out


def _plain(workdir, *args: str):
    workdir.mkdir(parents=True, exist_ok=True)
    run = traceml(["run", "--nproc-per-node", "2", str(SCRIPTS / "plain_loop.py"), *args], workdir, **EXIT)
    assert run.returncode == 0, run.output[-4000:]
    return run


@pytest.mark.slow
def test_an_unmarked_loop_gets_one_step_per_update_and_the_marked_loops_diagnosis(tmp_path):
    straggler = ["--updates", "30", "--straggler-rank", "1", "--delay-ms", "25"]
    unmarked = _plain(tmp_path / "unmarked", *straggler)
    marked = _plain(tmp_path / "marked", *straggler, "--marked")
    for run in (unmarked, marked):
        assert _per_step(run, "optimizer_step_count") == {0: [1] * 30, 1: [1] * 30}
        assert _per_step(run, "backward_count") == {0: [1] * 30, 1: [1] * 30}
        assert _per_step(run, "forward_count") == {0: [1] * 30, 1: [1] * 30}  # the DDP model, found
        diagnosis = run.summary["diagnosis"]
        assert diagnosis["kind"] == "INPUT_STRAGGLER", run.output[-4000:]
        assert diagnosis["culprit_rank"] == 1 and diagnosis["severity"] == "crit"
    assert NO_STEP_WARNING not in unmarked.output


@pytest.mark.slow
def test_gradient_accumulation_gives_one_step_per_update(tmp_path):
    run = _plain(tmp_path, "--updates", "8", "--accum", "4")
    assert _per_step(run, "backward_count") == {0: [4] * 8, 1: [4] * 8}
    assert _per_step(run, "input_wait_count") == {0: [4] * 8, 1: [4] * 8}
    assert _per_step(run, "optimizer_step_count") == {0: [1] * 8, 1: [1] * 8}


@pytest.mark.slow
def test_two_optimizers_give_one_step_per_update_round(tmp_path):
    run = _plain(tmp_path, "--updates", "8", "--optimizers", "2")
    # Round 0 ends at the first optimizer (the second is not known yet); every later
    # round ends at the second one, so step 1 holds round 0's second update as well.
    expected = [1, 3] + [2] * 6
    assert _per_step(run, "optimizer_step_count") == {0: expected, 1: expected}
    assert _per_step(run, "backward_count") == {0: [1] * 8, 1: [1] * 8}


@pytest.mark.slow
def test_an_inference_loop_gets_no_step_and_says_why(tmp_path):
    run = traceml(["run", "--nproc-per-node", "2", str(SCRIPTS / "plain_loop.py"), "--no-optimizer"],
                  tmp_path, **EXIT)
    assert "rank 0: evaluated 12 batches" in run.output
    assert run.output.count(NO_STEP_WARNING) == 2  # once per rank
    assert _per_step(run, "step") == {}
    ended = finished_ranks(run.run_dir / "traceml.sqlite", run.run_dir.name)
    assert {rank: counts.get("traceml.steps.completed") for rank, counts in ended.items()} == {0: 0, 1: 0}
    # The end markers' boundary (`none`) reaches the summary: NO_STEPS says no optimizer was seen.
    assert {rank: counts.get("traceml.steps.boundary") for rank, counts in ended.items()} == {0: "none", 1: "none"}
    diagnosis = run.summary["diagnosis"]
    assert diagnosis["kind"] == "NO_STEPS" and diagnosis["evidence"]["reason"] == "no_step_marked"
    assert "no optimizer seen" in diagnosis["summary"] and diagnosis["evidence"]["no_optimizer_seen"] == [0, 1]


@pytest.mark.slow
def test_a_marked_script_gets_no_inferred_step_on_top(plain_ddp_run):
    run = plain_ddp_run  # plain_ddp.py, marked with trace_step (tests/launcher/conftest.py)
    assert run.returncode == 0, run.output[-4000:]
    steps = [1] * PLAIN_DDP_STEPS
    assert _per_step(run, "optimizer_step_count") == {0: steps, 1: steps}
    assert _per_step(run, "traced_step_time_count") == {0: steps, 1: steps}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")
def test_a_plain_accelerate_loop_gets_accelerates_accumulation_groups(tmp_path):
    run = traceml(["run", "--nproc-per-node", "2", str(SCRIPTS / "accelerate_loop.py"),
                   "--accum", "3", "--micro-batches", "11"], tmp_path, **EXIT)
    assert run.returncode == 0, run.output[-4000:]
    assert "process 0: 4 updates" in run.output and "process 1: 4 updates" in run.output
    groups = {0: [3, 3, 3, 2], 1: [3, 3, 3, 2]}
    assert _per_step(run, "backward_count") == groups
    assert _per_step(run, "forward_count") == groups  # the prepared model, named by the seam
    assert _per_step(run, "optimizer_step_count") == {0: [1] * 4, 1: [1] * 4}
    waits = _per_step(run, "input_wait_cpu_ms")
    assert all(w is not None and w > 0 for per_rank in waits.values() for w in per_rank)
    assert run.summary["global"]["window"]["steps"] == 4
