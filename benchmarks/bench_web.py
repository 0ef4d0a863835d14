"""Cost of the web view per refresh with 10 pages open on one run, and its JSON size.

For each rank count (default 64 and 1,024; 100 aligned steps written through
`StepTimeStore`), every tick appends one step for every rank (so the analysis has
new data to read), then 10 threads request the run's JSON endpoint through
`WebApp.handle` at once. It checks that the tick cost one session refresh and
one analysis whatever the number of pages, and prints:

- the baseline: a plain `LiveStepTimeSession.refresh()` on the same new step (what
  the processor's run monitor already pays each tick), measured in the same run;
- the web refresh: the tick's 10 answers (one refresh, run facts, view model,
  fragments, JSON; nine cached answers), as a ratio to the baseline;
- a cached answer (a page polling within the tick);
- the JSON answer's size, and the HTML page's.

    .venv/bin/python -m benchmarks.bench_web [--quick] [--ranks N ...] [--ticks N] [--json]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.lib.json_output import add_json_flag, print_json, table_output
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.model import RankIdentity, RawEventValue, StepTimeIngestRecord
from traceml.processor.step_time.pipeline import LiveStepTimeSession
from traceml.processor.web.app import WebApp
from traceml.processor.web.feed import RunFeed
from traceml.schema import vocabulary as v

RUN = "bench-web"
STEPS = 100
PAGES = 10
BASE = {v.RAW_DATALOADER_NEXT: 5.0, v.RAW_H2D: 5.0, v.RAW_FORWARD: 30.0, v.RAW_BACKWARD: 45.0,
        v.RAW_OPTIMIZER_STEP: 10.0, v.RAW_STEP_TIME: 95.0}


def _append(store: StepTimeStore, ranks: int, steps: range) -> None:
    batch = []
    for step in steps:
        for rank in range(ranks):
            events = {k: RawEventValue(2 * x, x + (rank % 5), 1) for k, x in BASE.items()}
            batch.append(StepTimeIngestRecord(RUN, RankIdentity(rank, world_size=ranks), step,
                                              1.7e9 + step, 1.7e9 + step + 0.1, events, "ddp"))
        if len(batch) >= 20_000:
            store.write(batch, [])
            batch = []
    if batch:
        store.write(batch, [])


def measure_ranks(tmp: Path, ranks: int, ticks: int) -> dict:
    db = tmp / f"r{ranks}.db"
    now = [0.0]
    with StepTimeStore(db) as store:
        _append(store, ranks, range(1, STEPS + 1))
        feed = RunFeed(db, tick_s=1.0, clock=lambda: now[0])
        app = WebApp(feed)
        baseline = LiveStepTimeSession(db, RUN)
        baseline.refresh()
        app.handle("GET", "/ui/api/run", f"id={RUN}", {})  # first full read of both sessions
        session = feed._session(RUN)
        base_ms, tick_ms, cached_ms = [], [], []
        refreshes, analyses = [], []
        size = 0
        barrier = threading.Barrier(PAGES)

        def page(_):
            barrier.wait()
            return app.handle("GET", "/ui/api/run", f"id={RUN}", {}).body

        with ThreadPoolExecutor(PAGES) as pool:
            for tick in range(ticks):
                step = STEPS + 1 + tick
                _append(store, ranks, range(step, step + 1))
                t = time.perf_counter()
                baseline.refresh()
                base_ms.append((time.perf_counter() - t) * 1e3)
                now[0] += 1.0
                r0, a0 = feed.refreshes, session.analyses
                t = time.perf_counter()
                bodies = list(pool.map(page, range(PAGES)))
                tick_ms.append((time.perf_counter() - t) * 1e3)
                refreshes.append(feed.refreshes - r0)
                analyses.append(session.analyses - a0)
                assert len(set(bodies)) == 1, "pages of one tick got different answers"
                size = len(bodies[0])
                t = time.perf_counter()
                app.handle("GET", "/ui/api/run", f"id={RUN}", {})
                cached_ms.append((time.perf_counter() - t) * 1e3)
        page_bytes = len(app.handle("GET", "/ui/run", f"id={RUN}", {}).body)
    base, web = statistics.median(base_ms), statistics.median(tick_ms)
    return {"ranks": ranks, "pages": PAGES, "ticks": ticks,
            "session_refresh_ms": base, "web_tick_ms": web, "web_tick_ratio": web / base,
            "cached_answer_ms": statistics.median(cached_ms),
            "refreshes_per_tick": max(refreshes), "analyses_per_tick": max(analyses),
            "json_bytes": size, "page_bytes": page_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,024 ranks only, 3 ticks")
    parser.add_argument("--ranks", type=int, nargs="+", help="rank counts (default 64 1024)")
    parser.add_argument("--ticks", type=int, help="ticks per rank count (default 7; --quick 3)")
    add_json_flag(parser)
    args = parser.parse_args()
    with table_output(args.json):
        figures = measure(args)
    if args.json:
        print_json("bench_web", args, figures)


def measure(args) -> dict:
    sizes = args.ranks or ((1024,) if args.quick else (64, 1024))
    ticks = args.ticks or (3 if args.quick else 7)
    figures: dict = {"web": []}
    print(f"{'ranks':>6} {'refresh':>9} {'10 pages':>9} {'ratio':>7} {'cached':>8} {'refr/tick':>9} "
          f"{'anal/tick':>9} {'JSON':>9} {'page':>9}   (ms; ratio = 10 pages / refresh)")
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in sizes:
            f = measure_ranks(Path(tmp), ranks, ticks)
            print(f"{ranks:>6} {f['session_refresh_ms']:9.2f} {f['web_tick_ms']:9.2f} {f['web_tick_ratio']:6.2f}x "
                  f"{f['cached_answer_ms']:8.3f} {f['refreshes_per_tick']:>9} {f['analyses_per_tick']:>9} "
                  f"{f['json_bytes']:>9,} {f['page_bytes']:>9,}")
            figures["web"].append(f)
    return figures


if __name__ == "__main__":
    main()
