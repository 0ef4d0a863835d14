"""Child Python processes that import the helpers by their full names (`tests.…`, `harness.…`).

A helper script (a sender, a training loop, the OTLP receiver) runs as
`python -m tests.<folder>.<module>` or `python -m harness.<module>`; that needs the repository root on the child's
module path, whatever its working directory. The root goes on PYTHONPATH rather
than into `sys.path` by the script itself, so no helper edits its own import path.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping

ROOT = Path(__file__).resolve().parents[1]


def module_command(module: str, *args: str) -> list[str]:
    """`python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`base` (default: this process's environment) plus `extra`, with the root first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env.update(extra)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in paths if p != str(ROOT)]])
    return env


def python_output(code: str, timeout: float = 120) -> str:
    """Run `code` in a fresh interpreter (`python -c`: its own imports, its own process state) and
    return its stdout, stripped; a non-zero exit fails the test with the child's stderr."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()
