"""Region timers built on timed_region, shared by manual wrappers and automatic patches.

Each piece here turns a framework callback pair (optimizer step pre/post hooks, a
call wrapper's before/after: see `forward`) or an iterator `next()` into one timed
region. No torch import at module level.
"""
from __future__ import annotations

import threading
import time
from operator import methodcaller

from traceml.schema.vocabulary import RAW_DATALOADER_NEXT, RAW_OPTIMIZER_STEP

from . import step_events as _se
from .process_state import recording as _rec
from .process_state import timing_policy as _policy
from .timing import timed_region

_perf_ns = time.perf_counter_ns
_get_ident = threading.get_ident
_MAX_EVENTS = _se.MAX_EVENTS_PER_CAPTURE


class HookRegionTimer:
    """Opens a region in a pre-hook and closes it in the matching post-hook.

    `pre`/`post` are registered as the hooks themselves, so a hook pair costs two
    Python calls. In the common case (`recording.fast`: recording on, the CPU clock,
    nothing held; the training thread) the open call's start stamp and capture are
    kept on the timer itself; otherwise one reused `timed_region` does the work
    (CUDA events, holds, foreign threads). Re-entrant calls only count depth (the
    outermost call is the one timed). A pre-hook that finds a call left open by one
    that raised before its post-hook (its step has since ended) starts afresh
    instead of leaking.
    """

    __slots__ = ("raw_event", "_region", "_depth", "handles", "_t0", "_capture")

    def __init__(self, raw_event: str) -> None:
        self.raw_event = raw_event
        self._region = timed_region(raw_event)
        self._depth = 0
        self.handles: list = []
        self._t0 = 0
        self._capture = None  # the open call's capture on the fast path (None: the region's)

    # These run every step, and inside a real step every object the training thread
    # touches costs it a cache miss (see docs/design/performance-history.md): the fast
    # path reads `recording` and this timer only.
    def pre(self, *_args, **_kwargs) -> None:
        rec = _rec
        if self._depth:
            capture = self._capture
            if capture is not None:
                if capture is rec.active:
                    self._depth += 1
                    return None
                self._capture = None  # stale: its post-hook never ran (its step ended)
            elif self._region._state == 1 and self._region._capture is rec.active:
                self._depth += 1
                return None
            else:
                self._region.discard()  # stale
            self._depth = 0
        if rec.fast and _get_ident() == rec.owner:
            capture = rec.active
            if capture is None:
                capture = _se.current_capture()
            self._capture = capture
            self._depth = 1
            self._t0 = _perf_ns()
            return None
        if not rec.recording:
            return None
        region = self._region
        self._depth = 1
        region._g0 = None
        region._gpu = None  # the process policy, decided by __enter__
        region._state = 0
        region.__enter__()
        return None

    def post(self, *_args, **_kwargs) -> None:
        t1 = _perf_ns()
        depth = self._depth
        if depth != 1:
            if depth > 1:
                self._depth = depth - 1
            return
        self._depth = 0
        capture = self._capture
        if capture is None:
            self._region.__exit__()
            return
        self._capture = None
        if capture is _rec.active and len(capture.events) < _MAX_EVENTS:
            capture.events.append((self.raw_event, self._t0, t1, None, None))
        else:
            _se.record_timing_event((self.raw_event, self._t0, t1, None, None), capture)

    def remove_hooks(self) -> None:
        """Remove every hook registered with this timer's `pre`/`post` (its `handles`)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def abandon(self) -> None:
        """Close the call opened by `pre` without recording it (e.g. the epoch-ending `next()`)."""
        depth = self._depth
        if depth > 1:
            self._depth = depth - 1
        elif depth == 1:
            self._depth = 0
            if self._capture is None:
                self._region.discard()
            self._capture = None


def close_region(capture, raw_event: str, t0: int, t1: int) -> None:
    """Record a CPU-only region [t0, t1] that opened in `capture` (the call wrappers' fast paths).

    The wrappers append inline when `capture` is still the active one and has room;
    this is the rest: a capture that ended meanwhile, or a full one.
    """
    event = (raw_event, t0, t1, None, None)
    if capture is _rec.active and len(capture.events) < _MAX_EVENTS:
        capture.events.append(event)
    else:
        _se.record_timing_event(event, capture)


class OptimizerTimer(HookRegionTimer):
    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(RAW_OPTIMIZER_STEP)


_OPTIMIZER_ATTR = "_traceml_optimizer_timer"


def instrument_optimizer(optimizer) -> OptimizerTimer:
    """Time `optimizer.step()` through its own step hooks. Idempotent."""
    timer = getattr(optimizer, _OPTIMIZER_ATTR, None)
    if timer is not None and timer.handles:
        return timer
    timer = OptimizerTimer()
    timer.handles.extend((optimizer.register_step_pre_hook(timer.pre),
                          optimizer.register_step_post_hook(timer.post)))
    object.__setattr__(optimizer, _OPTIMIZER_ATTR, timer)  # past any __setattr__ of a subclass
    return timer


def remove_optimizer_instrumentation(optimizer) -> None:
    """Undo `instrument_optimizer` (remove both step hooks)."""
    timer = getattr(optimizer, _OPTIMIZER_ATTR, None)
    if timer is not None:
        timer.remove_hooks()
        object.__delattr__(optimizer, _OPTIMIZER_ATTR)


def timed_next_method(orig_next):
    """A `__next__` that times each `orig_next(self)` as input wait; epoch-end StopIteration is not recorded.

    On CUDA the region also gets an event pair: the GPU time between them is how
    long the stream sat idle waiting for the batch (the processor's GPU-clock Input
    Wait); the CPU time is the host's fetch time. Honours `dataloader_timing_scope`.
    """
    shared = HookRegionTimer(RAW_DATALOADER_NEXT)

    def __next__(self):
        rec = _rec
        if rec.loader_fast and _get_ident() == rec.owner:
            # The common case, as one region in this frame's locals (no timer call):
            # a nested call records its own, and the sampler keeps the outermost.
            capture = rec.active
            if capture is None:
                capture = _se.current_capture()
            t0 = _perf_ns()
            try:
                item = orig_next(self)
            except StopIteration:  # the epoch's end: no batch, not recorded
                raise
            except BaseException:
                close_region(capture, RAW_DATALOADER_NEXT, t0, _perf_ns())
                raise
            t1 = _perf_ns()
            if capture is rec.active and len(capture.events) < _MAX_EVENTS:
                capture.events.append((RAW_DATALOADER_NEXT, t0, t1, None, None))
            else:
                close_region(capture, RAW_DATALOADER_NEXT, t0, t1)
            return item
        if not _policy.dataloader_timing or not rec.recording:
            return orig_next(self)
        # The shared timer on the training thread; another thread gets its own (its
        # region counts the foreign thread) and never touches the shared one's depth.
        timer = shared if _get_ident() == _rec.owner else HookRegionTimer(RAW_DATALOADER_NEXT)
        timer.pre()
        try:
            item = orig_next(self)
        except StopIteration:
            timer.abandon()
            raise
        except BaseException:
            timer.post()
            raise
        timer.post()
        return item

    __next__.__wrapped__ = orig_next
    return __next__


class TimedIterable:
    """Wraps an iterable so that each `next()` on its iterator is timed as input wait."""

    def __init__(self, iterable) -> None:
        self.iterable = iterable

    def __iter__(self):
        return _TimedIterator(iter(self.iterable))

    def __len__(self):
        return len(self.iterable)

    def __getattr__(self, name):
        return getattr(self.iterable, name)


class _TimedIterator:
    """The iterator of a `TimedIterable`: each `next()` is one input-wait region.

    Its `__next__` is `timed_next_method` around the wrapped iterator's own
    `__next__` (called through `methodcaller`, a C-level call), so the wrapped loader
    and the automatic DataLoader patch share one timing path.
    """

    __slots__ = ("_next",)

    def __init__(self, it) -> None:
        self._next = it.__next__

    def __iter__(self):
        return self

    __next__ = timed_next_method(methodcaller("_next"))


def moves_host_to_device(tensor, args: tuple, kwargs: dict) -> bool:
    """True when `tensor.to(*args, **kwargs)` copies a CPU tensor onto a CUDA device.

    Runs on every `Tensor.to` call in automatic mode, so it is one function (no
    helper call); a string target, the common case, is decided first.
    """
    target = kwargs.get("device") if kwargs else None
    if target is None:
        if not args:
            return False
        target = args[0]
    if isinstance(target, str):
        is_cuda = target.startswith("cuda")
    else:
        kind = getattr(target, "type", None)  # torch.device
        if isinstance(kind, str):
            is_cuda = kind == "cuda"
        elif isinstance(target, int) and not isinstance(target, bool):
            is_cuda = True  # a bare int is a CUDA device ordinal
        else:
            is_cuda = getattr(target, "is_cuda", None) is True  # a tensor: .to(other) takes its device
    return is_cuda and getattr(tensor, "is_cpu", False) is True
