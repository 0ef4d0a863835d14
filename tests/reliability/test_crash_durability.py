"""kill -9 of the processor during sustained ingest loses nothing it acknowledged.

Three sender processes (gRPC and HTTP) stream step batches for six ranks and log
every acknowledged batch. The processor is killed with SIGKILL mid-stream,
restarted on the same ports and database, and the senders carry on (retrying
what was not acknowledged). Every acknowledged step must be in SQLite, both
right after the kill and at the end; replaying everything adds no rows.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import reliability_helpers as h

SENDER = Path(__file__).resolve().parent / "sender.py"
RUN = "crash-run"
GROUPS = (("0,1", "grpc"), ("2,3", "grpc"), ("4,5", "http"))


def acknowledged(logs: list[Path]) -> set[tuple[str, int, int]]:
    keys = set()
    for log in logs:
        if not log.exists():
            continue
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:  # a line being written when we read is skipped (not yet complete)
                rank, first, last = (int(x) for x in parts)
                keys.update((RUN, rank, s) for s in range(first, last + 1))
    return keys


def start_senders(proc: h.ProcessorProcess, folder: Path, stop: Path, **extra) -> list[subprocess.Popen]:
    senders = []
    for i, (ranks, transport) in enumerate(GROUPS):
        cmd = [sys.executable, str(SENDER), "--grpc", str(proc.grpc), "--http", str(proc.http),
               "--transport", transport, "--run", RUN, "--ranks", ranks, "--world-size", "6"]
        if "replay_to" in extra:
            cmd += ["--replay-to", str(extra["replay_to"][i])]
        else:
            cmd += ["--ack-log", str(folder / f"acks-{i}.log"), "--stop-file", str(stop)]
        senders.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return senders


def finish(senders: list[subprocess.Popen]) -> list[int]:
    last_steps = []
    for sender in senders:
        out, _ = sender.communicate(timeout=120)
        assert sender.returncode == 0, out
        last_steps.append(int(re.search(r"last_step=(\d+)", out).group(1)))
    return last_steps


def test_kill_9_mid_ingest_loses_no_acknowledged_step_and_replay_adds_nothing(tmp_path):
    proc = h.ProcessorProcess(tmp_path / "processor", extra_args=["--refresh-interval", "1"]).start()
    stop = tmp_path / "stop"
    logs = [tmp_path / f"acks-{i}.log" for i in range(len(GROUPS))]
    senders = start_senders(proc, tmp_path, stop)
    try:
        assert h.wait_until(lambda: len(acknowledged(logs)) >= 600, 120), "senders made no progress"
        proc.kill9()  # mid-stream: requests are in flight
        before_restart = acknowledged(logs)  # nothing can be acknowledged by a dead processor
        assert before_restart <= h.stored_step_keys(proc.db, RUN)
        assert h.integrity_ok(proc.db)

        proc.start()  # same ports, same database
        assert h.wait_until(lambda: len(acknowledged(logs)) >= len(before_restart) + 600, 120)
    finally:
        stop.touch()
        last_steps = finish(senders)
    acked = acknowledged(logs)
    assert acked > before_restart
    stored = h.stored_step_keys(proc.db, RUN)
    assert acked <= stored
    rows = h.count_rows(proc.db)
    assert rows == len(stored)  # one row per (run, rank, step)
    print(f"\nacknowledged {len(acked)} steps ({len(before_restart)} before the kill); stored {rows}")

    # Replay every batch ever sent, byte for byte (what a client's retries amount to): no new rows.
    finish(start_senders(proc, tmp_path, stop, replay_to=last_steps))
    assert h.count_rows(proc.db) == rows
    assert proc.stop() == 0, proc.log_text()[-3000:]
    assert h.integrity_ok(proc.db)
    assert h.stored_step_keys(proc.db, RUN) == stored
