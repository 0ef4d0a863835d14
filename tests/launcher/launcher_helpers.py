"""Helpers for the launcher tests: run the real `traceml` console script in a scratch folder and read what it wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent / "scripts"
PLAIN_DDP_STEPS = 12  # the shared plain DDP run's steps (conftest.plain_ddp_run)
TRACEML = Path(sys.executable).with_name("traceml")


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without anything that would redirect telemetry elsewhere."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "TRACEML_", "PET_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


@dataclass
class TracemlRun:
    returncode: int
    output: str
    cwd: Path

    @property
    def run_dirs(self) -> list[Path]:
        root = self.cwd / "traceml_runs"
        return sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []

    @property
    def run_dir(self) -> Path:
        dirs = self.run_dirs
        assert len(dirs) == 1, (dirs, self.output[-3000:])
        return dirs[0]

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "final_summary.json").read_text())


def traceml(args: list[str], cwd: Path, timeout: float = 240, **env: str) -> TracemlRun:
    proc = subprocess.run([str(TRACEML), *args], cwd=cwd, env=clean_env(**env), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return TracemlRun(proc.returncode, proc.stdout + proc.stderr, cwd)


def processors_using(path: Path) -> list[int]:
    """Pids of live processes whose command line mentions `path` (a leaked embedded processor)."""
    import psutil

    needle = str(path)
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(needle in part for part in proc.info["cmdline"] or ()):
                found.append(proc.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found
