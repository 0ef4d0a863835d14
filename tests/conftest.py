"""Project-wide pytest options, where the rewritten test modules are cached, and which tests run alone."""
import re
import sys
from pathlib import Path

import pytest

from tests.durations import store_durations
from tests.serial_tests import (SerialLock, group_shared_fixtures, holds_the_room, is_beside_serial, mark_serial,
                                module_group_scheduling, run_at)

_SERIAL_LOCK = pytest.StashKey["SerialLock"]()
_GROUPED = pytest.StashKey[set]()

if sys.dont_write_bytecode and sys.prefix != sys.base_prefix and sys.pycache_prefix is None:
    # PYTHONDONTWRITEBYTECODE keeps bytecode out of the checkout; pytest then rewrites and
    # compiles every test module again on each run (about 9 of the fast loop's seconds here).
    # The rewritten modules go to the virtual environment's own folder instead, never the tree.
    sys.pycache_prefix = str(Path(sys.prefix) / "pycache")
    sys.dont_write_bytecode = False


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden", action="store_true", default=False,
        help="rewrite tests/step_time/golden/*.json (refused for a key or null-pattern change "
             "at an unchanged SCHEMA_VERSION)",
    )
    parser.addoption(
        "--store-durations", action="store_true", default=False,
        help="write each test's duration (setup, call and teardown) into tests/durations.json, "
             "which orders the work under -n (tests/durations.py); run it on the whole suite",
    )


class _DurationRecorder:
    """On the process that receives the reports (xdist's controller, or the only one): each test's
    setup, call and teardown seconds, written at the end (tests/durations.py)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report) -> None:
        self._seconds[report.nodeid] = self._seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        if self._seconds:
            store_durations(self._seconds, lambda nodeid: (self._root / nodeid.split("::", 1)[0]).is_file())


@pytest.hookimpl(tryfirst=True)  # before `-m` and `-k` deselect: a module's groups count all its tests
def pytest_collection_modifyitems(config, items):
    mark_serial(items, config.rootpath)
    if getattr(config, "workerinput", None) is not None and config.option.basetemp:
        config.stash[_GROUPED] = group_shared_fixtures(items, Path(config.option.basetemp).parent)


def pytest_collection_finish(session):
    """The serial block as the scheduler will hand it out: the tests left after `-m` and `-k`."""
    lock = session.config.stash.get(_SERIAL_LOCK, None)
    if lock is not None:
        lock.know_block([item.nodeid for item in session.items], session.config.stash.get(_GROUPED, set()))


_WHOLLY_SLOW = re.compile(r"^pytestmark = \[?pytest\.mark\.slow\b", re.M)


def pytest_ignore_collect(collection_path, config):
    """Under the fast loop's `-m "not slow"`, a module marked slow as a whole (a module-level
    `pytestmark = pytest.mark.slow`, or a list that starts with it) is not even imported: its
    imports alone (transformers' Trainer, say) cost seconds of the loop's minute."""
    if (config.option.markexpr or "").split() == ["not", "slow"] and collection_path.suffix == ".py" \
            and collection_path.name.startswith("test_") and _WHOLLY_SLOW.search(collection_path.read_text()):
        return True
    return None


def pytest_xdist_make_scheduler(config, log):
    """With `-n`, the modules whose tests share a fixture run on one worker (tests/serial_tests.py)."""
    return module_group_scheduling(config, log)


@pytest.hookimpl(tryfirst=True, wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, where the workers can set priorities, the serial block's tests run at
    normal priority and the others at idle priority until the block is done; a test that holds
    the room runs with no other test beside it but those listed as fit to (tests/serial_tests.py:
    they wait and use next to no CPU; they take no lock).

    The outermost wrapper, so the wait for the lock is neither in the test's timeout nor its duration.
    """
    lock = item.config.stash.get(_SERIAL_LOCK, None)
    if lock is None:
        return (yield)
    if lock.by_priority:
        run_at(normal=lock.at_normal_priority(item.nodeid))
    locks = not is_beside_serial(item.nodeid)  # one that may run beside a serial test takes no lock
    exclusive = holds_the_room(item.nodeid, lock.by_priority)
    if locks:
        lock.enter(exclusive)
    try:
        return (yield)
    finally:
        if locks:
            after = nextitem is not None and holds_the_room(nextitem.nodeid, lock.by_priority)
            lock.leave(exclusive, next_exclusive=after)  # a serial test keeps the room for the next one
        lock.finished(item.nodeid)


def pytest_configure(config):
    if config.getoption("--store-durations") and getattr(config, "workerinput", None) is None:
        config.pluginmanager.register(_DurationRecorder(config.rootpath), "traceml-durations")
    workerinput = getattr(config, "workerinput", None)  # set on pytest-xdist's workers only
    if workerinput is not None and config.option.basetemp:
        # Each worker's basetemp is <the run's temporary root>/<worker id>: the root is this run's.
        config.stash[_SERIAL_LOCK] = SerialLock(Path(config.option.basetemp).parent)
