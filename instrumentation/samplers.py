"""Background readers of the two queues: resolve, sum and hand records to the sinks.

`StepTimeSampler` keeps a FIFO of published batches. A batch resolves when every
CUDA end event reports `query() == True`; an unresolved earlier batch holds back the
later ones, so records leave in step order. Repeated events of one raw name are
summed within a batch with CPU and GPU kept separate, after dropping occurrences
nested in another occurrence of the same name (the outermost one wins, as the
contract says; the training thread does not track nesting); two batches that carry the
same step number are delivered separately, never merged. Nothing here synchronises
the device: only `query()` and, once it is True, `elapsed_time()`.

`StepMemorySampler` forwards memory snapshots unchanged.

Both are daemon threads woken by work, not by a clock. While steps arrive a sampler
drains every `interval_s` (0.5 s by default, the bound on how long a published step
waits), or earlier when its queue fills to a quarter of its capacity (the queue calls
the sampler's wake-up once as it crosses that mark), so on fast steps it wakes about
twice a second whatever the step rate. When a drain finds nothing (the job is between
slow steps, evaluating, or done) the sampler parks: it sleeps with no timeout, and the
next step published wakes it at once (`step_events.wake_on_next`). The training thread
pays for that no more than before: the queue's one size comparison, and one
`Event.set` for the first step after a park. A timing sampler holding unresolved CUDA
batches does not park: only `query()` can tell when they complete, so it polls at its
interval until they do. Each wake-up costs the process tens of microseconds and takes
the GIL from the training thread; a parked sampler costs nothing. The timing sampler
announces a resumed job (its first drain after a park) to `on_steps_resumed`
listeners, so the resource sampler can idle while nothing trains. Both keep draining
after recording stops; `stop()` drains what is left (unresolved CUDA batches get up
to the timeout, then go out with `gpu_ms=None`).
"""
from __future__ import annotations

import logging
import threading
import time
from functools import partial
from operator import is_, itemgetter

from traceml.schema.vocabulary import RAW_DATALOADER_NEXT

from . import sharding as _sharding
from . import step_events as _se
from . import timing as _timing
from .records import EventTotals, PhaseInterval, ResolvedStepTime, StepMemorySnapshot
from .step_boundary import INFERRED_STEP, before_forward_wait, resolve_inferred

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
    """Hand one record to every sink (see `_deliver_all`)."""
    _deliver_all(method, (record,), sinks)


def _deliver_all(method: str, records, sinks) -> None:
    """Hand `records`, in order, to every sink's `method`.

    A sink that raises loses only that record, is logged once per method, and never
    stops the sampler or the other sinks. The method is looked up once per sink and
    drain, not once per record: the samplers hold the GIL while they work.
    """
    for sink in sinks:
        try:
            handler = getattr(sink, method)
        except Exception:
            _sink_failed(sink, method)
            continue
        for record in records:
            try:
                handler(record)
            except Exception:  # a broken sink must never stop the sampler
                _sink_failed(sink, method)


def _sink_failed(sink, method: str) -> None:
    key = (id(sink), method)
    if key not in _failed_sinks:
        _failed_sinks.add(key)
        _log.exception("TraceML sink %r failed in %s; later failures are not logged", sink, method)


# --- Resolution ---------------------------------------------------------------------


def batch_resolved(batch) -> bool:
    """True when every CUDA end event of the batch has completed (query only)."""
    events = batch.events
    if all(map(_is_none, map(_gpu_end, events))):  # a CPU step: nothing to query (stops at a GPU event)
        return True
    for event in events:
        end = event[_se.EV_GPU_END]
        if end is not None:
            try:
                if not end.query():
                    return False
            except Exception:  # an event that cannot be queried is treated as unavailable
                continue
    return True


def outermost_events(events: list, pool=None) -> list:
    """The events of one batch that count, ordered by start: the outermost of each name.

    The training thread records every region it closes; an occurrence that starts
    inside a counted occurrence of the same raw event (a manual wrapper inside an
    automatic patch, a re-entrant call) is dropped here, and its CUDA events go back
    to `pool`. Regions of one name on one thread either nest or follow each other.
    """
    ordered = sorted(events, key=_by_start)
    ends: dict = {}  # raw event -> (index in kept, start, end) of its last counted occurrence
    kept: list = []
    for event in ordered:
        name = event[0]
        last = ends.get(name)
        if last is not None and event[1] < last[2]:
            index, start, end = last
            if event[1] == start and event[2] > end:
                # Same start stamp, later end: this one encloses the counted one.
                _release(kept[index], pool)
                kept[index] = event
                ends[name] = (index, start, event[2])
            else:
                _release(event, pool)
            continue
        ends[name] = (len(kept), event[1], event[2])
        kept.append(event)
    return kept


def _release(event: tuple, pool) -> None:
    if pool is not None:
        for gpu_event in event[3:]:
            if gpu_event is not None:
                pool.release(gpu_event)


def resolve_batch(batch, wall_offset_ns: int, *, gpu_available: bool = True,
                  pool=None) -> ResolvedStepTime:
    """Sum a batch per raw event (CPU and GPU separate) and build its typed record.

    Only the outermost occurrences count (`outermost_events`). A raw event gets
    `gpu_ms` only when every occurrence has a resolved GPU time; otherwise None
    (unavailable, never 0). With `gpu_available=False` (shutdown timeout) all GPU
    times are None. CUDA events go back to `pool` afterwards.
    """
    events = batch.events
    new_tuple = tuple.__new__  # EventTotals/PhaseInterval(...) without their Python __new__ frame
    # The samplers hold the GIL while they work, so in a Python-bound job this is
    # training time: the common case (each raw event once, so nothing nests, and its
    # totals are the occurrence itself) is one loop, no comprehension (each is a frame),
    # with the GPU times filled in afterwards (resolving them returns events to the pool).
    ordered = sorted(events, key=_by_start)
    totals = {}
    phases = []
    add_phase = phases.append
    gpu = False
    end = 0  # the latest end stamp, found in the same loop (no max() over a map)
    for name, t0, t1, g0, _ in ordered:
        totals[name] = new_tuple(EventTotals, ((t1 - t0) / 1e6, None, 1))
        add_phase(new_tuple(PhaseInterval, (name, t0 + wall_offset_ns, t1 + wall_offset_ns)))
        if t1 > end:
            end = t1
        if g0 is not None:
            gpu = True
    # A step inferred from an optimizer update with no DataLoader `next()` in it: its input wait
    # is the time before forward, read from its stamps before its CUDA events go back.
    before = (before_forward_wait(ordered, gpu_available)
              if INFERRED_STEP in totals and RAW_DATALOADER_NEXT not in totals else None)
    if len(totals) == len(ordered):
        phases = tuple(phases)
        if gpu:
            for event in ordered:
                if event[_se.EV_GPU_START] is not None:
                    name = event[0]
                    totals[name] = new_tuple(EventTotals, (totals[name][0], _gpu_ms(event, gpu_available, pool), 1))
    else:  # a raw event more than once: nesting to drop, occurrences to sum
        ordered = outermost_events(events, pool)
        end = max(map(_end, ordered))
        totals = _sum_occurrences(ordered, gpu_available, pool)
        phases = tuple([new_tuple(PhaseInterval, (e[0], e[1] + wall_offset_ns, e[2] + wall_offset_ns))
                        for e in ordered])
    if before is not None:
        totals[RAW_DATALOADER_NEXT] = before
    if INFERRED_STEP in totals:  # a step inferred from an optimizer update (step_boundary)
        phases = resolve_inferred(totals, phases)
    return new_tuple(ResolvedStepTime, (batch.step, ordered[0][1] + wall_offset_ns, end + wall_offset_ns,
                                        totals, phases, batch.parent, _sharding.detected))


def _gpu_ms(event: tuple, gpu_available: bool, pool) -> float | None:
    """One occurrence's GPU time in ms (None when unavailable); its events go back to `pool`."""
    g0, g1 = event[_se.EV_GPU_START], event[_se.EV_GPU_END]
    gpu = None
    if g0 is not None and g1 is not None and gpu_available:
        try:
            gpu = float(g0.elapsed_time(g1))
        except Exception:
            gpu = None
    _release(event, pool)
    return gpu


def _sum_occurrences(ordered: list, gpu_available: bool, pool) -> dict:
    """Per raw event, the sum over its occurrences (CPU exact in ns; GPU None if any is missing)."""
    sums: dict[str, list] = {}
    for event in ordered:
        name, t0, t1 = event[0], event[1], event[2]
        acc = sums.get(name)
        if acc is None:
            acc = sums[name] = [0, 0.0, 0, True]
        acc[0] += t1 - t0
        acc[2] += 1
        gpu = _gpu_ms(event, gpu_available, pool)
        if gpu is None:
            acc[3] = False
        else:
            acc[1] += gpu
    new_tuple = tuple.__new__
    return {name: new_tuple(EventTotals, (acc[0] / 1e6, acc[1] if acc[3] else None, acc[2]))
            for name, acc in sums.items()}


_by_start = itemgetter(_se.EV_CPU_START)
_end = itemgetter(_se.EV_CPU_END)
_gpu_end = itemgetter(_se.EV_GPU_END)
_is_none = partial(is_, None)  # identity only: an event object's truth value is never asked


DEFAULT_INTERVAL_S = 0.5
"""Longest a published step waits for its drain; a queue filling to a quarter wakes its sampler
earlier, and a parked sampler (nothing to drain) is woken by the next step."""

_resumed_listeners: tuple = ()


def on_steps_resumed(listener, add: bool = True) -> None:
    """Call `listener()` (on the timing sampler's thread) each time steps arrive after its park:
    the first step of the job and the first after every pause. `add=False` removes it."""
    global _resumed_listeners
    with _sink_lock:
        others = tuple(f for f in _resumed_listeners if f != listener)
        _resumed_listeners = others + ((listener,) if add else ())


def _announce_resumed() -> None:
    for listener in _resumed_listeners:
        try:
            listener()
        except Exception:  # a listener must never stop the sampler
            _log.exception("TraceML steps-resumed listener %r failed", listener)


class _Sampler:
    """A daemon thread woken by its queue (see the module docstring), with a synchronous
    `run_once()` for tests and shutdown. With a `drain` of its own (not a step_events
    queue, so nothing can wake it) it polls at `interval_s`."""

    name = "traceml-sampler"
    queue: str | None = None
    """The step_events queue drained by default ("timing"/"memory"); it wakes this sampler."""
    announces_resumed = False
    """Whether this sampler's first drain after a park calls the `on_steps_resumed` listeners."""

    def __init__(self, sinks=None, interval_s: float = DEFAULT_INTERVAL_S, drain=None) -> None:
        self._sinks = sinks
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._owns_queue = drain is None
        self.delivered = 0
        self.parked = False  # sleeping until the next published item (the thread sets it)
        self.parks = 0  # times the thread tried to park (tests, benchmarks)

    def sinks(self) -> tuple:
        return self._sinks if self._sinks is not None else _sinks

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._wake.clear()
        if self._owns_queue and self.queue is not None:
            _se.set_queue_wakeup(self.queue, self._wake.set)
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        stop, wake = self._stop, self._wake
        can_park = self._owns_queue and self.queue is not None
        self.parked = parked = can_park and self._park()
        while True:
            wake.wait(None if parked else self.interval_s)
            wake.clear()
            resumed = parked
            if parked:
                _se.wake_on_next(self.queue, False)
                self.parked = parked = False
            if stop.is_set():
                return  # stop() drains on the caller's thread
            done = 0
            try:
                done = self.run_once()  # looked up on each call: the benchmarks time it in place
            except Exception:
                _log.exception("TraceML %s tick failed", self.name)
            if resumed and self.announces_resumed:
                _announce_resumed()
            if can_park and not done and self._idle():
                self.parked = parked = self._park()

    def _park(self) -> bool:
        """Sleep until the next published item (False, not parked, when one is already queued)."""
        self.parks += 1
        if _se.wake_on_next(self.queue, True):
            _se.wake_on_next(self.queue, False)
            return False
        return True

    def _idle(self) -> bool:
        """Nothing left that needs a timed wake-up (the timing sampler: no unresolved batch)."""
        return True

    def run_once(self) -> int:
        raise NotImplementedError

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop polling, then drain everything still queued (bounded by `timeout_s`)."""
        self._stop.set()
        self._wake.set()
        if self._owns_queue and self.queue is not None and _se.queue_wakeup(self.queue) == self._wake.set:
            _se.set_queue_wakeup(self.queue, None)  # also unparks: the quarter mark again
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
    queue = "timing"
    announces_resumed = True

    def __init__(self, sinks=None, interval_s: float = DEFAULT_INTERVAL_S, pool=None,
                 drain=None) -> None:
        super().__init__(sinks, interval_s, drain)
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
            offset = self._offset_ns = _se.wall_offset_ns()  # follows wall-clock adjustments
            pending = self.pending
            sinks = self.sinks()
            pool = self._pool
            if pool is None:
                pool = _timing.event_pool()
            taken = 0
            records: list = []
            try:
                for batch in pending:
                    ready = batch_resolved(batch)
                    if not ready and not force:
                        break
                    taken += 1  # leaves the FIFO even if resolving it fails
                    records.append(resolve_batch(batch, offset, gpu_available=ready, pool=pool))
            finally:
                del pending[:taken]  # once, not a pop(0) per batch (quadratic on a full queue)
                _deliver_all("on_step_time", records, sinks)  # what resolved, even if a later one failed
                done = len(records)
                self.delivered += done
            return done

    def _idle(self) -> bool:
        return not self.pending  # unresolved CUDA batches: only polling query() tells when they complete

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
    queue = "memory"

    def __init__(self, sinks=None, interval_s: float = DEFAULT_INTERVAL_S, drain=None) -> None:
        super().__init__(sinks, interval_s, drain)
        self._drain = drain or (lambda: _se.drain_step_memory_events())

    def run_once(self) -> int:
        with self._lock:
            records: list[StepMemorySnapshot] = self._drain()
            _deliver_all("on_step_memory", records, self.sinks())
            self.delivered += len(records)
            return len(records)
