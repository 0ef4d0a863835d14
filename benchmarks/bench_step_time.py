"""Step Time analysis cost: live refresh, unchanged refresh, summary, and scaling by ranks.

Builds WAL databases through `StepTimeStore` (the same write path the receivers use),
then measures, per rank count (400 steps per rank, live window 100):

- cold: the first `LiveStepTimeSession.refresh()` (full tail read + analysis + diagnosis);
- live: a refresh after one new step per rank arrived (median of N; wall and this
  process's CPU time, since the machine is shared);
- unchanged: a refresh when nothing changed (exact-object reuse; median of N);
- full re-read: a fresh one-off live read + analysis per refresh, the non-incremental
  baseline measured in the same run;
- json decode: only `json.loads` of every tail row's payload, the per-refresh cost of
  a design that re-decodes JSON (the original analyzer's approach), for scale.

And the summary profile (`StepTimePipeline.run`) over 64 ranks x 10,000 steps.

    .venv/bin/python -m benchmarks.bench_step_time            # full (1/8/64/1024 ranks + summary)
    .venv/bin/python -m benchmarks.bench_step_time --quick    # 1/8/64 ranks, small summary
    .venv/bin/python -m benchmarks.bench_step_time --json     # the figures as one JSON object
"""
from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.json_output import add_json_flag, print_json, table_output
from benchmarks.lib.step_time_rows import RUN, records, write
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.pipeline import (
    PROFILE_SUMMARY,
    LiveStepTimeSession,
    StepTimePipeline,
    StepTimeRequest,
)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.2f}"


def bench_live(folder: Path, ranks: int, steps: int = 400, repeats: int = 15) -> dict[str, float]:
    db = folder / f"live_{ranks}.db"
    store = StepTimeStore(db)
    t0 = time.perf_counter()
    write(store, ranks, range(1, steps + 1))
    build_s = time.perf_counter() - t0

    session = LiveStepTimeSession(db, RUN)
    t0 = time.perf_counter()
    first = session.refresh()
    cold = time.perf_counter() - t0
    assert first.freshness == "live" and first.analysis.window.step_count == 100

    live, live_cpu = [], []
    next_step = steps + 1
    for _ in range(repeats):
        store.write(records(ranks, range(next_step, next_step + 1)))
        next_step += 1
        t0, c0 = time.perf_counter(), time.process_time()
        result = session.refresh()
        live.append(time.perf_counter() - t0)
        live_cpu.append(time.process_time() - c0)
        assert result.analysis.window.steps[-1] == next_step - 1

    unchanged = []
    for _ in range(repeats * 3):
        t0 = time.perf_counter()
        again = session.refresh()
        unchanged.append(time.perf_counter() - t0)
        assert again.analysis is result.analysis

    pipeline = StepTimePipeline()
    full = []
    for _ in range(max(3, repeats // 5)):
        t0 = time.perf_counter()
        pipeline.run(StepTimeRequest(db, RUN))
        full.append(time.perf_counter() - t0)

    conn = sqlite3.connect(db)
    t0 = time.perf_counter()
    payloads = conn.execute("SELECT payload FROM step_time_samples WHERE run_id = ? AND step > ?",
                            (RUN, next_step - 1 - 400)).fetchall()
    for (text,) in payloads:
        json.loads(text)
    json_s = time.perf_counter() - t0
    conn.close()
    store.close()
    return {"ranks": ranks, "build_s": build_s, "cold": cold, "live": statistics.median(live),
            "live_cpu": statistics.median(live_cpu),
            "live_max": max(live), "unchanged": statistics.median(unchanged),
            "full": statistics.median(full), "json": json_s}


def bench_summary(folder: Path, ranks: int, steps: int) -> dict[str, float]:
    db = folder / f"summary_{ranks}x{steps}.db"
    with StepTimeStore(db) as store:
        t0 = time.perf_counter()
        write(store, ranks, range(1, steps + 1))
        build_s = time.perf_counter() - t0
    pipeline = StepTimePipeline()
    times, cpu = [], []
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        analysis = pipeline.run(StepTimeRequest(db, RUN, profile=PROFILE_SUMMARY))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    assert analysis.window.step_count == min(steps, 10_000)
    return {"ranks": ranks, "steps": steps, "build_s": build_s, "summary": statistics.median(times),
            "summary_cpu": statistics.median(cpu)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1/8/64 ranks and a small summary")
    parser.add_argument("--ranks", type=int, nargs="*", help="rank counts for the live figures")
    parser.add_argument("--summary-ranks", type=int, help="ranks of the summary profile (default 64, 8 with --quick)")
    parser.add_argument("--summary-steps", type=int,
                        help="steps per rank of the summary profile (default 10,000, 2,000 with --quick)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    with table_output(args.json):
        figures = measure(args)
    if args.json:
        print_json("bench_step_time", args, figures)
    return 0


def measure(args) -> dict:
    rank_counts = args.ranks or ([1, 8, 64] if args.quick else [1, 8, 64, 1024])
    figures: dict = {"live": []}
    with tempfile.TemporaryDirectory(prefix="traceml-bench-") as tmp:
        folder = Path(tmp)
        print("Live refresh through LiveStepTimeSession (400 steps/rank, window 100), milliseconds")
        print(f"{'ranks':>6} {'cold':>9} {'live':>9} {'live cpu':>9} {'live max':>9} {'unchanged':>9}"
              f" {'full read':>9} {'json only':>9} {'full/live':>9}   (db build s)")
        for ranks in rank_counts:
            r = bench_live(folder, ranks)
            figures["live"].append({"ranks": ranks, **{f"{k}_ms": r[k] * 1e3 for k in (
                "cold", "live", "live_cpu", "live_max", "unchanged", "full", "json")},
                "full_to_live_ratio": r["full"] / r["live"], "db_build_s": r["build_s"]})
            print(f"{ranks:>6} {_ms(r['cold'])} {_ms(r['live'])} {_ms(r['live_cpu'])} {_ms(r['live_max'])}"
                  f" {_ms(r['unchanged'])} {_ms(r['full'])} {_ms(r['json'])}"
                  f" {r['full'] / r['live']:9.1f}   ({r['build_s']:.1f})", flush=True)
        ranks, steps = (8, 2_000) if args.quick else (64, 10_000)
        ranks, steps = args.summary_ranks or ranks, args.summary_steps or steps
        s = bench_summary(folder, ranks, steps)
        figures["summary"] = {"ranks": ranks, "steps": steps, "wall_s": s["summary"], "cpu_s": s["summary_cpu"],
                              "db_build_s": s["build_s"]}
        print(f"\nSummary profile over {ranks} ranks x {steps} steps: {s['summary']:.2f} s wall,"
              f" {s['summary_cpu']:.2f} s CPU (median of 3; db build {s['build_s']:.1f} s)")
    return figures


if __name__ == "__main__":
    sys.exit(main())
