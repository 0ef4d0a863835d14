"""Ingest worker processes: more cores for decode and normalisation, one port.

Python holds one core per process, and decoding plus normalising a step span
costs about 50 us of CPU, so one process tops out below 20,000 spans/s. With
`--workers N` the main process binds its receivers with SO_REUSEPORT and starts
N - 1 spawned workers that bind the same ports; the kernel spreads connections
over them. A worker only receives, decodes and commits (its own `IngestQueue`
and `StepTimeStore` on the same WAL database; SQLite serialises the short
commits). The main process keeps everything else: the run monitor learns about
worker commits by polling the store, and self-metric counters live in shared
memory. Caps on runs and ranks apply per process.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import replace

from .signal_stop import SignalStop

LOG = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send `sig` to this process when its parent dies; False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int, done: threading.Event, interval_s: float = 1.0) -> threading.Thread:
    """End the worker once its parent is gone (re-parented), e.g. after kill -9 of the main process."""
    def loop():
        while not done.is_set():
            if os.getppid() != parent_pid:
                LOG.warning("main processor %d is gone; ingest worker stopping", parent_pid)
                done.set()
                return
            time.sleep(interval_s)

    thread = threading.Thread(target=loop, name="traceml-parent-watch", daemon=True)
    thread.start()
    return thread


def _worker_main(config, grpc_addr, http_addr, shared_counts, ready, stop, index: int,
                 parent_pid: int | None = None, death_signal: bool = False) -> None:
    """Entry point of one spawned worker (a module-level function so spawn can import it).

    A worker must not outlive the main process (it would keep the shared ports and
    the database open with nobody to stop it): on Linux the kernel sends SIGTERM
    when the parent dies (PR_SET_PDEATHSIG), and a thread polling the parent pid
    covers other systems and the race where the parent died before prctl ran.
    """
    # The parent watch and a relay of the shared multiprocessing `stop` set `done` (from
    # their own threads); SIGTERM is only noted (`SignalStop`: a handler that set `done`
    # could interrupt this thread inside `done.wait()` or inside its own earlier call,
    # holding `done`'s lock, and wait for itself forever). This process waits for either.
    done = threading.Event()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when workers stop
    terminated = SignalStop().install(signal.SIGTERM)
    threading.Thread(target=lambda: (stop.wait(), done.set()), name="traceml-worker-stop",
                     daemon=True).start()
    if death_signal:
        _set_parent_death_signal(signal.SIGTERM)
    if parent_pid is not None:
        _watch_parent(parent_pid, done)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s worker-{index} %(levelname)s %(name)s: %(message)s")
    from traceml.processor.decode import Decoder
    from traceml.processor.otlp_intake import OtlpIntake
    from traceml.processor.ingest import IngestQueue
    from traceml.processor.receiver_grpc import GrpcReceiver
    from traceml.processor.receiver_http import HttpReceiver
    from traceml.processor.self_telemetry import SelfTelemetry
    from traceml.processor.sqlite_writer import StepTimeStore

    store = StepTimeStore(config.db)
    stats = SelfTelemetry(shared=shared_counts)
    ingest = IngestQueue(store, stats=stats, max_pending_records=config.max_pending_records)
    decoder = Decoder(config.limits)
    decoder.spans.mappings = config.mapping_set()
    handler = OtlpIntake(decoder, ingest, stats)
    ingest.start()
    receivers = []
    try:
        if grpc_addr is not None:
            receivers.append(GrpcReceiver(handler, *grpc_addr, auth=config.auth, tls=config.tls,
                                          workers=config.grpc_workers,
                                          max_concurrent_requests=config.max_concurrent_requests, reuse_port=True))
        if http_addr is not None:
            receivers.append(HttpReceiver(handler, *http_addr, auth=config.auth, tls=config.tls,
                                          reuse_port=True, max_concurrent_requests=config.max_concurrent_requests,
                                          limits=config.http_limits))
        for receiver in receivers:
            receiver.start()
    except Exception:
        LOG.exception("ingest worker %d could not start", index)
        stop.set()
    ready.set()
    terminated.wait(also=done)
    for receiver in receivers:
        receiver.stop() if isinstance(receiver, HttpReceiver) else receiver.stop(grace_s=2.0)
    ingest.stop()
    store.close()


class WorkerPool:
    """The N - 1 extra ingest processes of `--workers N`."""

    def __init__(self, config, count: int):
        self._ctx = multiprocessing.get_context("spawn")
        self.shared_counts = None
        self._count = count
        self._config = replace(config, workers=1)
        self._stop = self._ctx.Event()
        self._procs: list = []
        self._ready: list = []

    def make_shared_counts(self, size: int):
        self.shared_counts = self._ctx.Array("q", size)
        return self.shared_counts

    def start(self, grpc_addr, http_addr, timeout_s: float = 60.0) -> None:
        # PR_SET_PDEATHSIG fires when the creating *thread* exits, so it is used only
        # when the main thread starts the pool; the parent-pid watch works either way.
        death_signal = threading.current_thread() is threading.main_thread()
        for index in range(self._count):
            ready = self._ctx.Event()
            proc = self._ctx.Process(
                target=_worker_main, name=f"traceml-ingest-worker-{index + 1}", daemon=True,
                args=(self._config, grpc_addr, http_addr, self.shared_counts, ready,
                      self._stop, index + 1, os.getpid(), death_signal))
            proc.start()
            self._procs.append(proc)
            self._ready.append(ready)
        for index, ready in enumerate(self._ready):
            if not ready.wait(timeout_s):
                raise RuntimeError(f"ingest worker {index + 1} did not start within {timeout_s} s")

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs) and not self._stop.is_set()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        for proc in self._procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


def watch_workers(pool: WorkerPool, on_dead, interval_s: float = 1.0) -> threading.Thread:
    """Log once if a worker dies (the others and the main process keep serving)."""
    def loop():
        import time

        while pool.alive():
            time.sleep(interval_s)
        if not pool._stop.is_set():
            on_dead()

    thread = threading.Thread(target=loop, name="traceml-worker-watch", daemon=True)
    thread.start()
    return thread
