"""`traceml fleet --db PATH [--days D]`: which hosts and GPUs keep being a run's straggler.

Read-only: it lists what the processor recorded in its store when it summarised each run
(the repeat-offender history, docs/DIAGNOSIS.md "Repeat offenders across runs"), hosts
and their GPUs by runs flagged and time lost over the period. `--json` prints the same
entries for scripts. A database of a processor older than the history says so.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence, TextIO

from traceml.launcher.stored_runs import RunLookupError, find_database


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="traceml fleet",
        description="List the hosts and GPUs named as a run's confirmed straggler in a processor's store, "
                    "by runs flagged and time lost.")
    parser.add_argument("--db", required=True, help="processor SQLite database, or a run folder holding one")
    parser.add_argument("--days", type=float, default=7.0, help="the period, in days back from now (default 7)")
    parser.add_argument("--json", action="store_true", help="print the entries as JSON")
    return parser


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    from dataclasses import asdict

    from traceml.processor.api import FLEET_COLUMNS, StoreReadError, fleet_rows, printable, read_fleet

    out = out or sys.stdout
    parser = build_parser()
    options = parser.parse_args(list(argv))
    if not options.days > 0:
        parser.error("--days must be positive")
    try:
        db_path = find_database(options.db)
        import time

        entries = read_fleet(db_path, since=time.time() - options.days * 86400.0)
    except (RunLookupError, StoreReadError) as exc:
        why = " (a store written before the repeat-offender history holds none)" \
            if isinstance(exc, StoreReadError) else ""
        print(f"traceml fleet: {printable(exc)}{why}", file=sys.stderr)
        return 2
    if options.json:
        print(json.dumps([asdict(entry) for entry in entries], indent=2), file=out)
        return 0
    if not entries:
        print(f"No host was a confirmed straggler in the last {options.days:g} days ({printable(db_path)}).",
              file=out)
        return 0
    rows = [tuple(printable(cell) for cell in row) for row in fleet_rows(entries)]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(FLEET_COLUMNS)]
    print(f"Repeat offenders over the last {options.days:g} days ({printable(db_path)}):", file=out)
    print("  ".join(h.ljust(w) for h, w in zip(FLEET_COLUMNS, widths)).rstrip(), file=out)
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=out)
    return 0
