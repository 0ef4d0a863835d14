"""The suite's own parallel plumbing: free ports per pytest-xdist worker, and the lock that keeps
the serial tests alone (tests/serial_tests.py)."""
from __future__ import annotations

import threading

import harness.ports as ports
from tests.serial_tests import SerialLock


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
