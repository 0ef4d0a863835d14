"""Background readers of the two queues: resolve, sum and hand records to the sinks.

`StepTimeSampler` keeps a FIFO of published batches. A batch resolves when every
CUDA end event reports `query() == True`; an unresolved earlier batch holds back the
later ones, so records leave in step order. Repeated events of one raw name are
summed within a batch with CPU and GPU kept separate; two batches that carry the
same step number are delivered separately, never merged. Nothing here synchronises
the device: only `query()` and, once it is True, `elapsed_time()`.

`StepMemorySampler` forwards memory snapshots unchanged.

Both are daemon threads polling every `interval_s`; both keep draining after
recording stops; `stop()` drains what is left (unresolved CUDA batches get up to the
timeout, then go out with `gpu_ms=None`).
"""
from __future__ import annotations

import logging
import threading
import time

from . import step_events as _se
from .records import EventTotals, PhaseInterval, ResolvedStepTime, StepMemorySnapshot

_log = logging.getLogger("traceml")

# --- Sink registry ----------------------------------------------------------------

_sinks: tuple = ()
_sink_lock = threading.Lock()


def register_sink(sink) -> None:
    """Add a `TelemetrySink` (e.g. the OTLP exporter); records reach it on sampler threads."""
    global _sinks
    with _sink_lock:
        if not any(s is sink for s in _sinks):
            _sinks = _sinks + (sink,)


def unregister_sink(sink) -> None:
    global _sinks
    with _sink_lock:
        _sinks = tuple(s for s in _sinks if s is not sink)


def registered_sinks() -> tuple:
    return _sinks


_failed_sinks: set = set()


def _deliver(method: str, record, sinks) -> None:
    for sink in sinks:
        try:
            getattr(sink, method)(record)
        except Exception:  # a broken sink must never stop the sampler
            key = (id(sink), method)
            if key not in _failed_sinks:
                _failed_sinks.add(key)
                _log.exception("TraceML sink %r failed in %s; later failures are not logged",
                               sink, method)


# --- Resolution ---------------------------------------------------------------------


def batch_resolved(batch) -> bool:
    """True when every CUDA end event of the batch has completed (query only)."""
    for event in batch.events:
        end = event[_se.EV_GPU_END]
        if end is not None:
            try:
                if not end.query():
                    return False
            except Exception:  # an event that cannot be queried is treated as unavailable
                continue
    return True


def _gpu_ms(event) -> float | None:
    start, end = event[_se.EV_GPU_START], event[_se.EV_GPU_END]
    if start is None or end is None:
        return None
    try:
        return float(start.elapsed_time(end))
    except Exception:
        return None


def resolve_batch(batch, wall_offset_ns: int, *, gpu_available: bool = True,
                  pool=None) -> ResolvedStepTime:
    """Sum a batch per raw event (CPU and GPU separate) and build its typed record.

    A raw event gets `gpu_ms` only when every occurrence has a resolved GPU time;
    otherwise None (unavailable, never 0). With `gpu_available=False` (shutdown
    timeout) all GPU times are None. CUDA events go back to `pool` afterwards.
    """
    sums: dict[str, list] = {}
    phases = []
    first = last = None
    for event in batch.events:
        name, t0, t1 = event[0], event[1], event[2]
        gpu = _gpu_ms(event) if gpu_available else None
        acc = sums.get(name)
        if acc is None:
            acc = sums[name] = [0, 0.0, 0, True]
        acc[0] += t1 - t0
        acc[2] += 1
        if gpu is None:
            acc[3] = False
        else:
            acc[1] += gpu
        phases.append(PhaseInterval(name, t0 + wall_offset_ns, t1 + wall_offset_ns))
        if first is None or t0 < first:
            first = t0
        if last is None or t1 > last:
            last = t1
        if pool is not None:
            for obj in (event[3], event[4]):
                if obj is not None:
                    pool.release(obj)
    events = {
        name: EventTotals(cpu_ms=acc[0] / 1e6, gpu_ms=acc[1] if acc[3] else None, count=acc[2])
        for name, acc in sums.items()
    }
    phases.sort(key=lambda p: p.start_time_ns)
    return ResolvedStepTime(step=batch.step, start_time_ns=first + wall_offset_ns,
                            end_time_ns=last + wall_offset_ns, events=events,
                            phases=tuple(phases))


class _Sampler:
    """A daemon polling thread with a synchronous `run_once()` for tests and shutdown."""

    name = "traceml-sampler"

    def __init__(self, sinks=None, interval_s: float = 0.1) -> None:
        self._sinks = sinks
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.delivered = 0

    def sinks(self) -> tuple:
        return self._sinks if self._sinks is not None else _sinks

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception:
                _log.exception("TraceML %s tick failed", self.name)

    def run_once(self) -> int:
        raise NotImplementedError

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop polling, then drain everything still queued (bounded by `timeout_s`)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        self._thread = None
        self._final_drain(timeout_s)

    def _final_drain(self, timeout_s: float) -> None:
        self.run_once()


class StepTimeSampler(_Sampler):
    """Drains timing batches, resolves CUDA events in FIFO order, delivers ResolvedStepTime."""

    name = "traceml-step-time-sampler"

    def __init__(self, sinks=None, interval_s: float = 0.1, pool=None, drain=None) -> None:
        super().__init__(sinks, interval_s)
        self._pool = pool
        self._drain = drain or (lambda: _se.drain_step_time_batches())
        self.pending: list = []
        self._offset_ns = _se.wall_offset_ns()

    def run_once(self, *, force: bool = False) -> int:
        """Deliver every batch that is resolved, stopping at the first unresolved one.

        `force=True` delivers unresolved batches too, with GPU times unavailable.
        """
        with self._lock:
            self.pending.extend(self._drain())
            self._offset_ns = _se.wall_offset_ns()  # follows wall-clock adjustments
            done = 0
            pending = self.pending
            sinks = self.sinks()
            pool = self._pool
            if pool is None:
                from . import timing

                pool = timing.event_pool()
            while pending:
                batch = pending[0]
                ready = batch_resolved(batch)
                if not ready and not force:
                    break
                pending.pop(0)
                record = resolve_batch(batch, self._offset_ns, gpu_available=ready, pool=pool)
                _deliver("on_step_time", record, sinks)
                done += 1
            self.delivered += done
            return done

    def _final_drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self.run_once()
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.01)
            self.run_once()
        if self.pending:
            self.run_once(force=True)


class StepMemorySampler(_Sampler):
    """Drains memory snapshots and delivers them unchanged."""

    name = "traceml-step-memory-sampler"

    def __init__(self, sinks=None, interval_s: float = 0.1, drain=None) -> None:
        super().__init__(sinks, interval_s)
        self._drain = drain or (lambda: _se.drain_step_memory_events())

    def run_once(self) -> int:
        with self._lock:
            records: list[StepMemorySnapshot] = self._drain()
            sinks = self.sinks()
            for record in records:
                _deliver("on_step_memory", record, sinks)
            self.delivered += len(records)
            return len(records)
