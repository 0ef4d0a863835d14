"""Sender processes against a processor that gets killed: shared by the test and `checks/faults.py`."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from harness import ProcessorProcess
from harness.child_python import child_env, module_command

SENDER = "harness.reliability.sender"
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


def start_senders(proc: ProcessorProcess, folder: Path, stop: Path, **extra) -> list[subprocess.Popen]:
    senders = []
    for i, (ranks, transport) in enumerate(GROUPS):
        cmd = [*module_command(SENDER), "--grpc", str(proc.grpc), "--http", str(proc.http),
               "--transport", transport, "--run", RUN, "--ranks", ranks, "--world-size", "6"]
        if "replay_to" in extra:
            cmd += ["--replay-to", str(extra["replay_to"][i])]
        else:
            cmd += ["--ack-log", str(folder / f"acks-{i}.log"), "--stop-file", str(stop)]
        senders.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env=child_env()))
    return senders


def finish(senders: list[subprocess.Popen]) -> list[int]:
    last_steps = []
    for sender in senders:
        out, _ = sender.communicate(timeout=120)
        assert sender.returncode == 0, out
        last_steps.append(int(re.search(r"last_step=(\d+)", out).group(1)))
    return last_steps
