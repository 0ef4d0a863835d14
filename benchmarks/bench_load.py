"""Processor RSS and `/metrics` scrape cost with many large runs: bounded per-rank series vs every rank.

    .venv/bin/python -m benchmarks.bench_load                 # 6 runs x 16,384 ranks x 20 steps
    .venv/bin/python -m benchmarks.bench_load --quick         # 2 runs x 1,024 ranks x 10 steps
    .venv/bin/python -m benchmarks.bench_load --runs 6 --ranks 16384 --steps 100 --json

The store is built before the processor starts: the first run's steps, memory
peaks and drop reports go through `StepTimeStore` (the writer the receivers
use), then every further run is a copy of it made in SQL (`INSERT ... SELECT`
with the run id replaced), which is what makes 6 x 16,384 ranks take a minute
rather than ten. Every rank takes the same time except one input straggler, so
each run has a diagnosis and a culprit.

Then the real CLI starts on that database (`harness.ProcessorProcess`),
adopts the runs (they received data within the idle timeout) and analyses them;
once `/metrics` shows every run's rank count, this reports the processor's RSS
and the scrape of `/metrics` in the text format and in OpenMetrics (best of 3
wall times, body size, series). The baseline, in the same run and on the same
database, is the same processor exporting every rank's series
(`--rank-series-top-k` = ranks, what every processor did before per-rank series
were bounded); `--no-baseline` skips it. The processor's own
`traceml_processor_analysis_duration` (its latest live refresh of each run, a
full read here) is reported as the analysis time per tick. Targets: RSS under
1 GiB, scrape under 1 s.

Then, in this process, the live cache of run 0 (`LiveStepTimeSession`, what the
monitor keeps per run): the cold refresh, the median incremental refresh over
5 more steps from every rank (one refresh per step), the cache's bytes and the RSS it adds, against a baseline
in the same run: the cache laid out as before slots were allocated on arrival
(every slot of the 400-step ring allocated up front, no cell cap).
"""
from __future__ import annotations

import argparse
import re
import sqlite3
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.lib.json_output import add_json_flag, print_json, table_output
from harness import ProcessorProcess, wait_until
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.model import (
    RankIdentity,
    RawEventValue,
    StepMemoryIngestRecord,
    StepTimeIngestRecord,
)
from traceml.processor.step_time.model import LIVE_WINDOW_STEPS, WINDOW_LOOKBACK
from traceml.processor.step_time.pipeline import LiveStepTimeSession
from traceml.processor.step_time.sqlite_reader import LiveTail
from traceml.schema import vocabulary as v

TARGET_RSS_MIB = 1024
TARGET_SCRAPE_S = 1.0
INCREMENTAL_STEPS = 5
"""Live-cache figures: the median refresh over this many new steps (slot growth amortised as in a run)."""
OPENMETRICS_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
BASE_MS = {v.RAW_DATALOADER_NEXT: 5.0, v.RAW_H2D: 5.0, v.RAW_FORWARD: 30.0, v.RAW_BACKWARD: 45.0,
           v.RAW_OPTIMIZER_STEP: 10.0, v.RAW_STEP_TIME: 95.0}
TABLES = ("step_time_samples", "step_memory_samples", "step_time_ranks", "step_time_drops", "step_time_runs")


def run_id(index: int) -> str:
    return f"load-{index}"


def write_steps(store: StepTimeStore, run: str, ranks: int, steps: range, straggler: int,
                batch: int = 50_000) -> None:
    """`steps` of every rank of `run` through the writer, with per-step memory peaks."""
    now = time.time()
    records, memory = [], []
    for step in steps:
        for rank in range(ranks):
            wait = 60.0 if rank == straggler else BASE_MS[v.RAW_DATALOADER_NEXT]
            events = {name: RawEventValue(ms, None, 1) for name, ms in BASE_MS.items()}
            events[v.RAW_DATALOADER_NEXT] = RawEventValue(wait, None, 1)
            events[v.RAW_STEP_TIME] = RawEventValue(BASE_MS[v.RAW_STEP_TIME] + wait - 5.0 + 0.001 * rank, None, 1)
            records.append(StepTimeIngestRecord(run, RankIdentity(rank, world_size=ranks), step,
                                                now - 1.0, now - 0.9 + step * 1e-3, events, "ddp"))
            memory.append(StepMemoryIngestRecord(run, rank, step, "cuda:0", (1 << 30) + rank, 2 << 30, now))
            if len(records) >= batch:
                store.write(records, memory, receive_time=now)
                records, memory = [], []
    if records:
        store.write(records, memory, receive_time=now)


def write_first_run(db: Path, ranks: int, steps: int, straggler: int) -> None:
    """Run 0 through the writer: steps, per-step memory peaks, one drop report per rank."""
    run = run_id(0)
    with StepTimeStore(db) as store:
        write_steps(store, run, ranks, range(steps), straggler)
        for rank in range(ranks):
            store.record_drops(run, rank, {"spans": rank % 3})


def clone_runs(db: Path, runs: int) -> None:
    """Runs 1 .. runs-1 as SQL copies of run 0 (each its own row ids, so its own cursor)."""
    conn = sqlite3.connect(db)
    try:
        with conn:
            for index in range(1, runs):
                for table in TABLES:
                    columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})") if row[1] != "id"]
                    select = ", ".join("?" if c == "run_id" else c for c in columns)
                    conn.execute(f"INSERT INTO {table} ({', '.join(columns)}) SELECT {select} FROM {table}"
                                 " WHERE run_id = ?", (run_id(index), run_id(0)))
                conn.execute("UPDATE step_time_runs SET latest_row_id ="
                             " (SELECT max(id) FROM step_time_samples WHERE run_id = ?) WHERE run_id = ?",
                             (run_id(index), run_id(index)))
    finally:
        conn.close()


def build_store(db: Path, runs: int, ranks: int, steps: int) -> float:
    started = time.perf_counter()
    write_first_run(db, ranks, steps, straggler=ranks // 3)
    clone_runs(db, runs)
    return time.perf_counter() - started


def scrape(port: int, accept: str | None) -> tuple[float, int, str]:
    headers = {"Accept": accept} if accept else {}
    started = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers),
                                timeout=600) as response:
        body = response.read()
    return time.perf_counter() - started, len(body), body.decode()


def series_count(body: str) -> int:
    return sum(1 for line in body.splitlines() if line and not line.startswith("#"))


def all_runs_analysed(port: int, runs: int, ranks: int) -> bool:
    try:
        _, _, body = scrape(port, None)
    except OSError:
        return False
    found = re.findall(r'^traceml_window_ranks\{traceml_run_id="load-\d+"\} (\S+)$', body, re.M)
    return len(found) == runs and all(float(x) == ranks for x in found)


def measure_processor(folder: Path, db: Path, args, top_k: int, label: str) -> dict:
    proc = ProcessorProcess(folder / label, db=db, summary_dir=None,
                            extra_args=["--idle-timeout", "36000", "--refresh-interval", "0.5",
                                        "--rank-series-top-k", str(top_k), "--max-series", str(10**8),
                                        "--log-level", "WARNING"])
    proc.start()
    try:
        started = time.perf_counter()
        if not wait_until(lambda: all_runs_analysed(proc.prom, args.runs, args.ranks), args.timeout, 1.0):
            raise RuntimeError(f"{label}: the runs were not analysed within {args.timeout} s:\n"
                               + proc.log_text()[-3000:])
        analysed_s = time.perf_counter() - started
        figures = {"top_k": top_k, "analysed_s": analysed_s}
        for name, accept in (("text", None), ("openmetrics", OPENMETRICS_ACCEPT)):
            times = []
            for _ in range(3):
                wall, size, body = scrape(proc.prom, accept)
                times.append(wall)
            figures[f"{name}_scrape_s"] = min(times)
            figures[f"{name}_bytes"] = size
            figures[f"{name}_series"] = series_count(body)
        figures["rss_mib"] = proc.rss_bytes() / 2**20
        durations = [float(x) for x in re.findall(
            r'^traceml_processor_analysis_duration_seconds\{traceml_run_id="load-\d+"\} (\S+)$', body, re.M)]
        figures["analysis_per_run_s"] = max(durations) if durations else None
        figures["analysis_per_tick_s"] = sum(durations) if durations else None
    finally:
        proc.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 runs x 1,024 ranks x 10 steps")
    parser.add_argument("--runs", type=int, help="runs (default 6; --quick 2)")
    parser.add_argument("--ranks", type=int, help="ranks per run (default 16384; --quick 1024)")
    parser.add_argument("--steps", type=int, help="steps per rank (default 20; --quick 10)")
    parser.add_argument("--top-k", type=int, default=8, help="--rank-series-top-k of the bounded processor")
    parser.add_argument("--no-baseline", action="store_true", help="skip the every-rank baseline processor")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the analysis")
    add_json_flag(parser)
    args = parser.parse_args()
    args.runs = args.runs or (2 if args.quick else 6)
    args.ranks = args.ranks or (1024 if args.quick else 16_384)
    args.steps = args.steps or (10 if args.quick else 20)
    with table_output(args.json):
        figures = measure(args)
    if args.json:
        print_json("bench_load", args, figures)


def measure(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        folder = Path(tmp)
        db = folder / "load.db"
        build_s = build_store(db, args.runs, args.ranks, args.steps)
        print(f"store: {args.runs} runs x {args.ranks} ranks x {args.steps} steps built in {build_s:.1f} s "
              f"({db.stat().st_size / 2**20:.0f} MiB)")
        figures: dict = {"runs": args.runs, "ranks": args.ranks, "steps": args.steps, "build_s": build_s}
        figures["bounded"] = measure_processor(folder, db, args, args.top_k, "bounded")
        if not args.no_baseline:
            figures["every_rank"] = measure_processor(folder, db, args, args.ranks, "every-rank")
        figures["live_cache"] = measure_live_cache(db, args)
    print(f"{'processor':>11} {'RSS MiB':>8} {'analysed s':>10} {'tick s':>7} {'text s':>8} {'text MiB':>9}"
          f" {'series':>9} {'OM s':>8} {'OM MiB':>8}")
    for label in ("bounded", "every_rank"):
        f = figures.get(label)
        if f is None:
            continue
        tick = f"{f['analysis_per_tick_s']:7.2f}" if f["analysis_per_tick_s"] is not None else f"{'-':>7}"
        print(f"{label:>11} {f['rss_mib']:8.0f} {f['analysed_s']:10.1f} {tick} {f['text_scrape_s']:8.3f}"
              f" {f['text_bytes'] / 2**20:9.2f} {f['text_series']:9d} {f['openmetrics_scrape_s']:8.3f}"
              f" {f['openmetrics_bytes'] / 2**20:8.2f}")
    print("(tick s: the sum over runs of the processor's latest analysis refresh, a full read of each run)")
    cache = figures["live_cache"]
    print(f"\nlive cache of run 0 ({args.ranks} ranks, {args.steps} steps + {INCREMENTAL_STEPS} one by one"
          f" per layout), in this process:")
    print(f"{'layout':>12} {'slots':>6} {'cache MiB':>10} {'RSS +MiB':>9} {'cold s':>8} {'step s':>8} {'window':>7}")
    print("(step s: median refresh after one new step of every rank; RSS +MiB of the second layout is"
          " understated, it reuses memory the first freed)")
    for label in ("on_arrival", "preallocated"):
        c = cache[label]
        print(f"{label:>12} {c['slots']:6d} {c['cache_mib']:10.1f} {c['rss_added_mib']:9.1f} {c['cold_s']:8.3f}"
              f" {c['step_s']:8.3f} {c['window_steps']:7d}")
    cache["cache_ratio"] = cache["on_arrival"]["cache_mib"] / cache["preallocated"]["cache_mib"]
    cache["step_ratio"] = cache["on_arrival"]["step_s"] / cache["preallocated"]["step_s"]
    print(f"on arrival / preallocated: cache {cache['cache_ratio']:.3f}x, incremental refresh "
          f"{cache['step_ratio']:.2f}x")
    bounded = figures["bounded"]
    if "every_rank" in figures:
        base = figures["every_rank"]
        figures["series_ratio"] = bounded["text_series"] / base["text_series"]
        figures["text_scrape_ratio"] = bounded["text_scrape_s"] / base["text_scrape_s"]
        figures["rss_ratio"] = bounded["rss_mib"] / base["rss_mib"]
        print(f"bounded / every rank: series {figures['series_ratio']:.4f}x, text scrape "
              f"{figures['text_scrape_ratio']:.3f}x, RSS {figures['rss_ratio']:.2f}x")
    worst_scrape = max(bounded["text_scrape_s"], bounded["openmetrics_scrape_s"])
    print(f"targets: RSS {bounded['rss_mib']:.0f} MiB (< {TARGET_RSS_MIB}: "
          f"{'met' if bounded['rss_mib'] < TARGET_RSS_MIB else 'NOT met'}), scrape {worst_scrape:.3f} s "
          f"(< {TARGET_SCRAPE_S:g}: {'met' if worst_scrape < TARGET_SCRAPE_S else 'NOT met'})")
    return figures


class PreallocatedTail(LiveTail):
    """The baseline layout: every slot of the `window x lookback` ring allocated at the
    full read, whatever the run holds, and no cell cap (the cache before this bound)."""

    def __init__(self, run_id: str):
        super().__init__(run_id, LIVE_WINDOW_STEPS, WINDOW_LOOKBACK, max_cells=1 << 62)

    def _merge(self, rows) -> None:
        if self.slots < self.capacity:
            self._grow(self.capacity)
        super()._merge(rows)


def _cache_bytes(tail: LiveTail) -> int:
    return sum(a.nbytes for a in (tail._slot_step, tail._present, tail._values, tail._row_ids, tail._sample_times))


def measure_live_cache(db: Path, args) -> dict:
    """Run 0's live session in this process: cold refresh, one new step, cache size; both layouts."""
    import gc

    import psutil

    me = psutil.Process()
    out: dict = {}
    next_step = args.steps
    with StepTimeStore(db) as store:
        for label in ("on_arrival", "preallocated"):
            gc.collect()
            before = me.memory_info().rss
            session = LiveStepTimeSession(db, run_id(0))
            if label == "preallocated":
                session._tail = PreallocatedTail(run_id(0))
            started = time.perf_counter()
            session.refresh()
            cold = time.perf_counter() - started
            times = []
            for _ in range(INCREMENTAL_STEPS):
                write_steps(store, run_id(0), args.ranks, range(next_step, next_step + 1), straggler=args.ranks // 3)
                next_step += 1
                started = time.perf_counter()
                result = session.refresh()
                times.append(time.perf_counter() - started)
            step = statistics.median(times)
            out[label] = {"slots": session._tail.slots, "cache_mib": _cache_bytes(session._tail) / 2**20,
                          "rss_added_mib": (me.memory_info().rss - before) / 2**20, "cold_s": cold,
                          "step_s": step, "window_steps": result.analysis.window.step_count}
            del session, result
    return out


if __name__ == "__main__":
    main()
