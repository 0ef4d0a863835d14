"""`--json` for every benchmark and check: one JSON object of its figures on stdout.

With `--json` the human-readable table goes to stderr, so stdout holds exactly one
object, the same shape everywhere:

    {"benchmark": "bench_ingest", "config": {<the command-line options>}, "figures": {...}}

Figure keys are snake_case and end in their unit (`_us`, `_ms`, `_s`, `_mib`,
`_per_s`, `_ratio`); counts have no suffix.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Iterator


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object of the figures on stdout (the table goes to stderr)")


@contextlib.contextmanager
def table_output(json_mode: bool) -> Iterator[None]:
    """Under `--json`, what the benchmark prints goes to stderr; otherwise nothing changes."""
    if not json_mode:
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _plain(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def print_json(benchmark: str, args: argparse.Namespace, figures: dict) -> None:
    config = {k: _plain(v) for k, v in vars(args).items() if k != "json"}
    print(json.dumps({"benchmark": benchmark, "config": config, "figures": figures}, default=_plain), flush=True)
