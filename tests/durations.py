"""How long each test took when the suite last ran whole, for the scheduler's order.

`scripts/test.sh` runs the suite on pytest-xdist workers; the order in which the work goes out
decides how long the run takes. Handed out in collection order, a minute-long test picked up
last runs alone at the end, and one picked up beside the serial block keeps a serial test
waiting for the room (tests/serial_tests.py). With each test's duration known the scheduler
hands out the longest work first, and beside a serial test that holds the room only the shortest.

The figures live in `tests/durations.json` (node id -> seconds of setup, call and teardown,
one decimal), written by `pytest --store-durations` on a whole run and committed; a test not
in it counts as `UNKNOWN_SECONDS`. They only order the work: a stale file makes a run slower,
never wrong.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

DURATIONS_FILE = Path(__file__).with_name("durations.json")

UNKNOWN_SECONDS = 1.0
"""A test the file does not know yet (a new one): above most unit tests, below a real run."""


def load_durations(path: Path = DURATIONS_FILE) -> dict[str, float]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in loaded.items() if isinstance(v, (int, float))} \
        if isinstance(loaded, dict) else {}


def store_durations(measured: dict[str, float], exists: Callable[[str], bool], path: Path = DURATIONS_FILE) -> None:
    """Write this run's figures over the file's: tests that ran get theirs, the others keep the old
    ones while `exists` says their module is still there."""
    merged = {nodeid: seconds for nodeid, seconds in load_durations(path).items() if exists(nodeid)}
    merged.update(measured)
    path.write_text(json.dumps({nodeid: round(seconds, 1) for nodeid, seconds in merged.items()},
                               indent=0, sort_keys=True) + "\n")


def unit_seconds(nodeids, durations: dict[str, float]) -> float:
    return sum(durations.get(nodeid, UNKNOWN_SECONDS) for nodeid in nodeids)
