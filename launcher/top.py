"""`traceml top --db PATH [--run ID]`: watch a processor's database live from another terminal.

Read-only and independent of the processor process: it opens the same SQLite
file (WAL lets readers run beside the writer), runs its own
`LiveStepTimeSession`, and draws the same live view as `traceml run --live`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence, TextIO

from traceml.launcher.stored_runs import RunLookupError, find_database


LIVE_WAIT_S = 30.0
"""How long the live view waits for a database a processor is about to create; `--once` asks about
now, so it does not wait unless `--wait` says so."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="traceml top",
        description="Watch a traceml-processor database live (the same view as traceml run --live).")
    parser.add_argument("--db", required=True,
                        help="processor SQLite database, or a run folder holding one")
    parser.add_argument("--run", dest="run_id", default=None,
                        help="run id to watch (default: the most recently active run, chosen once "
                             "data exists)")
    parser.add_argument("--refresh", type=float, default=1.0, metavar="SECONDS",
                        help="refresh interval (default 1.0)")
    parser.add_argument("--once", action="store_true", help="draw one frame and exit")
    parser.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                        help=f"how long to wait for the database to appear (default {LIVE_WAIT_S:g}; "
                             "with --once 0: a missing database is reported at once)")
    return parser


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    from traceml.processor.api import printable

    out = out or sys.stdout
    parser = build_parser()
    options = parser.parse_args(list(argv))
    if options.refresh <= 0:
        parser.error("--refresh must be positive")
    wait = options.wait if options.wait is not None else (0.0 if options.once else LIVE_WAIT_S)
    deadline = time.monotonic() + max(0.0, wait)
    while True:
        try:
            db_path = find_database(options.db)
            break
        except RunLookupError as exc:
            if time.monotonic() >= deadline:
                print(f"traceml top: {printable(exc)}", file=sys.stderr)
                return 2
            time.sleep(0.5)
    from traceml.launcher.live import LiveMonitor

    monitor = LiveMonitor(Path(db_path), options.run_id, refresh_s=options.refresh, out=out,
                          title=f"TraceML top · {db_path}")
    if options.once:
        result = monitor.refresh_once()
        if result is None:
            print(f"traceml top: no run data in {db_path} yet", file=sys.stderr)
            return 1
        return 0
    try:
        monitor.run_forever()
    except KeyboardInterrupt:
        pass
    return 0
