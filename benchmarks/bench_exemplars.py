"""The exemplars' cost in the live projection, at many ranks (issue 35 item 3).

Builds a WAL store through `StepTimeStore` (the receivers' write path; the shared synthetic
rows carry no span ids, so one row per worst cell is given ids first, as intake stores
them), analyses it once (`LiveStepTimeSession`, 150 steps per rank, window 100), then
times, median of N, wall and CPU:

- worst: `worst_steps` over step time and the six phases (one numpy pass per metric);
- exemplars: the same plus the span-id reads (`summary_section.step_exemplars`);
- counters: `advance` of a run's step counters over the window;
- points: the whole live projection (`summary_section.live_points`) with both.

    .venv/bin/python -m benchmarks.bench_exemplars              # 64 and 1,024 ranks
    .venv/bin/python -m benchmarks.bench_exemplars --json
"""
from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.json_output import add_json_flag, print_json, table_output
from benchmarks.lib.step_time_rows import RUN, records
from traceml.processor.reporting.step_exemplars import StepTotals, advance, worst_steps
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.pipeline import LiveStepTimeSession
from traceml.processor.summary_section import live_points, step_exemplars


def _timed(fn, repeats: int) -> tuple[float, float]:
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def bench(folder: Path, ranks: int, repeats: int, steps: int = 150) -> dict:
    db = folder / f"exemplars_{ranks}.db"
    with StepTimeStore(db) as store:
        per_batch = max(1, 20_000 // ranks)
        for start in range(1, steps + 1, per_batch):
            store.write(records(ranks, range(start, min(start + per_batch, steps + 1))))
    result = LiveStepTimeSession(db, RUN).refresh()
    window = result.analysis.window
    assert window.step_count == 100
    cells = {(c.rank, c.step) for c in worst_steps(window).values()}
    conn = sqlite3.connect(db)  # the ids intake stores for a step span (the rows here came without)
    with conn:
        conn.executemany("UPDATE step_time_samples SET trace_id = ?, span_id = ? WHERE run_id = ? AND global_rank = ?"
                         " AND step = ?", [(os.urandom(16), os.urandom(8), RUN, r, s) for r, s in cells])
    conn.close()
    assert step_exemplars(window, db)
    totals = advance(StepTotals(), window)
    out = {"ranks": ranks}
    for name, fn in (("worst", lambda: worst_steps(window)), ("exemplars", lambda: step_exemplars(window, db)),
                     ("counters", lambda: advance(StepTotals(), window)),
                     ("points", lambda: live_points(result, db, totals=totals))):
        out[f"{name}_ms"], out[f"{name}_cpu_ms"] = _timed(fn, repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", help="rank counts (default 64 and 1,024)")
    parser.add_argument("--repeats", type=int, default=9, help="runs per figure (medians)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    with table_output(args.json):
        figures = measure(args)
    if args.json:
        print_json("bench_exemplars", args, figures)
    return 0


def measure(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="traceml-bench-") as tmp:
        print("Exemplars in the live projection (150 steps/rank, window 100), milliseconds wall / CPU (medians)")
        print(f"{'ranks':>6} {'worst':>15} {'+ id reads':>15} {'counters':>15} {'all points':>15}")
        for ranks in args.ranks or [64, 1024]:
            r = bench(Path(tmp), ranks, args.repeats)
            rows.append(r)
            cells = [f"{r[f'{k}_ms']:.2f} / {r[f'{k}_cpu_ms']:.2f}" for k in ("worst", "exemplars", "counters", "points")]
            print(f"{ranks:>6} " + " ".join(f"{c:>15}" for c in cells), flush=True)
    return {"exemplars": rows}


if __name__ == "__main__":
    sys.exit(main())
