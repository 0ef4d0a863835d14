"""Bursts of SIGTERM / SIGINT stop the processor and its ingest workers; they never hang.

An ingest worker that set its stop event from the SIGTERM handler hung for good about
one kill -9 of the processor in five: the parent-death SIGTERM came more than once,
and the handler, interrupting its own earlier call (or the main thread's
`Event.wait`), waited for a lock its own thread held. `SignalStop` only notes the signal.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from harness import ProcessorProcess, wait_until
from traceml.processor.signal_stop import SignalStop

_WAITER = """
import signal, sys, threading
from traceml.processor.signal_stop import SignalStop
stop = SignalStop().install(signal.SIGTERM, signal.SIGINT)
also = threading.Event()
print("ready", flush=True)
signum = stop.wait(also=also, poll_s=0.01)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the rest of the burst must not end the test's child
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("stopped", signum, flush=True)
sys.stdin.read()
"""


def _burst(pid: int, count: int) -> None:
    for i in range(count):
        try:
            psutil.Process(pid).send_signal(signal.SIGTERM if i % 2 else signal.SIGINT)
        except psutil.NoSuchProcess:
            return


def test_a_burst_of_signals_is_noted_once_and_the_waiter_returns():
    for _ in range(5):
        child = subprocess.Popen([sys.executable, "-c", _WAITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        assert child.stdout.readline().strip() == "ready"
        _burst(child.pid, 300)
        out, _ = child.communicate("", timeout=20)  # hangs (and times out) if the waiter never returned
        assert child.returncode == 0
        assert out.strip() in (f"stopped {int(signal.SIGINT)}", f"stopped {int(signal.SIGTERM)}")


def test_the_waiter_returns_when_the_other_event_is_set_without_a_signal():
    also = threading.Event()
    threading.Timer(0.05, also.set).start()
    started = time.monotonic()
    assert SignalStop().wait(also=also, poll_s=0.01) is None
    assert time.monotonic() - started < 5


@pytest.mark.slow
def test_ingest_workers_stop_under_a_burst_of_sigterm(tmp_path):
    proc = ProcessorProcess(tmp_path, extra_args=["--workers", "2"]).start()
    workers: list = []
    try:
        workers = [c for c in psutil.Process(proc.proc.pid).children(recursive=True)
                   if "spawn_main" in " ".join(c.cmdline())]
        assert workers
        for worker in workers:
            _burst(worker.pid, 200)

        def all_gone() -> bool:
            return not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
        assert wait_until(all_gone, 20), [w.pid for w in workers if w.is_running()]
    finally:
        proc.kill9()
        for worker in workers:
            try:
                worker.kill()
            except psutil.NoSuchProcess:
                pass
