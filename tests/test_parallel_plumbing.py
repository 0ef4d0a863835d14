"""The suite's own parallel plumbing: free ports per pytest-xdist worker, the lock that keeps
the serial tests alone, and the scheduler that keeps a shared fixture's module on one worker
(tests/serial_tests.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import harness.ports as ports
from tests.durations import UNKNOWN_SECONDS, load_durations, store_durations, unit_seconds
from tests.serial_tests import (BESIDE_SERIAL, SERIAL_BLOCK, WHOLE_MACHINE, SerialLock, block_order, holds_the_room,
                                idle_priority_works, next_unit, queue_order, run_at, work_units)

ROOT = Path(__file__).resolve().parents[1]


def _ports_of(monkeypatch, worker: str, n: int) -> list[int]:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setattr(ports, "_walk", None)  # as in a fresh worker process
    return [ports.free_port() for _ in range(n)]


def test_free_ports_are_below_the_kernels_range_never_repeated_and_apart_per_worker(monkeypatch):
    low = ports._ephemeral_low()
    by_worker = {worker: _ports_of(monkeypatch, worker, 40) for worker in ("", "gw0", "gw1", "gw7")}
    slot = {}
    for worker, got in by_worker.items():
        assert len(set(got)) == len(got), worker
        assert all(ports._FIRST <= port < low for port in got), (worker, got)
        slots = {(port - ports._FIRST) // ports._SLICE for port in got}
        assert len(slots) == 1, (worker, got)  # one slice per process
        slot[worker] = slots.pop()
    assert len(set(slot.values())) == len(slot), slot  # no two workers share a slice


def _enter_in_thread(lock: SerialLock, exclusive: bool) -> threading.Event:
    entered = threading.Event()

    def enter():
        lock.enter(exclusive)
        entered.set()

    threading.Thread(target=enter, daemon=True).start()
    return entered


@pytest.mark.slow
def test_a_serial_test_waits_for_the_others_and_new_ones_wait_for_it(tmp_path):
    # Three workers' locks on one run's folder (flock: separate open files exclude each other).
    running, serial, later = SerialLock(tmp_path), SerialLock(tmp_path), SerialLock(tmp_path)
    running.enter(exclusive=False)
    serial_in = _enter_in_thread(serial, exclusive=True)
    assert not serial_in.wait(0.3)  # a shared holder is still in the room
    later_in = _enter_in_thread(later, exclusive=False)
    assert not later_in.wait(0.3)  # the turnstile: no new shared holder overtakes the waiting serial test
    running.leave(exclusive=False)
    assert serial_in.wait(30)
    assert not later_in.wait(0.3)  # nothing beside the serial test
    serial.leave(exclusive=True)
    assert later_in.wait(30)
    later.leave(exclusive=False)


@pytest.mark.slow
def test_a_serial_test_followed_by_another_keeps_the_room_for_it(tmp_path):
    serial, other = SerialLock(tmp_path), SerialLock(tmp_path)
    serial.enter(exclusive=True)
    serial.leave(exclusive=True, next_exclusive=True)  # the next test on this worker is serial too
    other_in = _enter_in_thread(other, exclusive=False)
    assert not other_in.wait(0.3)  # nothing slips in between the two serial tests
    serial.enter(exclusive=True)  # the kept room: no wait
    assert not other_in.wait(0.3)
    serial.leave(exclusive=True)  # the last of the run
    assert other_in.wait(30)
    other.leave(exclusive=False)
    serial.enter(exclusive=True)  # and it can be taken again
    serial.leave(exclusive=True, next_exclusive=True)
    serial.enter(exclusive=False)  # the serial test it was kept for did not come: released, then shared
    serial.leave(exclusive=False)
    assert _enter_in_thread(other, exclusive=True).wait(30)
    other.leave(exclusive=True)


def test_the_serial_tests_are_one_work_unit_alone_ones_first_and_grouped_modules_whole():
    demo = "tests/launcher/test_demo_and_surfaces.py"
    alone_serial = "tests/launcher/test_collective_diagnosis.py::test_a_balanced_ddp_run_names_no_rank"
    alone_other = ("tests/launcher/test_collective_diagnosis.py::"
                   "test_a_rank_slowed_inside_backward_is_named_with_backward_grown")
    shared = "tests/processor/test_prometheus_exposition.py"
    collection = [f"{demo}::test_demo_diagnosis_names_the_injected_problem_and_rank[balanced]",
                  f"{demo}::test_top_reads_a_processor_database", alone_other, alone_serial,
                  f"{shared}::test_a", f"{shared}::test_b", "tests/schema/test_x.py::test_y"]
    units = work_units(collection, grouped={demo, shared})
    assert units == {collection[0]: SERIAL_BLOCK, collection[1]: SERIAL_BLOCK,  # a grouped module with a serial test
                     alone_other: alone_other, alone_serial: SERIAL_BLOCK,
                     collection[4]: shared, collection[5]: shared,
                     "tests/schema/test_x.py::test_y": "tests/schema/test_x.py::test_y"}
    block = [nodeid for nodeid in collection if units[nodeid] == SERIAL_BLOCK]
    assert block_order(block, grouped={demo, shared}, by_priority=False) == [alone_serial, collection[0], collection[1]]


def test_where_priorities_keep_the_room_the_block_starts_with_the_tests_that_still_hold_it():
    demo = "tests/launcher/test_demo_and_surfaces.py"
    alone_serial = "tests/launcher/test_collective_hf.py::test_the_fast_rank_waits_in_hugging_faces_token_count_gather"
    whole = next(entry for entry in WHOLE_MACHINE if "::" in entry)
    block = [f"{demo}::test_demo_diagnosis_names_the_injected_problem_and_rank[input-straggler]",
             f"{demo}::test_top_reads_a_processor_database", alone_serial, whole]
    assert [holds_the_room(nodeid, by_priority=True) for nodeid in block] == [False, False, False, True]
    assert [holds_the_room(nodeid, by_priority=False) for nodeid in block] == [True, False, True, True]
    assert block_order(block, grouped={demo}, by_priority=True) == [whole, alone_serial, *block[:2]]
    assert block_order(block, grouped={demo}, by_priority=False) == [alone_serial, whole, *block[:2]]


def test_the_serial_blocks_tests_run_at_normal_priority_and_the_others_once_the_block_is_done(tmp_path):
    demo = "tests/launcher/test_demo_and_surfaces.py"
    serial = "tests/launcher/test_collective_diagnosis.py::test_a_balanced_ddp_run_names_no_rank"
    collection = [f"{demo}::test_demo_diagnosis_names_the_injected_problem_and_rank[balanced]",
                  f"{demo}::test_top_reads_a_processor_database", serial, "tests/schema/test_x.py::test_y"]
    block_worker, other = SerialLock(tmp_path), SerialLock(tmp_path)  # two workers of one run
    for lock in (block_worker, other):
        lock.know_block(collection, grouped={demo})
    assert [block_worker.at_normal_priority(nodeid) for nodeid in collection] == [True, True, True, False]
    for nodeid in collection[:3]:
        assert not other.at_normal_priority(collection[3])
        block_worker.finished(nodeid)  # the block's last test done: every test at normal priority again
    assert other.at_normal_priority(collection[3]) and block_worker.at_normal_priority(collection[3])
    nothing_serial = SerialLock(tmp_path / "other-run")
    nothing_serial.know_block(collection[3:], grouped=set())
    assert nothing_serial.at_normal_priority(collection[3])


@pytest.mark.skipif(not idle_priority_works(), reason="this host does not let a process leave SCHED_IDLE again")
def test_a_test_at_idle_priority_starts_its_processes_at_idle_priority_and_a_serial_one_at_normal():
    def child_policy() -> int:
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            return os.sched_getscheduler(child.pid)
        finally:
            child.communicate(b"")

    before = os.sched_getscheduler(0)
    try:
        run_at(normal=False)
        assert child_policy() == os.SCHED_IDLE
        run_at(normal=True)
        assert child_policy() == os.SCHED_OTHER
    finally:
        os.sched_setscheduler(0, before, os.sched_param(0))


def test_the_tests_fit_to_run_beside_the_serial_block_come_right_after_it_and_the_rest_longest_first():
    beside = next(iter(BESIDE_SERIAL))
    units = ["tests/a.py::test_x", f"{beside}[p]", "tests/processor/test_prometheus_exposition.py", SERIAL_BLOCK,
             "tests/b.py::test_y", "tests/c.py::test_z"]
    seconds = {"tests/a.py::test_x": 3.0, "tests/processor/test_prometheus_exposition.py": 40.0,
               "tests/b.py::test_y": 3.0, "tests/c.py::test_z": 0.1, SERIAL_BLOCK: 100.0}
    assert queue_order(units, seconds) == [SERIAL_BLOCK, f"{beside}[p]", "tests/processor/test_prometheus_exposition.py",
                                           "tests/a.py::test_x", "tests/b.py::test_y", "tests/c.py::test_z"]


def test_beside_a_running_serial_block_a_worker_gets_the_shortest_unit_and_after_it_the_longest():
    beside = f"{next(iter(BESIDE_SERIAL))}[p]"
    queue = [SERIAL_BLOCK, beside, "tests/long.py", "tests/short.py::test_z"]
    assert next_unit(queue, room_held=False) == SERIAL_BLOCK
    assert next_unit(queue[1:], room_held=True) == beside  # no lock: it runs while the block holds the room
    # A serial test waits for what the other workers have in hand: the shortest keeps it waiting least.
    assert next_unit(queue[2:], room_held=True) == "tests/short.py::test_z"
    assert next_unit(queue[2:], room_held=False) == "tests/long.py"


def test_durations_are_stored_per_test_and_kept_for_tests_that_did_not_run(tmp_path):
    path = tmp_path / "durations.json"
    store_durations({"tests/a.py::test_x": 2.04, "tests/gone.py::test_y": 1.0}, lambda nodeid: True, path)
    store_durations({"tests/a.py::test_w": 0.01}, lambda nodeid: "gone" not in nodeid, path)
    durations = load_durations(path)
    assert durations == {"tests/a.py::test_x": 2.0, "tests/a.py::test_w": 0.0}
    assert unit_seconds(["tests/a.py::test_x", "tests/a.py::test_new"], durations) == 2.0 + UNKNOWN_SECONDS
    path.write_text("not json")
    assert load_durations(path) == {}  # a damaged file orders nothing; it breaks nothing either


def _workers_by_module(*paths: str) -> dict[str, set[str]]:
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadscope", "-v",
                          "-p", "no:cacheprovider", *paths], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    workers: dict[str, set[str]] = {}
    for worker, module in re.findall(r"^\[(gw\d)\] .*?PASSED (tests/[^:]+)::", out.stdout, re.M):
        workers.setdefault(module, set()).add(worker)
    return workers


@pytest.mark.slow
def test_under_two_workers_a_module_that_shares_a_fixture_runs_on_one_and_the_others_spread():
    # pytest-xdist's own xdist_group is ignored under pytest 9.2; tests/serial_tests.py's
    # scheduler must still keep a shared fixture's module on one worker (else each worker builds
    # the shared thing again) while a module of independent tests goes to both.
    shared, spread = "tests/processor/test_prometheus_exposition.py", "tests/schema/test_otlp_headers.py"
    assert len(_workers_by_module(shared)[shared]) == 1
    assert _workers_by_module(spread)[spread] == {"gw0", "gw1"}
