"""`traceml summary PATH`: rebuild `final_summary.json` and the card from stored data.

PATH is a run folder (`traceml_runs/<run id>/`) or any processor database. The
summary is rebuilt with the same reporting code the run's end uses, so it can
be regenerated after a crash, after a schema upgrade, or for one run of a
shared processor database. Run ids and the card are printed through
`presenters.terminal_text.printable` (they come from the wire); `--json` prints
the true strings, JSON-escaped.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence, TextIO

from traceml.launcher import run_dir as rd
from traceml.launcher.stored_runs import RunLookupError, choose_run, find_database, list_runs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="traceml summary",
        description="Rebuild final_summary.json and the text card from a run folder or a processor database.")
    parser.add_argument("path", help="run folder (traceml_runs/<run id>) or SQLite database")
    parser.add_argument("--run", dest="run_id", default=None,
                        help="run id inside the database (default: the most recently active run)")
    parser.add_argument("--out", default=None,
                        help="folder to write into (default: the run folder)")
    parser.add_argument("--json", action="store_true", help="print the summary JSON instead of the card")
    parser.add_argument("--list", action="store_true", help="list the runs in the database and exit")
    parser.add_argument("--html", nargs="?", const="", default=None, metavar="PATH",
                        help="also write a one-file HTML report (default PATH: report.html in the output folder)")
    return parser


def default_output_folder(db_path: Path, run_id: str) -> Path:
    """The run folder the database sits in, else `<database folder>/<run id>`."""
    folder = rd.run_directory(db_path.parent.parent, run_id)
    if folder == db_path.parent.resolve():
        return folder
    return rd.run_directory(db_path.parent, run_id)


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    from traceml.processor.api import printable

    out = out or sys.stdout
    options = build_parser().parse_args(list(argv))
    try:
        db_path = find_database(options.path)
        if options.list:
            for run in list_runs(db_path):
                print(f"{printable(run.run_id)}\tlatest step {run.latest_step}", file=out)
            return 0
        run_id = choose_run(db_path, options.run_id)
    except RunLookupError as exc:
        print(f"traceml summary: {printable(exc)}", file=sys.stderr)
        return 2
    from traceml.launcher.finalize import write_report

    folder = Path(options.out) if options.out else default_output_folder(db_path, run_id)
    report = write_report(db_path, run_id, folder)
    if options.json:
        print(json.dumps(report.summary, indent=2), file=out)
    else:
        if report.card:
            print(printable(report.card.rstrip("\n"), keep_newlines=True), file=out)
        print(f"\n[traceml] final summary: {report.summary_path}", file=out)
        if report.card_path is not None:
            print(f"[traceml] text card:     {report.card_path}", file=out)
    if options.html is not None:
        from traceml.processor.api import REPORT_FILENAME, write_run_report

        html_path = write_run_report(db_path, run_id, Path(options.html) if options.html else folder / REPORT_FILENAME)
        print(f"[traceml] HTML report:   {html_path}", file=sys.stderr if options.json else out)
    return 0
