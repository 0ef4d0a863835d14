"""StepCapture, the two bounded queues to the samplers, and the helpers that own them.

The training thread only appends small tuples to the active capture and, at a step
boundary, moves the capture's event list into the timing queue. Everything costly
(summing, CUDA resolution, building records) happens later on the sampler threads.

Lifecycle (contract, "Training-to-sampler handoff"):
- Events recorded while no step is open land in a pending capture created lazily by
  `current_capture()`; they are attributed to the next completed step.
- `complete_step_capture()` detaches the capture, assigns one step number and
  publishes its timing batch and final memory snapshot.
- `abort_step_capture()` discards the capture; the step counter does not move.
- Completing or aborting a capture that is already detached does nothing, so a stale
  caller can never finalise a later step.
- `set_recording(False)` detaches and discards the active capture; while recording
  is off nothing is recorded. The samplers keep draining what was published.
- A region belongs to the capture that was active when it opened: one that closes
  after that capture completed or aborted spans a boundary and is discarded.
- A completed step is offered to `step_end_hook` when one is set (a deep capture armed
  or recording, `traceml.deep_capture`); otherwise the step end reads that one global.

Nesting ("the outermost region of a name wins") is not tracked here: the training
thread records every region it closes, and the timing sampler drops an occurrence
that starts inside a counted occurrence of the same name (`samplers.outermost_events`).
That keeps the per-region work on the training thread to two clock reads, a few
attribute stores and one append.

A timing event is a plain tuple `(raw_event, cpu_start_ns, cpu_end_ns, gpu_start,
gpu_end)` where the GPU items are CUDA-event-like objects (`query()`,
`elapsed_time()`) or None. Only one thread records: the training thread, i.e. the
one that called `traceml.init()` (or, without init, the first one that records);
regions entered on other threads are ignored and counted.
"""
from __future__ import annotations

import threading
import time
import warnings
from collections import deque

from .process_state import recording as _rec
from .process_state import timing_policy as _policy
from .records import StepMemorySnapshot

QUEUE_CAPACITY = 2048
"""Items per queue (timing batches, memory snapshots); new items are dropped when full."""

MAX_EVENTS_PER_CAPTURE = 8192
"""Bound on one capture's events, so a loop that never closes a step cannot grow memory."""

_new = object.__new__
"""Builds slotted instances without a Python __init__ frame on the training thread's hot path."""

# Positions inside a timing event tuple.
EV_NAME, EV_CPU_START, EV_CPU_END, EV_GPU_START, EV_GPU_END = range(5)


class StepTimeBatch:
    """One completed step's timing events, as published to the timing queue (with the
    job's OpenTelemetry span context current when the step began, or None)."""

    __slots__ = ("step", "events", "parent")

    def __init__(self, step: int, events: list, parent=None) -> None:
        self.step = step
        self.events = events
        self.parent = parent

    def __repr__(self) -> str:
        return f"StepTimeBatch(step={self.step}, events={len(self.events)})"


class MemoryReading:
    """One peak-memory reading of the tracked device (bytes; None on non-CUDA devices)."""

    __slots__ = ("device", "peak_allocated_bytes", "peak_reserved_bytes", "time_ns")

    def __init__(self, device: str, peak_allocated_bytes: int | None,
                 peak_reserved_bytes: int | None, time_ns: int) -> None:
        self.device = device
        self.peak_allocated_bytes = peak_allocated_bytes
        self.peak_reserved_bytes = peak_reserved_bytes
        self.time_ns = time_ns


class StepCapture:
    """The events and the one memory reading of one step, until it is completed or aborted.

    Integrations obtain it with `current_capture()`/`begin_step_capture()` and finish
    it only through `complete_step_capture()`/`abort_step_capture()`.
    """

    __slots__ = ("events", "memory", "detached", "parent")

    def __init__(self) -> None:
        self.events: list = []
        self.memory: MemoryReading | None = None
        self.detached = False
        self.parent = None  # the job's OpenTelemetry SpanContext at step begin (trace_step sets it)

    def record(self, reading: MemoryReading) -> None:
        """Keep `reading` as this step's memory snapshot (replaces an earlier one)."""
        if not self.detached:
            self.memory = reading

    def is_empty(self) -> bool:
        return not self.events and self.memory is None


class BoundedDropQueue:
    """Single-producer, single-consumer queue that drops new items when full and counts them.

    `wakeup` (set by the consumer, e.g. a sampler's event) is called once each time
    the queue fills up to `wake_at` items, so the consumer can sleep long between
    polls without the queue overflowing on fast steps. A consumer with nothing to do
    parks by moving `wake_at` to 1 (`wake_on_next`): the next item then wakes it, and
    the producer's check stays the one comparison it always was.
    """

    __slots__ = ("_items", "capacity", "dropped", "wake_at", "wakeup")

    def __init__(self, capacity: int = QUEUE_CAPACITY) -> None:
        self._items: deque = deque()
        self.capacity = capacity
        self.dropped = 0
        self.wake_at = self.fill_mark()
        self.wakeup = None

    def fill_mark(self) -> int:
        """The size whose arrival wakes an unparked consumer: a quarter of the capacity."""
        return max(1, self.capacity // 4)

    def put(self, item) -> bool:
        items = self._items
        size = len(items)
        if size >= self.capacity:
            self.dropped += 1
            return False
        items.append(item)
        if size + 1 == self.wake_at and self.wakeup is not None:
            _call_wakeup(self.wakeup)
        return True

    def drain(self) -> list:
        out = []
        pop = self._items.popleft
        while True:
            try:
                out.append(pop())
            except IndexError:
                return out

    def __len__(self) -> int:
        return len(self._items)


def _call_wakeup(wakeup) -> None:
    try:
        wakeup()
    except Exception:  # a consumer's wake-up must never break the training step
        pass


# --- Process-wide state (owned by the helpers below) ------------------------------
# Whether recording is on, the training thread and the active capture live in
# `process_state.recording` (`_rec`), which the hot path reads; only the helpers
# below write it.

_next_step = 0
_timing_queue = BoundedDropQueue()
_memory_queue = BoundedDropQueue()
_events_dropped = 0
_foreign_dropped = 0
held: dict = {}
"""raw event -> the RegionHold keeping regions of that name from recording (usually empty)."""

step_end_hook = None
"""The deep capture's step-end callback, `hook(step, events)`, while a capture is armed or records
(`deep_capture`); None otherwise, which is all a step end pays for deep capture: one global read."""
region_annotation = None
"""While a deep capture records: `open(raw_event)`, which every region entered on the training thread
calls (the fast paths are off meanwhile, `refresh_fast_path`) and which returns a profiler range for
the region to close, or None. None otherwise."""

_warned: set = set()
_misuse: dict = {}
_get_ident = threading.get_ident


def warn_once(key: str, message: str) -> None:
    """Count one misuse of kind `key`; emit a RuntimeWarning the first time only."""
    _misuse[key] = _misuse.get(key, 0) + 1
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"TraceML: {message}", RuntimeWarning, stacklevel=3)


def misuse_counts() -> dict[str, int]:
    """How often each documented misuse was seen (keys: see docs/instrumentation.md)."""
    return dict(_misuse)


def recording_allowed() -> bool:
    """True when recording is on and the caller is the recording (training) thread."""
    global _foreign_dropped
    rec = _rec
    if not rec.recording:
        return False
    tid = _get_ident()
    if tid == rec.owner:
        return True
    if rec.owner is None:
        rec.owner = tid
        return True
    _foreign_dropped += 1
    warn_once("foreign_thread", "a timed region or trace_step() was entered on a thread other "
              "than the training thread (the one that called traceml.init()); it is ignored")
    return False


def current_capture() -> StepCapture:
    """The active capture, created lazily (pending events attach to the next step)."""
    capture = _rec.active
    if capture is None:
        # StepCapture() without its Python-level __init__ frame: this runs every step.
        capture = _new(StepCapture)
        capture.events = []
        capture.memory = None
        capture.detached = False
        capture.parent = None
        _rec.active = capture
    return capture


begin_step_capture = current_capture


def has_active_capture() -> bool:
    return _rec.active is not None


def record_timing_event(event: tuple, capture: StepCapture | None = None) -> bool:
    """Append one timing event to the active capture (timed-region utilities only).

    `capture` is the capture that was active when the region opened: a region whose
    step completed or aborted in between spans a boundary and is discarded.
    """
    global _events_dropped
    if not _rec.recording:
        return False
    active = _rec.active
    if capture is not None and (capture is not active or capture.detached):
        warn_once("spanning_region", f"region {event[0]!r} spanned a step boundary "
                  "(opened before the step completed or aborted, closed after); it is discarded")
        return False
    if active is None:
        active = current_capture()
    events = active.events
    if len(events) >= MAX_EVENTS_PER_CAPTURE:
        _events_dropped += 1
        return False
    events.append(event)
    return True


class RegionHold:
    """Keeps regions of the given raw event names from recording until `release()`.

    For integrations that time a phase at their own boundaries, or must keep the
    automatic patches quiet (validation inside `fit`): a hold survives step
    boundaries. A name already held stays with its first holder. Regions opened
    while their name is held record nothing, whatever code opens them.
    """

    __slots__ = ("names",)

    def __init__(self, names) -> None:
        self.names = [name for name in names if name not in held]
        for name in self.names:
            held[name] = self
        refresh_fast_path()

    def release(self) -> None:
        for name in self.names:
            if held.get(name) is self:
                del held[name]
        self.names = []
        refresh_fast_path()


def refresh_fast_path() -> None:
    """Recompute `recording.fast` (recording on, the CPU clock, no name held, no deep capture recording).

    Called by every writer of the four: `set_recording`, `RegionHold`, `timing`'s
    policy helpers and `deep_capture`. The common path of each region, hook and patch
    then checks one flag on one object instead of reading the policy and the holds.
    """
    fast = _rec.fast = bool(_rec.recording and not _policy.gpu_default and not _policy.gpu_undecided
                            and not held and region_annotation is None)
    _rec.loader_fast = fast and _policy.dataloader_timing


def complete_step_capture(capture: StepCapture | None = None, last_event: tuple | None = None,
                          memory_device: str | None = None) -> int | None:
    """Detach the active capture, number it, and publish its timing batch and memory.

    Returns the step number, or None when nothing was published: `capture` is given
    and no longer active (already completed/aborted), the capture is empty, or
    recording is off (the capture is then discarded).

    `last_event` and `memory_device` serve `trace_step`'s CPU fast path, which ends
    a step in this one call: `last_event` (the step's own, already closed timing
    event) is appended first, and `memory_device` (a non-CUDA device label) records
    a memory reading without peaks, as `StepMemoryTracker.read()` does off CUDA.
    Both are ignored when `capture` is not the active capture.
    """
    global _next_step, _events_dropped
    rec = _rec
    active = rec.active
    if active is None or (capture is not None and capture is not active):
        return None
    rec.active = None
    active.detached = True
    recording = rec.recording
    if last_event is not None and recording:
        if len(active.events) < MAX_EVENTS_PER_CAPTURE:
            active.events.append(last_event)
        else:
            _events_dropped += 1
    if not recording or (not active.events and active.memory is None and memory_device is None):
        return None
    step = _next_step
    _next_step = step + 1
    if step_end_hook is not None:
        _call_step_end_hook(step, active.events)
    # Both queues get plain tuples: the records (StepTimeBatch, StepMemorySnapshot)
    # are built when drained, on the sampler thread. Each put is
    # BoundedDropQueue.put written out: this runs once per step of the job, and
    # inside a real step a Python call costs the training thread about a microsecond.
    events = active.events
    if events:
        queue = _timing_queue
        items = queue._items
        size = len(items)
        if size < queue.capacity:
            items.append((step, events, active.parent))
            if size + 1 == queue.wake_at and queue.wakeup is not None:
                _call_wakeup(queue.wakeup)
        else:
            queue.dropped += 1
    if memory_device is not None:
        # Off CUDA: no peaks, so the reading is just the device and when the step ended
        # (a perf_counter stamp, mapped to the wall clock when drained).
        item = (step, memory_device,
                last_event[EV_CPU_END] if last_event is not None else time.perf_counter_ns())
    elif active.memory is not None:
        item = (step, active.memory)
    else:
        return step
    queue = _memory_queue
    items = queue._items
    size = len(items)
    if size < queue.capacity:
        items.append(item)
        if size + 1 == queue.wake_at and queue.wakeup is not None:
            _call_wakeup(queue.wakeup)
    else:
        queue.dropped += 1
    return step


def _call_step_end_hook(step: int, events: list) -> None:
    hook = step_end_hook
    if hook is not None:
        try:
            hook(step, events)
        except Exception:  # a deep capture must never break the training step
            pass


def abort_step_capture(capture: StepCapture | None = None) -> None:
    """Discard the active capture (or do nothing if `capture` is already detached)."""
    active = _rec.active
    if active is None or (capture is not None and capture is not active):
        return
    _rec.active = None
    active.detached = True


def publish_step_memory_event(snapshot: StepMemorySnapshot) -> bool:
    """Queue one finished memory snapshot (complete_step_capture does this for its capture)."""
    return _memory_queue.put(snapshot)


def drain_step_memory_events() -> list[StepMemorySnapshot]:
    """Everything queued, as snapshots (built here, on the draining sampler thread)."""
    out = []
    new_tuple = tuple.__new__  # StepMemorySnapshot(...) without its Python __new__ frame
    offset = None
    for item in _memory_queue.drain():
        if type(item) is tuple:  # from complete_step_capture
            if len(item) == 2:  # (step, MemoryReading)
                step, r = item
                item = new_tuple(StepMemorySnapshot, (step, r.device, r.peak_allocated_bytes,
                                                      r.peak_reserved_bytes, r.time_ns))
            else:  # (step, device, perf_counter_ns at the step's end): no peaks off CUDA
                if offset is None:
                    offset = wall_offset_ns()
                step, device, stamp = item
                item = new_tuple(StepMemorySnapshot, (step, device, None, None, stamp + offset))
        out.append(item)
    return out


def drain_step_time_batches() -> list[StepTimeBatch]:
    """Everything queued, as StepTimeBatch objects (built here, on the draining sampler thread)."""
    out = []
    for step, events, parent in _timing_queue.drain():  # from complete_step_capture
        batch = _new(StepTimeBatch)  # without the __init__ frame
        batch.step, batch.events, batch.parent = step, events, parent
        out.append(batch)
    return out


def dropped_counts() -> dict[str, int]:
    """Items lost so far, by queue name (the exporter reports `timing` and `memory`).

    `timing` = `timing_batches` (whole steps refused by the full timing queue) +
    `timing_events` (single events refused by a full capture); `memory` = snapshots
    refused by the full memory queue; `foreign_thread` = regions ignored because
    they were entered from a thread other than the training thread.
    """
    return {
        "timing": _timing_queue.dropped + _events_dropped,
        "memory": _memory_queue.dropped,
        "timing_batches": _timing_queue.dropped,
        "timing_events": _events_dropped,
        "foreign_thread": _foreign_dropped,
    }


def set_recording(enabled: bool) -> None:
    """Turn recording on or off; turning it off discards the active capture unpublished."""
    rec = _rec
    if not enabled and rec.active is not None:
        rec.active.detached = True
        rec.active = None
    rec.recording = bool(enabled)
    refresh_fast_path()


def claim_recording_thread() -> None:
    """Make the calling thread the training thread (traceml.init() does this)."""
    _rec.owner = _get_ident()


def is_recording() -> bool:
    return _rec.recording


def steps_completed() -> int:
    """Number of steps published so far (the next step number)."""
    return _next_step


def _queue(name: str) -> BoundedDropQueue:
    return {"timing": _timing_queue, "memory": _memory_queue}[name]


def set_queue_wakeup(queue: str, wakeup) -> None:
    """Have `wakeup()` called when queue `timing` or `memory` fills to a quarter (None: stop)."""
    target = _queue(queue)
    target.wakeup = wakeup
    if wakeup is None:
        target.wake_at = target.fill_mark()


def queue_wakeup(queue: str):
    return _queue(queue).wakeup


def wake_on_next(queue: str, parked: bool) -> int:
    """Park (`parked=True`: the next item published calls the wake-up) or unpark (back to the
    quarter mark) the consumer of queue `timing` or `memory`; returns the items queued now.

    The consumer parks first and reads the length after: an item appended before the
    producer saw `wake_at == 1` is then in that length, so no item is left unannounced
    (the GIL orders the two threads' steps). The training thread pays nothing more than
    before: it compares the size with `wake_at` as it always did, and calls the wake-up
    (one `Event.set`, a few microseconds) only for the first step after the consumer parked.
    """
    target = _queue(queue)
    target.wake_at = 1 if parked else target.fill_mark()
    return len(target._items)


def wall_offset_ns() -> int:
    """time.time_ns() - time.perf_counter_ns(), sampled now (maps perf stamps to wall clock)."""
    return time.time_ns() - time.perf_counter_ns()
