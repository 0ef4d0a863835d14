"""Honest endings: how each rank ended (end markers joined with exit codes), NO_STEPS, `ended` in top.

The rule tests are pure; the launcher tests run the real `traceml run` on real
scripts: a run that marks no step, one whose script fails before its first step,
Ctrl-C (SIGINT to the launcher's process group) while two ranks train, and
`traceml top --once` on the run that ended.
"""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time

import jsonschema
import pytest

from harness.stored_rows import steps_per_rank
from tests.launcher.launcher_helpers import SCRIPTS, TRACEML, clean_env, processors_using, traceml
from traceml.processor.diagnosis.no_steps import no_steps_issue
from traceml.processor.endings import LauncherEnding, RankEndFacts, rank_ending, rank_endings
from traceml.schema.summary import final_summary_json_schema_text

SCHEMA = json.loads(final_summary_json_schema_text())


# --- the rule ----------------------------------------------------------------------------------

def test_the_launchers_exit_code_wins_over_the_marker():
    marker_says_finished = RankEndFacts(0, True, "finished", 0)
    # Exit 134 after a clean return (an abort in interpreter teardown): the code is the truth.
    ending = rank_ending(marker_says_finished, LauncherEnding(exit_codes={0: 134}))
    assert (ending.outcome, ending.exit_code, ending.end_marker) == ("failed", 134, True)
    # torch reports a death by signal as a negative code: the shell's 128 + N.
    assert rank_ending(RankEndFacts(1, False), LauncherEnding(exit_codes={1: -9})).exit_code == 137
    assert rank_ending(RankEndFacts(1, False), LauncherEnding(exit_codes={1: -2})).outcome == "interrupted"
    assert rank_ending(RankEndFacts(1, False), LauncherEnding(others_exit_code=0)).outcome == "finished"


def test_without_an_exit_code_the_marker_then_the_launchers_signal_then_lost():
    assert rank_ending(RankEndFacts(0, True, "interrupted", 130)).outcome == "interrupted"
    assert rank_ending(RankEndFacts(0, True, "failed", 3)).exit_code == 3
    assert rank_ending(RankEndFacts(0, True)).outcome == "finished"  # an older exporter's marker
    assert rank_ending(RankEndFacts(0, False), LauncherEnding(signal=int(signal.SIGINT))).outcome == "interrupted"
    assert rank_ending(RankEndFacts(0, False)).outcome == "lost"
    # A launcher on node 0 knows nothing of node 1's ranks.
    other_node = RankEndFacts(3, False, node_rank=1)
    assert rank_ending(other_node, LauncherEnding(node_rank=0, others_exit_code=0)).outcome == "lost"
    endings = rank_endings([RankEndFacts(0, True, "finished", 0)], expected_ranks=[0, 1],
                           launcher=LauncherEnding(exit_codes={2: 1}))
    assert {r: e.outcome for r, e in endings.items()} == {0: "finished", 1: "lost", 2: "failed"}


def test_no_steps_says_why_first_failure_then_interrupt_then_losses_then_unmarked():
    def ending(rank, outcome, code=None):
        return rank_ending(RankEndFacts(rank, True, outcome, code))

    failed = no_steps_issue({0: ending(0, "finished", 0), 1: ending(1, "failed", 3)}, {0: 0, 1: 0})
    assert failed.kind == "NO_STEPS" and failed.evidence["reason"] == "script_failed"
    assert "r1 failed with exit code 3" in failed.summary and failed.status == "empty"
    assert no_steps_issue({0: ending(0, "interrupted", 130)}, {0: 0}).evidence["reason"] == "interrupted"
    lost = no_steps_issue({0: ending(0, "finished", 0)}, {0: 40}, {0: 40})
    assert lost.evidence["reason"] == "telemetry_lost" and "completed 40 step(s)" in lost.summary
    unmarked = no_steps_issue({0: ending(0, "finished", 0)}, {0: 0})
    assert unmarked.evidence["reason"] == "no_step_marked" and "trace_step" in unmarked.summary
    assert "no optimizer seen" not in unmarked.summary and unmarked.evidence["no_optimizer_seen"] == []
    two = {0: ending(0, "finished", 0), 1: ending(1, "finished", 0)}
    inference = no_steps_issue(two, {0: 0, 1: 0}, None, {0: "none", 1: "none"})
    assert inference.evidence["reason"] == "no_step_marked" and "no optimizer seen" in inference.summary
    assert inference.evidence["no_optimizer_seen"] == [0, 1] and "optimizer.step()" in inference.summary
    # One rank had an optimizer boundary (it just stopped before its first update): not "no optimizer".
    mixed = no_steps_issue(two, {0: 0, 1: 0}, None, {0: "none", 1: "optimizer"})
    assert "no optimizer seen" not in mixed.summary and mixed.evidence["no_optimizer_seen"] == [0]
    nothing = no_steps_issue({0: rank_ending(RankEndFacts(0, False))}, {})
    assert nothing.evidence["reason"] == "nothing_received"


def test_a_version_1_database_is_migrated_by_the_writer_and_read_as_is_by_readers(tmp_path):
    from harness.older_layouts import older_database
    from traceml.processor.sqlite_layout import SCHEMA_USER_VERSION
    from traceml.processor.sqlite_writer import StepTimeStore
    from traceml.processor.store_read import read_rank_telemetry

    for name in ("read.sqlite", "write.sqlite"):
        conn = sqlite3.connect(older_database(tmp_path / name, 1))
        assert "outcome" not in {row[1] for row in conn.execute("PRAGMA table_info(step_time_ranks)")}
        conn.execute("INSERT INTO step_time_ranks (run_id, global_rank, first_receive_time, finished_time,"
                     " final_counts) VALUES ('r', 0, 1.0, 2.0, '{\"traceml.steps.completed\": 5}')")
        conn.commit()
        conn.close()
    # A reader of an old file (traceml summary on last year's database) sees no outcome, nothing else lost.
    reader = sqlite3.connect(f"file:{tmp_path / 'read.sqlite'}?mode=ro", uri=True)
    (rank,) = read_rank_telemetry(reader, "r")
    reader.close()
    assert (rank.finished, rank.steps_completed, rank.outcome, rank.exit_code) == (True, 5, None, None)
    # The writer adds the columns in place and keeps the rows.
    store = StepTimeStore(tmp_path / "write.sqlite")
    store.mark_rank_finished("r", 1, {}, outcome="interrupted", exit_code=130)
    store.close()
    conn = sqlite3.connect(tmp_path / "write.sqlite")
    rows = conn.execute("SELECT global_rank, outcome, exit_code FROM step_time_ranks ORDER BY 1").fetchall()
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    conn.close()
    assert rows == [(0, None, None), (1, "interrupted", 130)] and version == SCHEMA_USER_VERSION


def test_end_markers_that_saw_no_boundary_make_no_steps_say_no_optimizer_was_seen(tmp_path):
    from traceml.processor.sqlite_writer import StepTimeStore
    from traceml.processor.summary_section import build_final_summary

    store = StepTimeStore(tmp_path / "s.sqlite")
    for rank in (0, 1):  # what the decoder keeps of an inference loop's markers
        store.mark_rank_finished("r", rank, {"traceml.steps.completed": 0, "traceml.steps.boundary": "none"},
                                 outcome="finished", exit_code=0)
    store.close()
    summary = build_final_summary(tmp_path / "s.sqlite", "r")
    diagnosis = summary["diagnosis"]
    assert diagnosis["kind"] == "NO_STEPS" and diagnosis["evidence"]["reason"] == "no_step_marked"
    assert "no optimizer seen" in diagnosis["summary"] and diagnosis["evidence"]["no_optimizer_seen"] == [0, 1]
    jsonschema.validate(summary, SCHEMA)


# --- real launches -----------------------------------------------------------------------------

@pytest.mark.slow
def test_a_run_that_marks_no_step_gets_no_steps_not_warmup_and_keeps_the_scripts_status(workdir):
    run = traceml(["run", "--nproc-per-node", "1", "--run-id", "empty", str(SCRIPTS / "no_steps.py")], workdir)
    assert run.returncode == 0, run.output[-3000:]  # telemetry never changes the training's status
    summary = run.summary
    assert summary["diagnosis"]["kind"] == "NO_STEPS", summary["diagnosis"]
    assert summary["diagnosis"]["evidence"]["reason"] == "no_step_marked"
    assert summary["telemetry"]["rank_endings"] == {"0": {"outcome": "finished", "exit_code": 0, "end_marker": True}}
    card = (run.run_dir / "summary_card.txt").read_text()
    assert "Diagnosis: NO_STEPS" in card and "WARMUP" not in card and "trace_step" in card
    assert card in run.output and summary["card"] == card
    jsonschema.validate(summary, SCHEMA)


@pytest.mark.slow
def test_a_script_failing_before_its_first_step_is_named_with_its_exit_code(workdir):
    run = traceml(["run", "--nproc-per-node", "1", "--run-id", "broken", str(SCRIPTS / "no_steps.py"),
                   "--fail-with", "3"], workdir)
    assert run.returncode == 3, run.output[-3000:]
    summary = run.summary
    assert summary["diagnosis"]["kind"] == "NO_STEPS"
    assert summary["diagnosis"]["evidence"]["reason"] == "script_failed"
    assert summary["telemetry"]["rank_endings"]["0"] == {"outcome": "failed", "exit_code": 3, "end_marker": True}
    assert "Telemetry: 0/1 rank(s) finished; 1 failed with exit code 3 (r0)" in summary["card"]


@pytest.mark.slow
def test_ctrl_c_says_the_ranks_were_interrupted_and_top_says_ended(workdir):
    proc = subprocess.Popen(
        [str(TRACEML), "run", "--nproc-per-node", "2", "--run-id", "ctrl-c",
         str(SCRIPTS / "plain_ddp.py"), "--steps", "3000", "--step-sleep", "0.05"],
        cwd=workdir, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        preexec_fn=None)
    db = workdir / "traceml_runs" / "ctrl-c" / "traceml.sqlite"
    try:
        deadline = time.monotonic() + 120
        while len(steps_per_rank(db)) < 2 or min(steps_per_rank(db).values()) < 5:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no steps arrived"
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT, output[-3000:]
    summary = json.loads((db.parent / "final_summary.json").read_text())
    endings = summary["telemetry"]["rank_endings"]
    assert {r: e["outcome"] for r, e in endings.items()} == {"0": "interrupted", "1": "interrupted"}, output[-3000:]
    assert "Telemetry: 0/2 rank(s) finished; 2 interrupted (r0, r1)" in output
    assert "finished cleanly" not in output
    assert processors_using(db.parent) == []

    top = subprocess.run([str(TRACEML), "top", "--db", str(db), "--once"], env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    assert top.returncode == 0, top.stderr
    assert "[ended] run ctrl-c" in top.stdout and "[live]" not in top.stdout, top.stdout
