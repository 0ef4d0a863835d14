"""kill -9 of the processor during sustained ingest loses nothing it acknowledged.

Three sender processes (gRPC and HTTP) stream step batches for six ranks and log
every acknowledged batch. The processor is killed with SIGKILL mid-stream,
restarted on the same ports and database, and the senders carry on (retrying
what was not acknowledged). Every acknowledged step must be in SQLite, both
right after the kill and at the end; replaying everything adds no rows.
"""
from __future__ import annotations

import psutil
import pytest

from harness.reliability.crash_scenario import GROUPS, RUN, acknowledged, finish, start_senders

from harness import ProcessorProcess, wait_until
from harness.stored_rows import count_rows, integrity_ok, stored_step_keys


def _kill_all(children) -> None:
    """SIGKILL every process in `children` that is still there."""
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.slow
def test_kill_9_mid_ingest_loses_no_acknowledged_step_and_replay_adds_nothing(tmp_path):
    proc = ProcessorProcess(tmp_path / "processor", extra_args=["--refresh-interval", "1"]).start()
    stop = tmp_path / "stop"
    logs = [tmp_path / f"acks-{i}.log" for i in range(len(GROUPS))]
    senders = start_senders(proc, tmp_path, stop)
    try:
        assert wait_until(lambda: len(acknowledged(logs)) >= 600, 120), "senders made no progress"
        proc.kill9()  # mid-stream: requests are in flight
        before_restart = acknowledged(logs)  # nothing can be acknowledged by a dead processor
        assert before_restart <= stored_step_keys(proc.db, RUN)
        assert integrity_ok(proc.db)

        proc.start()  # same ports, same database
        assert wait_until(lambda: len(acknowledged(logs)) >= len(before_restart) + 600, 120)
    finally:
        stop.touch()
        last_steps = finish(senders)
    acked = acknowledged(logs)
    assert acked > before_restart
    stored = stored_step_keys(proc.db, RUN)
    assert acked <= stored
    rows = count_rows(proc.db)
    assert rows == len(stored)  # one row per (run, rank, step)
    print(f"\nacknowledged {len(acked)} steps ({len(before_restart)} before the kill); stored {rows}")

    # Replay every batch ever sent, byte for byte (what a client's retries amount to): no new rows.
    finish(start_senders(proc, tmp_path, stop, replay_to=last_steps))
    assert count_rows(proc.db) == rows
    assert proc.stop() == 0, proc.log_text()[-3000:]
    assert integrity_ok(proc.db)
    assert stored_step_keys(proc.db, RUN) == stored


@pytest.mark.slow
def test_kill_9_of_a_multi_worker_processor_leaves_no_orphan_workers(tmp_path):
    proc = ProcessorProcess(tmp_path, extra_args=["--workers", "2"]).start()
    children = psutil.Process(proc.proc.pid).children(recursive=True)
    assert children
    proc.kill9()
    try:
        def all_gone() -> bool:
            return not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)

        assert wait_until(all_gone, 20)
    finally:
        _kill_all(children)  # never leak them into the rest of the suite


@pytest.mark.slow
def test_kill_9_of_a_multi_worker_processor_loses_no_acknowledged_step(tmp_path):
    """Acknowledgement after commit holds when several ingest processes share the ports."""
    proc = ProcessorProcess(tmp_path / "processor", extra_args=["--workers", "2"]).start()
    children = psutil.Process(proc.proc.pid).children(recursive=True)
    stop = tmp_path / "stop"
    logs = [tmp_path / f"acks-{i}.log" for i in range(len(GROUPS))]
    senders = start_senders(proc, tmp_path, stop)
    try:
        assert wait_until(lambda: len(acknowledged(logs)) >= 400, 120), "senders made no progress"
        proc.kill9()
        _kill_all(children)  # the whole processor goes down, workers included (see the test above)
        psutil.wait_procs(children, timeout=10)
        before_restart = acknowledged(logs)
        assert before_restart <= stored_step_keys(proc.db, RUN)
        proc.start()
        assert wait_until(lambda: len(acknowledged(logs)) >= len(before_restart) + 400, 120)
    finally:
        stop.touch()
        finish(senders)
    assert acknowledged(logs) <= stored_step_keys(proc.db, RUN)
    assert proc.stop() == 0, proc.log_text()[-3000:]
    assert integrity_ok(proc.db)
