"""Elastic restarts kept apart: each attempt on the resource and in storage, the summary on the last.

The store tests write real decoded records through the real writer; the launcher
test forces a restart with `traceml run --max-restarts 1` on a script that fails
on its first attempt after 8 steps and succeeds on the second with 5: the old
store replaced steps 0-4 and kept 5-7 of the first attempt in the window.
"""
from __future__ import annotations

import sqlite3

import pytest

from tests.launcher.launcher_helpers import SCRIPTS, traceml
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.model import RankIdentity, RawEventValue, StepTimeIngestRecord
from traceml.processor.summary_section import build_final_summary


def _record(step: int, attempt: int, rank: int = 0, ms: float = 10.0) -> StepTimeIngestRecord:
    return StepTimeIngestRecord(
        run_id="r", identity=RankIdentity(rank, world_size=1), step=step, start_time=1000.0 + step,
        sample_time=1000.5 + step, events={"_traceml_internal:step_time": RawEventValue(ms, None, 1)},
        attempt=attempt)


def _counts(db) -> dict:
    conn = sqlite3.connect(db)
    try:
        return {
            "current": conn.execute("SELECT COUNT(*) FROM step_time_samples").fetchone()[0],
            "earlier": dict(conn.execute("SELECT attempt, COUNT(*) FROM step_time_attempt_samples"
                                         " GROUP BY attempt").fetchall()),
            "attempt": conn.execute("SELECT attempt FROM step_time_runs WHERE run_id = 'r'").fetchone()[0],
        }
    finally:
        conn.close()


def test_a_later_attempt_moves_the_earlier_rows_apart_and_late_ones_follow(tmp_path):
    db = tmp_path / "s.sqlite"
    store = StepTimeStore(db)
    store.write([_record(s, 0) for s in range(8)])
    store.mark_rank_finished("r", 0, {}, outcome="failed", exit_code=5, attempt=0)
    store.write([_record(s, 1, ms=20.0) for s in range(3)])
    assert _counts(db) == {"current": 3, "earlier": {0: 8}, "attempt": 1}
    # A late row of attempt 0 and its end marker must not land in attempt 1.
    store.write([_record(8, 0)])
    store.mark_rank_finished("r", 0, {}, outcome="failed", exit_code=5, attempt=0)
    assert _counts(db) == {"current": 3, "earlier": {0: 9}, "attempt": 1}
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT finished_time FROM step_time_ranks").fetchone() == (None,)
    conn.close()
    store.close()
    # A new store on the same file keeps separating (it learns of the restart from the file).
    store = StepTimeStore(db)
    store.write([_record(9, 0)])
    store.close()
    assert _counts(db)["earlier"] == {0: 10}
    summary = build_final_summary(db, "r")
    assert summary["global"]["window"]["steps"] == 3 and summary["global"]["median"]["traced_step_time_ms"]["value"] == 20.0
    assert summary["telemetry"]["attempt"] == 1
    assert summary["telemetry"]["attempts"] == [{"attempt": 0, "steps": {"0": 10}}, {"attempt": 1, "steps": {"0": 3}}]
    assert "Attempts: 2 (elastic restarts); figures cover attempt 1 only" in summary["card"]
    # The badput ledger: attempt 1 began again at step 0, so all 10 steps of attempt 0 were done
    # again (0.5 s each); its steps overlap attempt 1's in time, so no time lies between them.
    restarts = summary["badput"]["restarts"]
    assert (restarts["attempts"], restarts["redone_steps"], restarts["redone_rank_seconds"]) == (2, 10, 5.0)
    assert restarts["downtime_s"] == 0.0
    assert summary["badput"]["run"]["causes"]["restarts"]["rank_seconds"] == 5.0


def test_the_resource_carries_the_restart_count():
    from traceml.exporter.identity import resolve_identity

    identity = resolve_identity("r", environ={"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "2"},
                                use_store=False)
    assert identity.attempt == 2
    assert resolve_identity("r", environ={}, use_store=False).attempt == 0


@pytest.mark.slow
def test_a_forced_restart_is_summarised_on_its_last_attempt_with_every_attempt_counted(workdir):
    run = traceml(["run", "--nproc-per-node", "1", "--max-restarts", "1", "--run-id", "restarted",
                   str(SCRIPTS / "restarting.py"), "--first-steps", "8", "--steps", "5"], workdir)
    assert run.returncode == 0, run.output[-3000:]
    assert "attempt 0 done" in run.output and "attempt 1 done" in run.output
    summary = run.summary
    tel = summary["telemetry"]
    assert tel["attempt"] == 1
    assert tel["attempts"] == [{"attempt": 0, "steps": {"0": 8}}, {"attempt": 1, "steps": {"0": 5}}]
    # Only the last attempt's steps are analysed: 5, not 8 (5 replaced + 3 left over).
    assert summary["global"]["window"]["steps"] == 5 and summary["groups"][0]["steps"] == 5
    assert tel["rank_endings"]["0"]["outcome"] == "finished"
    assert "attempt 0: r0 8 step(s); attempt 1: r0 5 step(s)" in summary["card"]
    # The badput ledger counts the 8 steps attempt 1 did again (it began at step 0 again) and the
    # time between the attempts (the restart itself), on the one rank.
    restarts = summary["badput"]["restarts"]
    assert (restarts["attempts"], restarts["redone_steps"]) == (2, 8)
    assert restarts["downtime_s"] > 0 and restarts["downtime_rank_seconds"] == restarts["downtime_s"]
    assert summary["badput"]["run"]["causes"]["restarts"]["rank_seconds"] == pytest.approx(
        restarts["redone_rank_seconds"] + restarts["downtime_rank_seconds"], abs=2e-3)
    assert "restarts: 1 restart(s), 8 rank-step(s) done again" in summary["card"]
