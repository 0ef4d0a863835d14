"""The tiny training run under endpoint faults, shared by tests/reliability/test_training_faults.py
and checks/faults.py.

`train` runs `harness.reliability.train_script` (tiny CPU model, real `traceml.init` + exporter) in a subprocess with a
clean OTEL_/TRACEML_ environment; `finish` waits for it and parses the JSON result it prints last;
`progress_steps` reads how many steps it has completed so far; `lost` is what its exporter counts as
not delivered.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from harness.child_python import child_env, module_command

SCRIPT = "harness.reliability.train_script"
HANG_BOUND_S = 180


def train(env_extra: dict, *, steps: int, queue_size: int = 64, sleep_s: float = 0.005,
          progress: Path | None = None, wait: bool = True, timeout_s: float = HANG_BOUND_S):
    """Run the training script with `env_extra` on top of a clean environment.

    `wait`: return its JSON result (see `finish`); otherwise the running `subprocess.Popen`.
    `progress`: a file the script keeps updated with the number of steps completed."""
    env = {k: val for k, val in os.environ.items() if not k.startswith(("OTEL_", "TRACEML_"))}
    env.update(OTEL_EXPORTER_OTLP_TIMEOUT="1000", TRACEML_EXPORT_QUEUE_SIZE=str(queue_size),
               FAULT_STEPS=str(steps), FAULT_SLEEP_S=str(sleep_s), FAULT_SHUTDOWN_S="3", OMP_NUM_THREADS="1",
               **env_extra)
    if progress is not None:
        env["FAULT_PROGRESS"] = str(progress)
    proc = subprocess.Popen(module_command(SCRIPT), env=child_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return finish(proc, timeout_s) if wait else proc


def finish(proc: subprocess.Popen, timeout_s: float = HANG_BOUND_S, check: bool = True) -> dict:
    """Wait for a training run; `check`: it must have exited 0. Returns its last output line as JSON."""
    out, _ = proc.communicate(timeout=timeout_s)
    if check:
        assert proc.returncode == 0, out[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def progress_steps(progress: Path) -> int:
    """Steps the run has completed so far, from its progress file (0 before it is written)."""
    try:
        return int(progress.read_text() or 0)
    except (OSError, ValueError):
        return 0


def lost(exporter: dict) -> int:
    """Step spans the exporter itself counts as not delivered (dropped from its queue or failed)."""
    return exporter["dropped"].get("spans", 0) + exporter["failures"].get("traces", 0)
