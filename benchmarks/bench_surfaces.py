"""Cost of what runs on top of an analysed window: diagnosis, final summary, summary metrics, live view.

For 1, 8, 64 and 1,024 ranks (100 aligned steps, written through `StepTimeStore`
like the receivers do), measures the median of N calls of each surface and prints
it next to the analyzer's own cost on the same snapshot, measured in the same run,
as the baseline ratio.

    .venv/bin/python -m benchmarks.bench_surfaces [--quick] [--ranks N ...] [--json]
"""
from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console

from benchmarks.lib.json_output import add_json_flag, print_json, table_output
from traceml.processor.diagnosis import diagnose
from traceml.processor.presenters import render_live
from traceml.processor.reporting import RunMetadata, project_final_summary, summary_metric_points
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.analysis import analyze_snapshot
from traceml.processor.step_time.model import (
    LiveStepTimeResult,
    RankIdentity,
    RawEventValue,
    StepTimeAnalysis,
    StepTimeIngestRecord,
)
from traceml.processor.step_time.sqlite_reader import load_summary_snapshot
from traceml.schema import vocabulary as v

RUN = "bench-surfaces"
STEPS = 100


def _write(db: Path, ranks: int) -> None:
    base = {v.RAW_DATALOADER_NEXT: 5.0, v.RAW_H2D: 5.0, v.RAW_FORWARD: 30.0, v.RAW_BACKWARD: 45.0,
            v.RAW_OPTIMIZER_STEP: 10.0, v.RAW_STEP_TIME: 95.0}
    with StepTimeStore(db) as store:
        batch = []
        for step in range(1, STEPS + 1):
            for rank in range(ranks):
                events = {k: RawEventValue(2 * x, x + (rank % 5), 1) for k, x in base.items()}
                batch.append(StepTimeIngestRecord(RUN, RankIdentity(rank, world_size=ranks), step,
                                                  1.7e9 + step, 1.7e9 + step + 0.1, events, "ddp"))
            if len(batch) >= 20_000:
                store.write(batch, [])
                batch = []
        if batch:
            store.write(batch, [])


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1, 8 and 64 ranks only")
    parser.add_argument("--ranks", type=int, nargs="+", help="rank counts (default 1 8 64 1024; --quick: 1 8 64)")
    parser.add_argument("--repeats", type=int, help="calls per median (default 15, 5 from 1,024 ranks)")
    add_json_flag(parser)
    args = parser.parse_args()
    with table_output(args.json):
        figures = measure(args)
    if args.json:
        print_json("bench_surfaces", args, figures)


def measure(args) -> dict:
    sizes = args.ranks or ((1, 8, 64) if args.quick else (1, 8, 64, 1024))
    figures: dict = {"surfaces": []}
    print(f"{'ranks':>6} {'analyzer':>9} {'diagnose':>9} {'summary':>9} {'points':>9} {'render':>9}  (ms; x = / analyzer)")
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in sizes:
            db = Path(tmp) / f"r{ranks}.db"
            _write(db, ranks)
            snapshot = load_summary_snapshot(db, RUN, STEPS)
            repeats = args.repeats or (5 if ranks >= 1024 else 15)
            base = _median_ms(lambda: analyze_snapshot(snapshot, STEPS), repeats)
            window = analyze_snapshot(snapshot, STEPS)
            diag_ms = _median_ms(lambda: diagnose(window), repeats)
            analysis = StepTimeAnalysis(window, diagnose(window))
            meta = RunMetadata(RUN, generated_at=time.time())
            summary_ms = _median_ms(lambda: project_final_summary(analysis, meta), repeats)
            points_ms = _median_ms(lambda: summary_metric_points(analysis, freshness="live"), repeats)
            result = LiveStepTimeResult(analysis, "live", 0.0)
            render_ms = _median_ms(
                lambda: Console(file=io.StringIO(), width=150).print(render_live(result)), repeats)
            cells = [f"{x:8.2f}" + f" ({x / base:.2f}x)" for x in (diag_ms, summary_ms, points_ms, render_ms)]
            print(f"{ranks:>6} {base:9.2f} " + " ".join(cells))
            figures["surfaces"].append({"ranks": ranks, "analyzer_ms": base, "diagnose_ms": diag_ms,
                                        "final_summary_ms": summary_ms, "summary_metric_points_ms": points_ms,
                                        "render_live_ms": render_ms})
    return figures


if __name__ == "__main__":
    main()
