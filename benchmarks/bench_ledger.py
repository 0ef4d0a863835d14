"""The badput ledger's cost in the live tick, at many ranks (issue 35).

Builds a WAL store through `StepTimeStore` (the receivers' write path) for each
case, then, per rank count (150 steps per rank, live window 100):

- tick: `LiveStepTimeSession.refresh()` after one new step per rank arrived (read,
  analysis, diagnosis and ledger; median of N; wall and CPU time);
- ledger: `window_ledger(window, diagnosis, resources)` alone on that tick's analysis
  (median of N; wall and CPU time), and its share of the tick (wall).

Two cases: `balanced` (the shared synthetic rows: no finding with a what-if, the ledger
reads only rank averages) and `straggler` (the last rank's input waits 100 ms more and
every other rank waits it out in collectives: an INPUT_STRAGGLER with a what-if, which
reads per-step arrays of every rank).

    .venv/bin/python -m benchmarks.bench_ledger              # 64 and 1,024 ranks
    .venv/bin/python -m benchmarks.bench_ledger --ranks 8    # one small case
    .venv/bin/python -m benchmarks.bench_ledger --json       # the figures as one JSON object
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.json_output import add_json_flag, print_json, table_output
from benchmarks.lib.step_time_rows import RUN, records
from traceml.processor.diagnosis.ledger import window_ledger
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.model import RawEventValue
from traceml.processor.step_time.pipeline import LiveStepTimeSession
from traceml.schema import vocabulary as v

CASES = ("balanced", "straggler")
LATE_MS = 100.0


def case_records(case: str, ranks: int, steps: range) -> list:
    """The shared synthetic rows; for `straggler`, the last rank's input is 100 ms late and every
    other rank waits that long (plus 1 ms of transfer) in a collective inside its backward."""
    out = records(ranks, steps)
    if case == "balanced" or ranks < 2:
        return out
    late = ranks - 1
    changed = []
    for record in out:
        events = dict(record.events)
        if record.identity.global_rank == late:
            extra = {v.RAW_DATALOADER_NEXT: LATE_MS, v.RAW_COLLECTIVE_WAIT: 0.0}
            wait = 1.0
        else:
            extra = {v.RAW_BACKWARD: LATE_MS, v.RAW_STEP_TIME: LATE_MS}
            wait = 1.0 + LATE_MS
        for name, add in extra.items():
            base = events.get(name, RawEventValue(0.0, 0.0, 1))
            events[name] = RawEventValue(base.cpu_ms + 2 * add, base.gpu_ms + add, 1)
        events[v.RAW_COLLECTIVE_WAIT] = RawEventValue(2 * wait, wait, 1)
        changed.append(dataclasses.replace(record, events=events))
    return changed


def bench_case(folder: Path, case: str, ranks: int, steps: int = 150, repeats: int = 9) -> dict:
    db = folder / f"{case}_{ranks}.db"
    store = StepTimeStore(db)
    t0 = time.perf_counter()
    per_batch = max(1, 20_000 // ranks)
    for start in range(1, steps + 1, per_batch):
        store.write(case_records(case, ranks, range(start, min(start + per_batch, steps + 1))))
    build_s = time.perf_counter() - t0
    session = LiveStepTimeSession(db, RUN)
    result = session.refresh()
    assert result.freshness == "live" and result.analysis.window.step_count == 100
    ticks, tick_cpu = [], []
    next_step = steps + 1
    for _ in range(repeats):
        store.write(case_records(case, ranks, range(next_step, next_step + 1)))
        next_step += 1
        t0, c0 = time.perf_counter(), time.process_time()
        result = session.refresh()
        ticks.append(time.perf_counter() - t0)
        tick_cpu.append(time.process_time() - c0)
    store.close()
    analysis = result.analysis
    ledger_times, ledger_cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        ledger = window_ledger(analysis.window, analysis.diagnosis, analysis.resources)
        ledger_times.append(time.perf_counter() - t0)
        ledger_cpu.append(time.process_time() - c0)
    assert ledger.ranks == ranks and ledger.total_rank_seconds is not None
    if case == "straggler" and ranks >= 2:
        assert analysis.diagnosis.primary.kind == "INPUT_STRAGGLER", analysis.diagnosis.primary
        assert ledger.what_ifs and ledger.what_ifs[0].culprit_rank == ranks - 1
    tick, cost = statistics.median(ticks), statistics.median(ledger_times)
    return {"case": case, "ranks": ranks, "tick_ms": tick * 1e3, "tick_cpu_ms": statistics.median(tick_cpu) * 1e3,
            "ledger_ms": cost * 1e3, "ledger_cpu_ms": statistics.median(ledger_cpu) * 1e3,
            "ledger_share_ratio": cost / tick, "what_ifs": len(ledger.what_ifs),
            "db_build_s": build_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", help="rank counts (default 64 and 1,024)")
    parser.add_argument("--repeats", type=int, default=9, help="ticks and ledger runs per case (medians)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    with table_output(args.json):
        figures = measure(args)
    if args.json:
        print_json("bench_ledger", args, figures)
    return 0


def measure(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="traceml-bench-") as tmp:
        print("Badput ledger in the live tick (150 steps/rank, window 100), milliseconds (medians)")
        print(f"{'case':>10} {'ranks':>6} {'tick':>9} {'tick cpu':>9} {'ledger':>9} {'ldg cpu':>9} {'share':>7}"
              f" {'what-ifs':>8}"
              "   (db build s)")
        for ranks in args.ranks or [64, 1024]:
            for case in CASES:
                r = bench_case(Path(tmp), case, ranks, repeats=args.repeats)
                rows.append(r)
                print(f"{case:>10} {ranks:>6} {r['tick_ms']:9.2f} {r['tick_cpu_ms']:9.2f} {r['ledger_ms']:9.2f}"
                      f" {r['ledger_cpu_ms']:9.2f} {r['ledger_share_ratio']:7.1%} {r['what_ifs']:>8}   ({r['db_build_s']:.1f})", flush=True)
    return {"ledger": rows}


if __name__ == "__main__":
    sys.exit(main())
