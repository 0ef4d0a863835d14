"""What the resource evidence adds to the processor's analysis: the read, the live tick, the summary.

Two stores per rank count, built alike through `StepTimeStore` (400 steps per rank, one
second apart, as `bench_step_time` builds them), one of them also holding what every
rank's resource sampler sends at its default 5 s interval (process CPU and RSS, the
allocator's two figures, four GPU figures, and local rank 0's host CPU and memory) and a
per-step peak allocated memory. Measured in the same run:

- resource read: `window_resources` alone, the read + joins + figures + trends the live
  session does at most every 5 s (`RESOURCE_REFRESH_S`);
- live tick: a refresh after one new step on every rank, with and without resource rows
  (the session reuses its resource figures between reads, so this is the per-tick cost);
- summary: the summary profile with and without resource rows.

    .venv/bin/python -m benchmarks.bench_resource_analysis            # 1 / 64 / 1,024 ranks
    .venv/bin/python -m benchmarks.bench_resource_analysis --quick    # 1 / 64 ranks
"""
from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.json_output import add_json_flag, print_json, table_output
from benchmarks.lib.step_time_rows import RUN, START, records, write
from traceml.processor.sqlite_layout import RESOURCE_COLUMNS
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.pipeline import (
    PROFILE_SUMMARY,
    LiveStepTimeSession,
    StepTimePipeline,
    StepTimeRequest,
    window_resources,
)
from traceml.schema import resources as r

STEPS = 400
INTERVAL_S = 5.0


def _resource_rows(ranks: int) -> list[tuple]:
    rows = []
    t = START
    while t <= START + STEPS + 1:
        for rank in range(ranks):
            host, gpu = f"node{rank // 8}", f"GPU-{rank}"
            for metric, value, device in (
                    (r.PROCESS_CPU_UTILIZATION, 0.4, ""), (r.PROCESS_MEMORY_USAGE, 3e9 + rank, ""),
                    (r.CUDA_MEMORY_ALLOCATED, 2e10, "cuda:0"), (r.CUDA_MEMORY_RESERVED, 2.2e10, "cuda:0"),
                    (r.GPU_UTILIZATION, 0.9, gpu), (r.GPU_MEMORY_USAGE, 3e10, gpu),
                    (r.HW_TEMPERATURE, 60.0, gpu), (r.HW_POWER, 300.0, gpu)):
                rows.append((RUN, rank, host, device, metric, t, value, r.SOURCE_TRACEML, 1000 + rank, t))
            if rank % 8 == 0:
                for metric, value in ((r.SYSTEM_CPU_UTILIZATION, 0.5), (r.SYSTEM_CPU_LOGICAL_COUNT, 64),
                                      (r.SYSTEM_MEMORY_USAGE, 2e11), (r.SYSTEM_MEMORY_LIMIT, 1e12)):
                    rows.append((RUN, rank, host, "", metric, t, value, r.SOURCE_TRACEML, 1000 + rank, t))
        t += INTERVAL_S
    return rows


def _store(folder: Path, ranks: int, resources: bool) -> Path:
    db = folder / f"{'res' if resources else 'bare'}_{ranks}.db"
    with StepTimeStore(db) as store:
        write(store, ranks, range(1, STEPS + 1))
    if resources:
        conn = sqlite3.connect(db)
        with conn:
            conn.executemany(f"INSERT INTO resource_samples ({', '.join(RESOURCE_COLUMNS)}) VALUES"
                             f" ({', '.join('?' * len(RESOURCE_COLUMNS))})", _resource_rows(ranks))
            conn.executemany(
                "INSERT INTO step_memory_samples (run_id, global_rank, step, device, peak_allocated_bytes,"
                " peak_reserved_bytes, sample_time, receive_time) VALUES (?, ?, ?, 'cuda:0', ?, NULL, ?, ?)",
                [(RUN, rank, step, int(2e10), START + step, START + step)
                 for step in range(1, STEPS + 1) for rank in range(ranks)])
        conn.close()
    return db


def _live_tick(db: Path, ranks: int, repeats: int) -> tuple[float, float]:
    """(median live tick after one new step, the first refresh) of a fresh session."""
    session = LiveStepTimeSession(db, RUN)
    t0 = time.perf_counter()
    session.refresh()
    cold = time.perf_counter() - t0
    ticks = []
    step = STEPS + 1
    with StepTimeStore(db) as store:
        for _ in range(repeats):
            store.write(records(ranks, range(step, step + 1)))
            step += 1
            t0 = time.perf_counter()
            session.refresh()
            ticks.append(time.perf_counter() - t0)
    return statistics.median(ticks), cold


def bench(folder: Path, ranks: int, repeats: int) -> dict:
    bare, res = _store(folder, ranks, False), _store(folder, ranks, True)
    window = LiveStepTimeSession(res, RUN).refresh().analysis.window
    reads = []
    for _ in range(5):
        t0 = time.perf_counter()
        resources = window_resources(res, window)
        reads.append(time.perf_counter() - t0)
    assert resources is not None and len(resources.ranks) == ranks
    tick_bare, _ = _live_tick(bare, ranks, repeats)
    tick_res, cold_res = _live_tick(res, ranks, repeats)
    summaries = {}
    for name, db in (("bare", bare), ("res", res)):
        t0 = time.perf_counter()
        StepTimePipeline().run(StepTimeRequest(db, RUN, profile=PROFILE_SUMMARY))
        summaries[name] = time.perf_counter() - t0
    return {"ranks": ranks, "resource_read_ms": statistics.median(reads) * 1e3,
            "tick_bare_ms": tick_bare * 1e3, "tick_resources_ms": tick_res * 1e3,
            "tick_ratio": tick_res / tick_bare if tick_bare else None,
            "cold_resources_ms": cold_res * 1e3,
            "summary_bare_s": summaries["bare"], "summary_resources_s": summaries["res"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 and 64 ranks only")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    counts = (1, 64) if args.quick else (1, 64, 1024)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for ranks in counts:
            results.append(bench(Path(folder), ranks, repeats=5 if ranks > 64 else 10))
    with table_output(args.json):
        print(f"{'ranks':>6} {'resource read':>14} {'tick, bare':>11} {'tick, +res':>11} {'ratio':>6}"
              f" {'summary bare':>13} {'summary +res':>13}")
        for row in results:
            print(f"{row['ranks']:>6} {row['resource_read_ms']:>11.1f} ms {row['tick_bare_ms']:>8.1f} ms"
                  f" {row['tick_resources_ms']:>8.1f} ms {row['tick_ratio']:>6.2f}"
                  f" {row['summary_bare_s']:>11.2f} s {row['summary_resources_s']:>11.2f} s")
    if args.json:
        print_json("bench_resource_analysis", args, {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
