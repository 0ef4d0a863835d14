"""`traceml run` end to end: torch's elastic launcher, 2 gloo ranks, the embedded processor.

Every test launches the real console script on real scripts (plain PyTorch, HF
Trainer, Lightning) and checks what a user gets: the exit status, the run folder,
`final_summary.json` with both ranks, and no processor left behind.
"""
from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time

import pytest

from harness.stored_rows import steps_per_rank
from tests.launcher.launcher_helpers import SCRIPTS, TRACEML, clean_env, processors_using, traceml


def _ranks_and_steps(summary: dict) -> dict[int, int]:
    return {g["global_rank"]: g["steps"] for g in summary["groups"]}


@pytest.mark.slow
def test_plain_pytorch_script_runs_on_two_ranks_and_ends_with_a_summary(plain_ddp_run):
    run = plain_ddp_run  # plain_ddp.py --steps 12 (tests/launcher/conftest.py)
    assert run.returncode == 0, run.output[-3000:]
    run_id = run.summary["metadata"]["run_id"]
    # One run id for every rank, instrumentation on, the script run as __main__ with its own args.
    for rank in (0, 1):
        assert (f"rank {rank}: __name__=__main__ argv=['--steps', '12'] launched=1 run_id={run_id}"
                in run.output)
    assert run.run_dir.name == run_id
    assert _ranks_and_steps(run.summary) == {0: 12, 1: 12}
    assert run.summary["metadata"]["training_strategy"] == "ddp"
    assert (run.run_dir / "summary_card.txt").read_text() in run.output  # the card is printed
    assert "final_summary.json" in run.output
    assert processors_using(run.run_dir) == []


@pytest.mark.slow
def test_a_crashing_rank_forwards_its_exit_code_and_the_run_is_still_summarised(workdir):
    run = traceml(["run", "--nproc-per-node", "2", str(SCRIPTS / "plain_ddp.py"), "--steps", "40",
                   "--fail-rank", "1", "--fail-at", "5", "--exit-code", "7"], workdir)
    assert run.returncode == 7, run.output[-3000:]
    assert "rank 1 failed with exit code 7" in run.output
    summary = run.summary
    assert summary["global"]["window"]["steps"] >= 4  # the steps completed before the failure
    assert sorted(_ranks_and_steps(summary)) == [0, 1]
    assert processors_using(run.run_dir) == []


def _watch_with_top(db):
    """`traceml top` on the live database prints progress lines whose step advances."""
    import re
    import selectors

    # Ctrl-C's default action restored in the child: a test run started in the
    # background (`cmd &` in a script) passes SIGINT on ignored, and Python then never
    # installs its KeyboardInterrupt handler. faulthandler: if it ever fails to exit,
    # SIGABRT dumps every thread's stack (below).
    top = subprocess.Popen([str(TRACEML), "top", "--db", str(db), "--refresh", "0.5"],
                           env={**clean_env(), "PYTHONFAULTHANDLER": "1"},
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    steps: list[int] = []
    try:
        selector = selectors.DefaultSelector()
        selector.register(top.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 60
        while len(set(steps)) < 2 and time.monotonic() < deadline:
            if selector.select(timeout=1.0):
                line = top.stdout.readline()
                match = re.match(r"\[traceml\] step (\d+) \[live\]", line)
                if match:
                    steps.append(int(match.group(1)))
        selector.close()
        top.send_signal(signal.SIGINT)
        # Keep reading while it exits: its last frames must not fill the pipe and block it.
        try:
            top.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            top.send_signal(signal.SIGABRT)
            stacks, _ = top.communicate(timeout=30)
            raise AssertionError(f"traceml top did not exit on SIGINT; its threads:\n{stacks[-6000:]}")
        assert top.returncode == 0
    finally:
        if top.poll() is None:
            top.kill()
    assert len(set(steps)) >= 2 and steps == sorted(steps), steps


@pytest.mark.slow
def test_sigterm_reaches_the_ranks_and_the_run_is_still_summarised(workdir):
    proc = subprocess.Popen(
        [str(TRACEML), "run", "--nproc-per-node", "2", "--run-id", "sigterm-run",
         str(SCRIPTS / "plain_ddp.py"), "--steps", "3000", "--step-sleep", "0.02"],
        cwd=workdir, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    db = workdir / "traceml_runs" / "sigterm-run" / "traceml.sqlite"
    try:
        deadline = time.monotonic() + 120
        while min(steps_per_rank(db).values() or [0]) < 5 or len(steps_per_rank(db)) < 2:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no steps arrived"
            time.sleep(0.5)
        _watch_with_top(db)  # while the run is going: `traceml top` from another "terminal"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    summary_path = db.parent / "final_summary.json"
    assert summary_path.exists(), output[-3000:]
    assert processors_using(db.parent) == []


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
                    reason="needs transformers and accelerate (the huggingface extra)")
@pytest.mark.slow
def test_hugging_face_trainer_script_is_instrumented_without_code_changes(workdir):
    run = traceml(["run", "--nproc-per-node", "2", str(SCRIPTS / "hf_trainer.py"), "8"], workdir, TRACEML_EXIT_AFTER_FLUSH="1")
    assert run.returncode == 0, run.output[-3000:]
    assert _ranks_and_steps(run.summary) == {0: 8, 1: 8}  # one TraceML step per optimizer step
    assert run.summary["global"]["median"]["forward_ms"]["value"] is not None


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning (the lightning extra)")
@pytest.mark.slow
def test_lightning_script_is_instrumented_without_code_changes(workdir):
    run = traceml(["run", "--nproc-per-node", "2", str(SCRIPTS / "lightning_fit.py"), "8", "2"], workdir, TRACEML_EXIT_AFTER_FLUSH="1")
    assert run.returncode == 0, run.output[-3000:]
    assert _ranks_and_steps(run.summary) == {0: 8, 1: 8}
    assert run.summary["global"]["median"]["backward_ms"]["value"] is not None


@pytest.mark.slow
def test_with_an_endpoint_the_launcher_only_exports(workdir, tmp_path_factory):
    """An external processor receives the ranks' telemetry; no embedded processor, no run folder."""
    from traceml.launcher.embedded import EmbeddedProcessor

    elsewhere = tmp_path_factory.mktemp("external")
    external = EmbeddedProcessor(elsewhere / "ext.sqlite", elsewhere / "summaries", elsewhere / "log")
    endpoints = external.start()
    try:
        run = traceml(["run", "--nproc-per-node", "2", "--run-id", "exported",
                       "--endpoint", endpoints.otlp_grpc_endpoint,
                       str(SCRIPTS / "plain_ddp.py"), "--steps", "6"], workdir)
        assert run.returncode == 0, run.output[-3000:]
        assert "exporting OTLP to" in run.output
        assert not (workdir / "traceml_runs").exists()
        assert steps_per_rank(elsewhere / "ext.sqlite") == {0: 6, 1: 6}
    finally:
        external.stop()


@pytest.mark.slow
def test_training_still_runs_when_the_embedded_processor_cannot_start(workdir):
    # A directory where the database file should be: the real processor fails to open it.
    (workdir / "traceml_runs" / "blocked" / "traceml.sqlite").mkdir(parents=True)
    run = traceml(["run", "--nproc-per-node", "2", "--run-id", "blocked",
                   str(SCRIPTS / "plain_ddp.py"), "--steps", "3"], workdir)
    assert run.returncode == 0, run.output[-3000:]
    assert "the script runs without telemetry collection" in run.output
    assert "rank 1: __name__=__main__" in run.output
    assert not (workdir / "traceml_runs" / "blocked" / "final_summary.json").exists()


@pytest.mark.slow
def test_a_missing_script_is_refused_before_anything_starts(workdir):
    run = traceml(["run", "--nproc-per-node", "2", "no_such_script.py"], workdir)
    assert run.returncode == 2, run.output[-3000:]
    assert "can't open file 'no_such_script.py'" in run.output
    assert not (workdir / "traceml_runs").exists()
