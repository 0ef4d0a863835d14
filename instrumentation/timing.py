"""Timed regions: two perf_counter_ns stamps (plus a pooled CUDA event pair on CUDA).

Entering and leaving a region costs the training thread two clock reads, a few
attribute stores and one list append; on CUDA also two `Event.record()` calls on the
current stream. Nothing here synchronises the device or waits for the GPU: the timing
sampler resolves the events later with `Event.query()`.

Nesting: every region is recorded; the timing sampler counts only the outermost
occurrence of a raw event (one that starts inside a counted occurrence of the same
name is dropped), so an automatic patch and a manual wrapper around the same work
never count it twice. A name held by a `step_events.RegionHold` records nothing.
"""
from __future__ import annotations

import sys
import threading
import time

from . import step_events as _se
from .process_state import recording as _rec
from .process_state import timing_policy as _policy

_perf_ns = time.perf_counter_ns
_get_ident = threading.get_ident
_MAX_EVENTS = _se.MAX_EVENTS_PER_CAPTURE


class CudaEventPool:
    """Reuses timing-enabled CUDA events; the timing sampler releases them after resolving."""

    def __init__(self, factory=None, max_free: int = 8192, device_index: int | None = None) -> None:
        self._free: list = []
        self._factory = factory
        self.device_index = device_index
        self._max_free = max_free
        self.created = 0

    def acquire(self):
        try:
            return self._free.pop()
        except IndexError:
            pass
        factory = self._factory
        if factory is None:
            factory = self._factory = _cuda_event_factory(self.device_index)
        self.created += 1
        return factory()

    def release(self, event) -> None:
        if len(self._free) < self._max_free:
            self._free.append(event)

    def free_count(self) -> int:
        return len(self._free)


def _cuda_event_factory(device_index: int | None):
    """Timing events whose `record()` picks the current stream in C++.

    `torch.Event.record()` without a stream resolves the current stream natively;
    `torch.cuda.Event.record()` builds a Python `Stream` object on every call, which
    costs the training thread several microseconds per region on CUDA.
    """
    import torch

    generic = getattr(torch, "Event", None)
    if generic is not None:
        device = torch.device("cuda", device_index) if device_index is not None else torch.device("cuda")
        try:
            generic(device=device, enable_timing=True)
            return lambda: generic(device=device, enable_timing=True)
        except Exception:
            pass
    return lambda: torch.cuda.Event(enable_timing=True)


# The process-wide timing policy lives in process_state.timing_policy (set by
# traceml.init and trace_step through the helpers below, read on every region).


def cuda_in_use() -> bool:
    """Whether this process has initialised CUDA itself (never initialises it)."""
    torch = sys.modules.get("torch")
    try:
        return torch is not None and bool(torch.cuda.is_initialized())
    except Exception:
        return False


def cuda_available() -> bool:
    """`torch.cuda.is_available()`; False without torch or when the query fails (no CUDA context)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def default_gpu() -> bool:
    """Whether a region without an explicit device gets CUDA events right now."""
    return _policy.gpu_default if not _policy.gpu_undecided else cuda_in_use()


def prepare_gpu_timing() -> None:
    """CUDA is available: let regions before the first step use events once CUDA is in use."""
    if _policy.pool is None:
        _policy.pool = CudaEventPool()
    _policy.gpu_undecided = True
    _se.refresh_fast_path()


def configure_gpu_timing(enabled: bool, pool: CudaEventPool | None = None,
                         device_index: int | None = None) -> None:
    """Use CUDA event pairs for regions without an explicit device (needs a pool on CUDA)."""
    if pool is not None:
        _policy.pool = pool
    elif enabled and _policy.pool is None:
        _policy.pool = CudaEventPool(device_index=device_index)
    _policy.gpu_default = bool(enabled)
    _policy.gpu_undecided = False
    _se.refresh_fast_path()


def event_pool() -> CudaEventPool | None:
    return _policy.pool


def gpu_timing_enabled() -> bool:
    return _policy.gpu_default


def _device_is_cuda(device) -> bool:
    if device is None:
        return _policy.gpu_default
    kind = getattr(device, "type", None)
    if kind is None:
        kind = str(device).split(":", 1)[0]
    return kind == "cuda"


def _cuda_event_failed(exc: Exception) -> None:
    _se.warn_once("cuda_event_failed", f"recording a CUDA timing event failed ({exc!r}); "
                  "the region keeps its CPU time and has no GPU time")


class timed_region:
    """Context manager timing one occurrence of `raw_event` into the active capture.

    `device=None` follows the process policy (CUDA events when the traced step runs
    on CUDA); `device="cpu"` forces CPU-only timing. Leaving a region twice, or a
    region that was never entered, warns once and records nothing.
    """

    # No __slots__: the state starts as class attributes, so `region_type()` classes
    # are built by a C-level call (no Python __init__ frame on the training thread).
    raw_event: str
    _gpu: bool | None = None  # None: the process policy, decided on entry
    _capture = None
    _t0 = 0
    _g0 = None
    _state = 0  # 0 new, 1 open and recording, 2 open but inert, 3 closed, 4 open on the CPU fast path
    _range = None  # a deep capture's profiler range opened with the region (`step_events.region_annotation`)

    def __init__(self, raw_event: str, *, device=None) -> None:
        self.raw_event = raw_event
        if device is not None:
            self._gpu = device != "cpu" and _device_is_cuda(device)

    def __enter__(self):
        rec = _rec
        # The common case first, reading one flag (`recording.fast`: recording on, the
        # CPU clock, nothing held): the training thread, a new region, a capture open.
        if rec.fast and self._state == 0 and self._gpu is not True and _get_ident() == rec.owner:
            capture = rec.active
            if capture is not None:
                self._capture = capture
                self._state = 4
                self._t0 = _perf_ns()
                return self
        if self._state != 0:
            _se.warn_once("reentered_region", f"region {self.raw_event!r} entered twice; "
                          "the second entry is ignored")
            return self
        se = _se
        # Fast path inlined (recording on, training thread); recording_allowed() handles
        # the rest: claiming the thread, counting foreign threads.
        if not (rec.recording and _get_ident() == rec.owner) and not se.recording_allowed():
            self._state = 2
            return self
        held = se.held
        if held and self.raw_event in held:
            self._state = 2
            return self
        capture = rec.active
        self._capture = capture if capture is not None else se.current_capture()
        self._state = 1
        annotate = se.region_annotation
        if annotate is not None:  # a deep capture records (the fast path is off meanwhile)
            self._range = annotate(self.raw_event)
        gpu = self._gpu
        policy = _policy
        if gpu is None:  # the process policy: default_gpu(), inline (every region's path)
            gpu = policy.gpu_default if not policy.gpu_undecided else cuda_in_use()
        if gpu and policy.pool is not None:
            try:
                g0 = policy.pool.acquire()
                g0.record()
                self._g0 = g0
            except Exception as exc:  # telemetry never breaks the training step
                _cuda_event_failed(exc)
        self._t0 = _perf_ns()
        return self

    def __exit__(self, exc_type=None, exc=None, tb=None) -> bool:
        t1 = _perf_ns()
        state = self._state
        if state == 4:  # opened on the CPU fast path: no CUDA events
            self._state = 3
            capture = self._capture
            if capture is _rec.active and len(capture.events) < _MAX_EVENTS:
                capture.events.append((self.raw_event, self._t0, t1, None, None))
            else:
                _se.record_timing_event((self.raw_event, self._t0, t1, None, None), capture)
            return False
        if state == 1:
            self._state = 3
            if self._range is not None:
                _end_range(self)
            g0 = self._g0
            g1 = None
            if g0 is not None:
                try:
                    g1 = _policy.pool.acquire()
                    g1.record()
                except Exception as exc:  # the CPU time is kept; the GPU time is unavailable
                    _cuda_event_failed(exc)
                    g0 = g1 = None
            capture = self._capture
            self._capture = None
            event = (self.raw_event, self._t0, t1, g0, g1)
            # The capture it opened in is still the active one (so recording is on):
            # record_timing_event's common case, inline.
            if capture is _rec.active and len(capture.events) < _MAX_EVENTS:
                capture.events.append(event)
            elif not _se.record_timing_event(event, capture) and g0 is not None:
                _policy.pool.release(g0)
                _policy.pool.release(g1)
        elif state == 2:
            self._state = 3
        else:
            _se.warn_once("unbalanced_exit", f"region {self.raw_event!r} exited without a "
                          "matching entry; the exit is ignored")
        return False

    # Explicit form for hook pairs (pre/post hooks) that cannot use `with`.
    start = __enter__

    stop = __exit__

    def discard(self) -> None:
        """Close an open region without recording it (e.g. the epoch-ending `next()`)."""
        if self._state == 1 or self._state == 4:
            if self._range is not None:
                _end_range(self)
            if self._g0 is not None:
                _policy.pool.release(self._g0)
                self._g0 = None
            self._capture = None
        self._state = 3


def _end_range(region: timed_region) -> None:
    """Close the deep capture's profiler range a region opened (it never breaks the step)."""
    rng, region._range = region._range, None
    try:
        rng.__exit__(None, None, None)
    except Exception:
        pass


def region_type(raw_event: str, name: str) -> type:
    """A `timed_region` subclass for one raw event, called with no arguments.

    `with traceml.timed_backward():` builds one per use: with no Python `__init__`
    that costs one C-level call instead of a Python frame on the training thread.
    """
    return type(name, (timed_region,), {
        "raw_event": raw_event, "__init__": object.__init__, "__slots__": (),
        "__module__": "traceml", "__doc__": f"A timed_region for {raw_event!r} (no arguments)."})


class _DataLoaderTimingScope:
    __slots__ = ("_enabled", "_outer")

    def __init__(self, enabled: bool) -> None:
        self._enabled = bool(enabled)
        self._outer = None

    def __enter__(self):
        self._outer = _policy.dataloader_timing
        _policy.dataloader_timing = self._enabled
        _se.refresh_fast_path()
        return self

    def __exit__(self, *exc) -> bool:
        _policy.dataloader_timing = self._outer
        _se.refresh_fast_path()
        return False


def dataloader_timing_scope(enabled: bool) -> _DataLoaderTimingScope:
    """Set the process-wide DataLoader timing policy inside the block; restore the outer one."""
    return _DataLoaderTimingScope(enabled)


def dataloader_timing_enabled() -> bool:
    return _policy.dataloader_timing
