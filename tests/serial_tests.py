"""Which tests run alone, and the lock that keeps them apart when pytest-xdist runs the rest in parallel.

`scripts/test.sh` runs the suite on several workers (`-n`). Most tests only wait on other
processes and share the CPUs well; the ones listed here measure time or decide something
from how fast a rank, a thread or a loop went, with margins that another worker's test
burning a core beside them could cross. They get the `serial` marker (pyproject's markers
say what it means). Where priorities cannot be set (below), while one of them runs (setup,
call and teardown) no other test of the same session runs on any worker: every test holds a
lock on one file, the serial ones exclusively, the others shared. A second file is a turnstile taken before the lock, so a
serial test waiting for the room to empty is not overtaken by new shared holders.

The lock files live in the session's temporary root, which all workers of one run share
and a pytest started by a test does not; without xdist the tests run one at a time and
nothing is locked. Each entry is a node id or a node id prefix (a module, or a test
without its parameters); an entry that matches nothing in a module that was collected is
an error, so a renamed test cannot silently fall out of the list.

Where the workers may set their own scheduling policy (Linux, allowed to leave SCHED_IDLE again:
`idle_priority_works`), the room is kept by priority instead: while the serial block (below)
runs, its tests run at normal priority and every other test at idle priority (SCHED_IDLE,
inherited by the processes it starts), so the kernel gives the block's processes a core the
moment they want one and the other workers only the time they leave; without the lock, the
other workers use that time instead of waiting. Once the block is done every test runs at
normal priority again: idle-priority processes do not preempt each other when they wake (the
next tick does, up to 4 ms later), which the other tests should pay only while they must. Only
the serial tests listed in WHOLE_MACHINE (they read the host's own load, nothing is injected into
them, or they were seen to change with idle-priority neighbours) still take the room exclusively.

While a serial test holds the room, the other workers wait; before it starts, it waits for the tests the
other workers are running. So that the second wait is paid once rather than before each serial
test, the scheduler hands all of them to one worker as one block (with the whole modules of
those that share a fixture), those that hold the room first (`block_order`), and a serial test
followed by another on its worker keeps the room for it (SerialLock). While a test of the block
that holds the room is still to come, the other workers get the tests listed as fit to run beside
it, then the shortest ones (a serial test waits for them); after it, the longest first
(tests/durations.py).
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from tests.durations import load_durations, unit_seconds

# node id (prefix) -> why it must not share the machine with other tests at its own priority
SERIAL: dict[str, str] = {
    "tests/benchmarks/test_bench_resources.py":
        "throughput ratios with and without the sampler, and tick counts in a fixed time",
    "tests/exporter/test_failure_modes.py::test_a_retry_delay_beyond_the_deadline_gives_up_at_once":
        "the give-up must come well before the 3 s deadline (under 2.5 s)",
    "tests/instrumentation/test_collective_wait.py::test_explicit_collectives_in_a_plain_loop_are_timed":
        "the late rank must wait 20 of the injected 50 ms less than the other",
    "tests/instrumentation/test_collective_wait.py::test_ddp_rank_slowed_in_backward_waits_least_and_enters_last":
        "wait and entry-order margins of 20 ms between three ranks",
    "tests/launcher/test_collective_diagnosis.py::test_a_balanced_ddp_run_names_no_rank":
        "a balanced run must name no rank (jitter under 10 % of the step)",
    "tests/launcher/test_collective_diagnosis.py::test_a_job_that_slows_down_from_step_30_on_is_reported_with_its_onset":
        "a drift's onset within 2 steps",
    "tests/launcher/test_collective_diagnosis.py::"
    "test_a_stragglers_what_if_predicts_a_second_run_of_the_job_without_the_delay":
        "the what-if of one run must hold a second run's step time (the balanced run's, made alone too)"
        " within the first's step-to-step spread",
    "tests/launcher/test_collective_diagnosis.py::test_a_job_that_all_reduces_a_large_tensor_every_step_is_collective_bound":
        "no rank may be named: a rank slowed by another test's load arrives late to the all-reduce"
        " (seen: a 10.5 % straggler warning in a clean-clone CI run)",
    "tests/launcher/test_capture_runs.py::test_traceml_capture_against_the_live_run_returns_a_digest":
        "aten::sort must top the digest: in a clean-clone CI run the culprit's DistributedDataParallel.forward"
        " self time, which holds its 20 ms device-like sleep, grew by 16.2 ms of a loaded machine's wake-up"
        " delay and came out 0.07 ms above the sort's +16.1 ms (the module's two runs join the block)",
    "tests/launcher/test_collective_hf.py":
        "the fast rank must wait 30 ms more than the slow one in each step's gather",
    "tests/launcher/test_demo_and_surfaces.py::test_demo_diagnosis_names_the_injected_problem_and_rank[balanced]":
        "the balanced demo must name no rank; the module's shared balanced run is made here",
    "tests/launcher/test_demo_and_surfaces.py::test_demo_diagnosis_names_the_injected_problem_and_rank[input-straggler]":
        "the module's shared input-straggler run is made here: the injected rank must be the one named",
    "tests/launcher/test_demo_and_surfaces.py::test_a_balanced_runs_ledger_is_near_zero":
        "nothing is injected: a rank slowed by another test's load would lose time to straggler wait",
    "tests/launcher/test_input_kinds.py::test_a_balanced_run_names_nobody":
        "nothing is injected: a rank slowed by another test's load would be named",
    "tests/launcher/test_resource_runs.py::"
    "test_an_input_bound_run_beside_a_cpu_burning_neighbour_is_told_the_cpus_are_saturated":
        "burns every core itself, then compares the host CPU of a quiet run against it",
}


# serial node id (prefix) -> why it holds the room even where priorities keep the others out of its
# way: it reads the host's own load, nothing is injected into it (so any jitter a neighbour adds
# is a finding), or it failed beside idle-priority neighbours.
WHOLE_MACHINE: dict[str, str] = {
    "tests/benchmarks/test_bench_resources.py":
        "tick counts in a fixed time and throughput ratios read from the host",
    "tests/launcher/test_input_kinds.py::test_a_balanced_run_names_nobody":
        "nothing is injected: beside idle-priority tests in a clean-clone run a rank was named a"
        " straggler at score 0.1002 (the mark is 0.10)",
    "tests/launcher/test_collective_diagnosis.py::test_a_balanced_ddp_run_names_no_rank":
        "nothing is injected: the same margin as the balanced input-kinds run",
    "tests/launcher/test_collective_diagnosis.py::"
    "test_a_stragglers_what_if_predicts_a_second_run_of_the_job_without_the_delay":
        "its second run is the balanced one above, and the prediction must hold it within one run's spread",
    "tests/launcher/test_demo_and_surfaces.py::test_demo_diagnosis_names_the_injected_problem_and_rank[balanced]":
        "nothing is injected: the same margin as the balanced input-kinds run",
    "tests/launcher/test_demo_and_surfaces.py::test_a_balanced_runs_ledger_is_near_zero":
        "nothing is injected: beside three processes spinning at nice 19 straggler wait took 8 % of the"
        " run (the claim allows 5 %)",
    "tests/launcher/test_collective_diagnosis.py::test_a_job_that_all_reduces_a_large_tensor_every_step_is_collective_bound":
        "beside three processes spinning at idle priority a rank was named a 10.6 % compute straggler",
    "tests/launcher/test_resource_runs.py::"
    "test_an_input_bound_run_beside_a_cpu_burning_neighbour_is_told_the_cpus_are_saturated":
        "the quiet run's host CPU must be its own: any neighbour's work, at any priority, is in it",
}


# node id (prefix) -> why it may run beside a serial test: it waits on timeouts or deadlines and uses
# next to no CPU (measured with its children, on a loaded machine), so it neither disturbs a serial
# test nor is disturbed by one more than by any other neighbour. It takes no lock, and the scheduler
# hands these out right after the serial block, so the other workers run them while the block holds
# the machine instead of idling.
BESIDE_SERIAL: dict[str, str] = {
    "tests/processor/test_settings.py::test_stop_stays_bounded_when_the_push_timeout_is_no_limit":
        "waits out a destination that never answers: 12.5 s, 0.01 CPU-s",
    "tests/exporter/test_failure_modes.py::test_sink_calls_never_block_and_losses_are_counted":
        "dead, stalled and failing endpoints: about 2 s each, 0.05 CPU-s",
    "tests/exporter/test_failure_modes.py::test_grpc_retry_info_is_retried_no_sooner_than_its_delay":
        "waits out a retry delay: 1 s each, 0.02 CPU-s",
    "tests/exporter/test_failure_modes.py::test_http_retry_after_seconds_is_honoured":
        "waits out a Retry-After: 1 s each, 0.03 CPU-s",
    "tests/exporter/test_failure_modes.py::test_http_retry_after_as_an_http_date_is_honoured":
        "waits out a Retry-After date: 1.5 s, 0.02 CPU-s",
    "tests/exporter/test_failure_modes.py::test_export_resumes_when_a_dead_grpc_endpoint_comes_up":
        "waits for an endpoint to come up: 1.5 s, 0.03 CPU-s",
    "tests/launcher/test_top_missing_database.py::test_once_waits_when_asked":
        "waits for a database to appear: 1.6 s, 0.01 CPU-s",
    "tests/reliability/test_downstream_outage.py::test_destination_down_then_up_ingest_continues_and_the_gap_is_reported":
        "waits out a destination's outage: 3 s, 0.15 CPU-s",
    "tests/reliability/test_downstream_outage.py::test_http_destination_down_then_up":
        "waits out a destination's outage: 1.2 s, 0.05 CPU-s",
    "tests/processor/test_runs.py::test_run_without_markers_ends_after_idle_timeout":
        "waits out a 1 s idle timeout: 1.2 s, 0.07 CPU-s",
    "tests/instrumentation/test_resource_sampler.py::test_stop_takes_a_last_sample_so_a_short_run_still_has_its_figures":
        "waits for a sampler's stop: 1.1 s, 0.01 CPU-s",
    "tests/reliability/test_http_front.py":
        "raw sockets that stall, flood and wait out 1 s deadlines against one processor: 35 s, 2.5 CPU-s",
    "tests/reliability/test_http_front_deadlines.py":
        "a byte every 0.2 s against a 1 s chunk deadline, 1 byte against 50,000 at the cap: 14 s, 0.1 CPU-s;"
        " 5 of 5 runs passed beside three processes spinning on both cores",
}


def _matches(nodeid: str, entry: str) -> bool:
    return nodeid == entry or nodeid.startswith(entry + "[") or nodeid.startswith(entry + "::")


def is_serial(nodeid: str) -> bool:
    return any(_matches(nodeid, entry) for entry in SERIAL)


def is_beside_serial(nodeid: str) -> bool:
    return any(_matches(nodeid, entry) for entry in BESIDE_SERIAL)


def holds_the_room(nodeid: str, by_priority: bool) -> bool:
    """Whether a test runs with no other test beside it (but those fit to run beside one)."""
    return is_serial(nodeid) and (not by_priority or any(_matches(nodeid, entry) for entry in WHOLE_MACHINE))


def idle_priority_works() -> bool:
    """Whether this process can run a test at idle priority and the next one at normal priority
    again (`run_at`): Linux, and the right to leave SCHED_IDLE (root, or an RLIMIT_NICE that allows it)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        return True
    except OSError:  # EPERM: not allowed back; EINVAL: no SCHED_IDLE in this kernel
        return False
    finally:
        try:
            os.sched_setscheduler(0, policy, param)
        except OSError:
            pass


def run_at(normal: bool) -> None:
    """This thread, and the processes it starts from now on: normal priority, or idle priority
    (they run on what normal-priority work leaves)."""
    os.sched_setscheduler(0, os.SCHED_OTHER if normal else os.SCHED_IDLE, os.sched_param(0))


SERIAL_BLOCK = "serial tests"
"""The scheduler's one work unit holding every serial test (and the grouped modules holding one)."""


def work_units(collection: list[str], grouped: set[str]) -> dict[str, str]:
    """node id -> its work unit: the serial block for a serial test and for every test of a
    grouped module that holds one, the module for the other grouped modules, else the test."""
    serial_modules = {nodeid.split("::", 1)[0] for nodeid in collection if is_serial(nodeid)}
    units = {}
    for nodeid in collection:
        module = nodeid.split("::", 1)[0]
        if module in grouped:
            units[nodeid] = SERIAL_BLOCK if module in serial_modules else module
        else:
            units[nodeid] = SERIAL_BLOCK if is_serial(nodeid) else nodeid
    return units


def queue_order(units: list[str], seconds: dict[str, float]) -> list[str]:
    """The work units in the order they are handed out: the serial block, then the tests that may
    run beside it (each its own unit unless its module is grouped), then the rest, longest first
    (`seconds`: a unit's expected duration, tests/durations.py), so that what is left for the end
    is short and no worker finishes long before the other."""
    block = [unit for unit in units if unit == SERIAL_BLOCK]
    beside = [unit for unit in units if unit != SERIAL_BLOCK and is_beside_serial(unit)]
    rest = [unit for unit in units if unit != SERIAL_BLOCK and not is_beside_serial(unit)]
    return block + beside + sorted(rest, key=lambda unit: -seconds.get(unit, 0.0))


def next_unit(queue: list[str], room_held: bool) -> str:
    """The unit a worker gets next from the queue (in `queue_order`). While another worker's serial
    block still has a test that holds the room to come, a test that may run beside it, else the
    shortest one: that test waits for the test any other worker has in hand, so it should be short;
    after it, the longest."""
    if room_held and queue[0] != SERIAL_BLOCK and not is_beside_serial(queue[0]):
        return queue[-1]
    return queue[0]


def block_order(nodeids: list[str], grouped: set[str], by_priority: bool) -> list[str]:
    """The serial block's tests in running order: the serial tests of modules without a shared
    fixture first, one after the other, then each grouped
    module whole, as collected (a module's tests stay together, so its fixtures are built once);
    within each part those that hold the room (`holds_the_room`) go first, so the other workers'
    wait for short tests ends early."""
    def unit(nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return module if module in grouped else nodeid

    holding = {unit(nodeid) for nodeid in nodeids if holds_the_room(nodeid, by_priority)}
    return sorted(nodeids, key=lambda nodeid: (unit(nodeid) != nodeid, unit(nodeid) not in holding))


def group_shared_fixtures(items: list[pytest.Item], folder: Path) -> set[str]:
    """Write down the modules whose tests share a module-, class- or package-scoped fixture.

    Such a fixture is one expensive thing (a training run, a receiver, a demo) read by many
    tests; spread over workers, each worker would build it again. pytest-xdist's own
    `xdist_group` marker cannot say so under pytest 9.2, where a node's id no longer comes
    from the `_nodeid` that xdist 3.8 rewrites (the marker is accepted and silently ignored),
    so each worker writes the list into the session's shared temporary root and
    `ModuleGroupScheduling`, on the controller, reads it before it hands out the first test.
    Returns the same list.
    """
    grouped = {item.nodeid.split("::", 1)[0] for item in items if _shares_a_fixture(item)}
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{_GROUPS_PREFIX}{os.getpid()}.tmp"
    partial.write_text("\n".join(sorted(grouped)))
    partial.replace(folder / f"{_GROUPS_PREFIX}{os.getpid()}.txt")
    return grouped


def _shares_a_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d and d[-1].scope in ("module", "class", "package") for d in defs)


_GROUPS_PREFIX = "module-groups-"


def module_group_scheduling(config: pytest.Config, log=None):
    """pytest-xdist's load-by-scope scheduler where a scope is a whole module for the modules
    whose tests share a fixture (as the workers wrote them down) and a single test otherwise,
    so independent heavy tests of one module still run on all workers; the serial tests are one
    block, handed out first (`work_units`, `block_order`), and the rest in `next_unit`'s order."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroupScheduling(LoadScopeScheduling):
        def __init__(self) -> None:
            super().__init__(config, log)
            self._folder = config._tmp_path_factory.getbasetemp()
            self._grouped: set[str] | None = None
            self._units: dict[str, str] = {}
            self._ordered = False
            self._block_node = None
            self._by_priority = idle_priority_works()  # as the workers will find it: same host, same user

        def _split_scope(self, nodeid: str) -> str:
            if self._grouped is None:  # every worker has collected before the first test is handed out
                self._grouped = {line for path in self._folder.glob(f"{_GROUPS_PREFIX}*.txt")
                                 for line in path.read_text().splitlines() if line}
                self._units = work_units(list(self.collection or ()), self._grouped)
            return self._units.get(nodeid, nodeid)

        def _order_queue(self) -> None:
            block = self.workqueue.get(SERIAL_BLOCK)
            if block is not None:
                self.workqueue[SERIAL_BLOCK] = {nodeid: block[nodeid]
                                                for nodeid in block_order(list(block), self._grouped or set(),
                                                                          self._by_priority)}
            durations = load_durations()
            seconds = {unit: unit_seconds(nodeids, durations) for unit, nodeids in self.workqueue.items()}
            for unit in reversed(queue_order(list(self.workqueue), seconds)):
                self.workqueue.move_to_end(unit, last=False)

        def _room_held(self, node) -> bool:
            if self._block_node is None or self._block_node is node:
                return False
            block = self.assigned_work[self._block_node][SERIAL_BLOCK]  # node id -> done
            return any(not done and holds_the_room(nodeid, self._by_priority) for nodeid, done in block.items())

        def _assign_work_unit(self, node) -> None:
            if not self._ordered:  # the first call: the block goes first, in its running order
                self._ordered = True
                self._order_queue()
            unit = next_unit(list(self.workqueue), self._room_held(node))
            if unit == SERIAL_BLOCK:
                self._block_node = node
            self.workqueue.move_to_end(unit, last=False)  # the base class hands out the first unit
            super()._assign_work_unit(node)

    return ModuleGroupScheduling()


def mark_serial(items: list[pytest.Item], root: Path) -> None:
    """Add the `serial` marker to the listed tests; refuse an entry (of either list) that names
    nothing collected."""
    modules = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], getattr(item, "module", None))
        if is_serial(item.nodeid):
            item.add_marker(pytest.mark.serial)
    # Only a module that was collected can be checked; within it the test (or class) must exist
    # even when this run selected other tests of the module.
    stale = [entry for entry in (*SERIAL, *BESIDE_SERIAL, *WHOLE_MACHINE) if not (root / entry.split("::", 1)[0]).is_file()
             or (entry.split("::", 1)[0] in modules and "::" in entry
                 and not hasattr(modules[entry.split("::", 1)[0]], entry.split("::")[1].split("[", 1)[0]))]
    stale += [entry for entry in BESIDE_SERIAL if is_serial(entry)]  # one or the other
    stale += [entry for entry in WHOLE_MACHINE if not is_serial(entry)]  # a kind of serial test
    if stale:
        raise pytest.UsageError(f"tests/serial_tests.py names tests that do not exist: {stale}")


class SerialLock:
    """The shared/exclusive lock of one xdist session, and whether a test runs at normal
    priority (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.by_priority = idle_priority_works()
        folder.mkdir(parents=True, exist_ok=True)
        self._turnstile = open(folder / "serial-turnstile.lock", "a+b")
        self._room = open(folder / "serial-room.lock", "a+b")
        self._kept = False  # still held exclusively for the next serial test
        self._block_done = folder / "serial-block-done"  # written by the worker that ran the block
        self._block: set[str] = set()
        self._block_left = 0

    def know_block(self, collection: list[str], grouped: set[str]) -> None:
        """The serial block's tests, from this worker's collection (`work_units`): the worker that
        runs them counts them down and says when the last is done."""
        units = work_units(collection, grouped)
        self._block = {nodeid for nodeid, unit in units.items() if unit == SERIAL_BLOCK}
        self._block_left = len(self._block)
        if not self._block:
            self._block_done.touch()

    def at_normal_priority(self, nodeid: str) -> bool:
        """A test of the serial block: yes; any other: once the block is done."""
        return nodeid in self._block or self._block_done.exists()

    def finished(self, nodeid: str) -> None:
        if nodeid in self._block:
            self._block_left -= 1
            if self._block_left == 0:
                self._block_done.touch()

    def enter(self, exclusive: bool) -> None:
        if self._kept:
            if exclusive:
                return
            self._release(exclusive=True)  # the serial test it was kept for did not come
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        if exclusive:
            fcntl.flock(self._room, fcntl.LOCK_EX)  # the turnstile stays closed until leave()
        else:
            fcntl.flock(self._room, fcntl.LOCK_SH)
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)

    def leave(self, exclusive: bool, next_exclusive: bool = False) -> None:
        """Release, unless a serial test is followed by another on this worker: then the room
        stays closed for it, so the other workers do not slip a test in between."""
        if exclusive and next_exclusive:
            self._kept = True
            return
        self._release(exclusive)

    def _release(self, exclusive: bool) -> None:
        self._kept = False
        fcntl.flock(self._room, fcntl.LOCK_UN)
        if exclusive:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
