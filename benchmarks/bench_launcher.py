"""What `traceml run` costs on top of plain `torchrun`, and how long the embedded processor takes to start.

    .venv/bin/python -m benchmarks.bench_launcher [--trials 3] [--steps 200] [--json]

Alternates, in one run, `torchrun --nproc-per-node 2 plain_ddp.py` and
`traceml run --nproc-per-node 2 plain_ddp.py` (same script, same steps; the
script's `trace_step` is a no-op without `traceml.init()` under plain torchrun)
and prints wall-clock medians and their ratio. The difference is the whole
TraceML package: embedded processor start-up and shutdown, per-rank
instrumentation and export, and the final summary. Then it starts and stops the
embedded processor alone a few times. Figures from a shared machine are noisy:
read the ratio of one run, not the absolute seconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.json_output import add_json_flag, print_json, table_output

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "launcher" / "scripts" / "plain_ddp.py"
BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACEML_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _timed(cmd: list[str], cwd: str) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    add_json_flag(parser)
    args = parser.parse_args()
    with table_output(args.json):
        figures = measure(args)
    if args.json:
        print_json("bench_launcher", args, figures)


def measure(args) -> dict:
    script_args = [str(SCRIPT), "--steps", str(args.steps)]
    plain, traced = [], []
    with tempfile.TemporaryDirectory() as cwd:
        for _ in range(args.trials):
            plain.append(_timed([str(BIN / "torchrun"), "--nproc-per-node", "2", *script_args], cwd))
            traced.append(_timed([str(BIN / "traceml"), "run", "--nproc-per-node", "2", *script_args], cwd))
    p, t = statistics.median(plain), statistics.median(traced)
    print(f"{args.steps} steps x 2 ranks, median of {args.trials} alternating trials")
    print(f"torchrun            {p:6.2f} s")
    print(f"traceml run         {t:6.2f} s  (ratio {t / p:.2f}, +{t - p:.2f} s)")

    from traceml.launcher.embedded import EmbeddedProcessor

    starts, stops = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.trials):
            proc = EmbeddedProcessor(Path(tmp) / f"p{i}.sqlite", Path(tmp), Path(tmp) / f"p{i}.log")
            t0 = time.perf_counter()
            proc.start()
            t1 = time.perf_counter()
            proc.stop()
            starts.append(t1 - t0)
            stops.append(time.perf_counter() - t1)
    print(f"embedded processor  start to /readyz {statistics.median(starts):.2f} s, "
          f"SIGTERM to exit {statistics.median(stops):.2f} s (median of {args.trials})")
    return {"torchrun_s": p, "traceml_run_s": t, "wall_ratio": t / p, "added_s": t - p,
            "embedded_start_s": statistics.median(starts), "embedded_stop_s": statistics.median(stops)}


if __name__ == "__main__":
    main()
