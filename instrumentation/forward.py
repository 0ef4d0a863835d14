"""Forward timing of one module (the outermost model): each call of it is one forward region.

Two mechanisms, chosen when a module is instrumented:

- A `__call__` on the module's class. It looks the instance up in `_timers` and runs
  an instrumented instance's call inside its timer; any other instance of the class
  passes straight through. Module hooks would time the same calls, but a module with
  any hook takes `Module._call_impl`'s slow path: 31-40 us of the training thread per
  step with cold caches (as inside a real step) against about 22 for this wrapper
  (`benchmarks/bench_cold_cache.py`). Nothing is stored on the instance, so copies
  (`copy.deepcopy`, an averaged/EMA model, `DataParallel` replicas) and pickles of
  the module carry nothing of TraceML and are not timed. The next `__call__` is
  looked up at call time (`super()`), so a later patch of `torch.nn.Module.__call__`
  (FX tracing makes one) still applies.
- Forward pre/post hooks (`always_call`), where a class-wide wrapper does not fit: a
  TorchScript module, a class that refuses the attribute, or a model that has
  instances of its own class among its submodules (a `Sequential` of `Sequential`s:
  every inner call would pass through the wrapper).

Both are undone by `remove_forward_instrumentation()`, and an instrumented module
that is garbage-collected is forgotten (its class wrapper removed with the last one).
"""
from __future__ import annotations

import functools
import threading
import time
import weakref

from traceml.schema.vocabulary import RAW_FORWARD

from . import sharding as _sharding
from . import step_events as _se
from .hooks import HookRegionTimer, close_region
from .process_state import recording as _rec

_get_ident = threading.get_ident
_perf_ns = time.perf_counter_ns
_MAX_EVENTS = _se.MAX_EVENTS_PER_CAPTURE
_lock = threading.RLock()  # re-entrant: a weakref callback can run inside a locked section (GC)
_timers: dict = {}
"""id(module) -> the ForwardTimer of each instrumented module."""
_patched: dict = {}
"""class -> its _ClassPatch (the class's own `__call__` before patching, the timers using it)."""


class _ClassPatch:
    """One class's `__call__` wrapper state: what it replaced and which timers use it.

    `sole` is the timer when exactly one instance uses the wrapper (the usual case:
    one model), so that the wrapper finds it without a dictionary lookup.
    """

    __slots__ = ("own", "timers", "sole")

    def __init__(self, own) -> None:
        self.own = own  # the class's own __call__ (None: inherited)
        self.timers: list = []
        self.sole = None

    def use(self, timer) -> None:
        self.timers.append(timer)
        self.sole = self.timers[0] if len(self.timers) == 1 else None

    def drop(self, timer) -> None:
        self.timers = [t for t in self.timers if t is not timer]
        self.sole = self.timers[0] if len(self.timers) == 1 else None


class ForwardTimer(HookRegionTimer):
    """The forward region of one module; `module` is a weak reference to it."""

    __slots__ = ("module", "patched_class")

    def __init__(self, module) -> None:
        super().__init__(RAW_FORWARD)
        # partial, not a lambda over the global: the callback can run at interpreter exit
        self.module = weakref.ref(module, functools.partial(_forget, id(module)))
        self.patched_class = None


def instrument_forward(module) -> ForwardTimer:
    """Time every call of `module` (only this module, not its children). Idempotent."""
    with _lock:
        timer = forward_timer(module)
        if timer is not None:
            return timer
        timer = ForwardTimer(module)
        cls = type(module)
        if _class_call_fits(module, cls):
            try:
                _patch_class_call(cls, timer)
                timer.patched_class = cls
            except (TypeError, AttributeError):  # a class that refuses new attributes
                pass
        if timer.patched_class is None:
            # always_call: the closing hook runs even when forward raises, so nothing leaks.
            timer.handles.append(module.register_forward_pre_hook(timer.pre))
            try:
                timer.handles.append(module.register_forward_hook(timer.post, always_call=True))
            except BaseException:
                timer.handles.pop().remove()
                raise
        _timers[id(module)] = timer
        return timer


def time_forward_or_warn(module, instrument=instrument_forward) -> None:
    """Give `module` forward timing through `instrument`; one that cannot be timed warns instead.

    For `wrap_forward` and the automatic `trace_step(model)`: a module whose calls
    cannot be timed (not an `nn.Module`, a TorchScript module without hooks) still
    trains, its steps without a forward region. Telemetry never stops the job.
    """
    try:
        instrument(module)
    except Exception as exc:
        _se.warn_once("forward_not_timed", f"the calls of {type(module).__name__} cannot be timed as "
                      f"forward ({exc!r}); its steps are traced without a forward region")
    _sharding.note_model(module)  # the model is seen here once: is it FSDP? (`sharding`)


def forward_timer(module) -> ForwardTimer | None:
    """The timer of an instrumented `module`, else None."""
    timer = _timers.get(id(module))
    return timer if timer is not None and timer.module() is module else None


def remove_forward_instrumentation(module) -> None:
    """Undo `instrument_forward` (the class wrapper's use or the two hooks)."""
    with _lock:
        timer = forward_timer(module)
        if timer is not None:
            del _timers[id(module)]
            _release(timer)


def _forget(key: int, ref) -> None:
    """Weakref callback: an instrumented module was garbage-collected."""
    try:
        with _lock:
            timer = _timers.get(key)
            if timer is not None and timer.module is ref:
                del _timers[key]
                _release(timer)
    except Exception:  # at interpreter exit this module's globals may already be gone
        pass


def _release(timer: ForwardTimer) -> None:
    timer.remove_hooks()
    cls, timer.patched_class = timer.patched_class, None
    if cls is not None:
        _unpatch_class_call(cls, timer)


def _class_call_fits(module, cls) -> bool:
    try:
        import torch

        if isinstance(module, torch.jit.ScriptModule):
            return False
    except Exception:  # no usable torch.jit: the hooks do the work
        return False
    modules = getattr(module, "modules", None)
    if modules is None:
        return False
    return not any(type(sub) is cls for sub in modules() if sub is not module)


def _patch_class_call(cls, timer) -> None:
    entry = _patched.get(cls)
    if entry is None:
        entry = _ClassPatch(cls.__dict__.get("__call__"))
        type.__setattr__(cls, "__call__", _timed_call(cls, entry))
        _patched[cls] = entry
    entry.use(timer)


def _unpatch_class_call(cls, timer) -> None:
    entry = _patched.get(cls)
    if entry is None:
        return
    entry.drop(timer)
    if entry.timers:
        return
    del _patched[cls]
    current = cls.__dict__.get("__call__")
    if getattr(current, "_traceml_forward_of", None) is not cls:
        return  # someone patched it again after us: theirs stays (ours passes everything through)
    if entry.own is None:
        type.__delattr__(cls, "__call__")
    else:
        type.__setattr__(cls, "__call__", entry.own)


def _timed_call(cls, patch: _ClassPatch):
    """The class-wide `__call__`: an instrumented instance's call runs inside its timer.

    The instance's timer on the training thread; another thread gets a fresh one (its
    region counts the thread and is ignored), as the automatic patches do. In the
    common case (`recording.fast`, the training thread) the region is this frame's
    locals, no timer call: a re-entrant call records its own, and the sampler keeps
    the outermost.
    """
    timers = _timers
    rec = _rec
    own = patch.own
    # The next __call__ inline (no helper frame: this runs on every call of every
    # instance of the class): the class's own, or the base's, looked up at call time.

    def __call__(self, *args, **kwargs):
        timer = patch.sole
        if timer is None:
            timer = timers.get(id(self))
        if timer is None or not rec.recording or timer.module() is not self:
            return super(cls, self).__call__(*args, **kwargs) if own is None else own(self, *args, **kwargs)
        if rec.fast and _get_ident() == rec.owner:
            capture = rec.active
            if capture is None:
                capture = _se.current_capture()
            t0 = _perf_ns()
            try:
                return super(cls, self).__call__(*args, **kwargs) if own is None else own(self, *args, **kwargs)
            finally:
                t1 = _perf_ns()
                if capture is rec.active and len(capture.events) < _MAX_EVENTS:
                    capture.events.append((RAW_FORWARD, t0, t1, None, None))
                else:
                    close_region(capture, RAW_FORWARD, t0, t1)
        if _get_ident() != rec.owner:
            timer = HookRegionTimer(RAW_FORWARD)
        timer.pre()
        try:
            return super(cls, self).__call__(*args, **kwargs) if own is None else own(self, *args, **kwargs)
        finally:
            timer.post()

    __call__._traceml_forward_of = cls
    __call__.__qualname__ = f"{cls.__qualname__}.__call__"
    __call__.__doc__ = "TraceML forward timing around this class's module call (see traceml.forward)."
    return __call__
