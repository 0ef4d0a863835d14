"""`trace_step`: the context manager around one training step, and its memory-tracker cache.

The step begins the capture (keeping input events recorded since the last step),
resets the tracked device's peak memory, times the block as the traced step, reads
memory and completes the capture. Which device a step tracks is decided from the
model the first time it is seen and cached (through a weak reference) until
another model comes or `shutdown()` resets it.

It runs on every step of the job, so its common path calls as few Python
functions as it can (see docs/performance.md); what it reads per step is in
`process_state`. When the job uses OpenTelemetry itself, the step also notes the
job's current span context, so the step span joins the job's trace. It never starts or stops TraceML: that is `lifecycle`.
(Not named `trace_step.py`: importing a submodule binds its name on the package,
which would shadow `traceml.trace_step`.)
"""
from __future__ import annotations

import sys
import threading
import time
import weakref

from traceml.schema.vocabulary import RAW_STEP_TIME

from . import settings as _settings
from . import step_events as _se
from . import timing as _timing
from .forward import time_forward_or_warn
from .memory import StepMemoryTracker
from .process_state import recording as _rec
from .process_state import session as _session
from .process_state import timing_policy as _policy
from .step_events import abort_step_capture, complete_step_capture
from .timing import timed_region

_get_ident = threading.get_ident
_perf_ns = time.perf_counter_ns
_modules = sys.modules
_OTEL_TRACE = "opentelemetry.trace"


def _no_model() -> None:
    return None


def _forget_model(ref) -> None:
    """The cached model was collected: drop its tracker with it."""
    if _tracker_cache[0] is ref:
        reset_tracker_cache()


def _model_ref(model):
    """A callable returning `model`: a weak reference, so that the cache never keeps a
    model the job dropped (and its device memory) alive; a strong one for objects
    that refuse weak references."""
    if model is None:
        return _no_model
    try:
        return weakref.ref(model, _forget_model)
    except TypeError:
        return lambda: model


_tracker_cache: list = [_no_model, None]  # [the last model's _model_ref, its tracker]
_step_region = timed_region(RAW_STEP_TIME)


def reset_tracker_cache() -> None:
    """Forget the cached model and tracker: the next step selects (and in auto mode hooks) again."""
    _tracker_cache[0], _tracker_cache[1] = _no_model, None


def tracked_cuda_index() -> int | None:
    """The CUDA device index the steps' memory tracker follows (None: no step yet, or not CUDA).

    For the resource sampler's thread, which must not ask CUDA for its own current
    device (that is per thread): one read of the cache, no lock.
    """
    tracker = _tracker_cache[1]
    return None if tracker is None else tracker.cuda_index


def _tracker_for(model) -> StepMemoryTracker:
    """Select (and, when decided, cache) the memory tracker for `model`; trace_step
    calls this only when the cache does not hold `model`'s."""
    # Without a model (or one without parameters) the step runs on CUDA only once the
    # job itself initialised CUDA: a CPU job on a GPU machine gets no CUDA context.
    default_device = _session.default_device
    device = default_device if _timing.cuda_in_use() else None
    if model is not None:
        try:
            device = next(model.parameters()).device
        except (StopIteration, AttributeError, TypeError):
            pass
    tracker = StepMemoryTracker(device)
    _timing.configure_gpu_timing(tracker.is_cuda, device_index=tracker.cuda_index)
    if model is not None and _session.mode == _settings.MODE_AUTO:
        from . import patches

        time_forward_or_warn(model, patches.instrument_model)
    if tracker.is_cuda or default_device is None or model is not None:
        _tracker_cache[0] = _model_ref(model)
        _tracker_cache[1] = tracker
    # else: decided "CPU" only because CUDA is not in use yet; ask again next step.
    return tracker


class trace_step:
    """Context manager around one training step (or accumulation group).

    Begins the capture (keeping input events recorded since the last step), resets
    the tracked device's peak memory, times the block as the traced step, reads
    memory and completes the capture. An exception aborts the capture (the step
    counter does not move) and propagates unchanged. `model` selects the tracked
    device and, in auto mode, gets forward timing on that outermost module (`forward`).
    (A class rather than a function returning one: one call less per step.)
    """

    __slots__ = ("_model", "_capture", "_tracker", "_t0", "_region")

    def __init__(self, model=None) -> None:
        self._model = model

    def __enter__(self):
        session = _session
        rec = _rec
        # The common case first: initialised, no step open or inferred, the CPU fast
        # path (`recording.fast`) on the training thread, and the cached tracker is this
        # model's, off CUDA. It reads `session`, `recording` and the tracker cache only.
        if (rec.fast and session.initialized and session.open_step is None and not session.inferring
                and not session.disabled and _get_ident() == rec.owner):
            cached_model, tracker = _tracker_cache  # one bytecode: a consistent pair
            if tracker is not None and not tracker._cuda and cached_model() is self._model:
                capture = rec.active
                if capture is None:
                    capture = _se.current_capture()
                otel = _modules.get(_OTEL_TRACE)  # the job's own span (see below)
                if otel is not None:
                    try:
                        capture.parent = otel.get_current_span().get_span_context()
                    except Exception:
                        capture.parent = None
                session.open_step = self
                self._capture = capture
                self._tracker = tracker
                self._region = None
                self._t0 = _perf_ns()
                return self
        if session.disabled:
            return self
        if not session.initialized:
            _se.warn_once("trace_step_without_init", "trace_step() was called before "
                          "traceml.init(); the step runs untraced")
            return self
        if session.inferring:  # the first explicit step: inferred boundaries stop for good
            from .step_boundary import claim_explicit

            claim_explicit()
        se = _se
        outer = session.open_step
        if outer is not None:
            if outer._capture is rec.active and rec.recording:
                _se.warn_once("nested_trace_step", "trace_step() was nested inside another "
                              "trace_step(); the inner one is ignored and the outer step is kept")
                return self
            # The open step's capture was completed, aborted or discarded elsewhere
            # (its __exit__ never ran, e.g. a framework skipped its end callback):
            # it is superseded; its late __exit__, if any, will do nothing.
            _se.warn_once("superseded_trace_step", "a trace_step() was never exited and its "
                          "capture has ended; it is superseded by the new step")
            session.open_step = None
        if not (rec.recording and _get_ident() == rec.owner) and not se.recording_allowed():
            return self  # recording off (e.g. an integration skipping a group) or another thread
        session.open_step = self
        model = self._model
        cached_model, tracker = _tracker_cache  # one bytecode: a consistent pair
        if tracker is None or cached_model() is not model:
            try:
                tracker = _tracker_for(model)
            except Exception as exc:  # e.g. a broken CUDA while selecting the device: time on the CPU
                _se.warn_once("model_not_usable", f"trace_step({type(model).__name__}) could not "
                              f"select a device ({exc!r}); the step is timed on the CPU clock "
                              "without forward timing from the model")
                tracker = StepMemoryTracker(None)
                _tracker_cache[0], _tracker_cache[1] = _model_ref(model), tracker
        self._tracker = tracker
        capture = rec.active
        capture = self._capture = capture if capture is not None else se.current_capture()
        # The job's own OpenTelemetry span current now becomes the step span's parent.
        # Only when the job imported OpenTelemetry (we never do): otherwise one dict
        # lookup. Just the immutable SpanContext is kept; the exporter reads it later.
        otel = _modules.get(_OTEL_TRACE)
        if otel is not None:
            try:
                capture.parent = otel.get_current_span().get_span_context()
            except Exception:  # someone else's context machinery must not break the step
                capture.parent = None
        if tracker._cuda:
            tracker.reset()
        if tracker._cuda or _policy.gpu_default or se.held:
            region = self._region = _step_region  # reused: trace_step never nests
            region._state = 0
            region._g0 = None
            region._gpu = None
            region.__enter__()
            return self
        # CPU: the step's own region is just its start stamp (see __exit__).
        self._region = None
        self._t0 = _perf_ns()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        t1 = _perf_ns()
        session = _session
        if session.open_step is not self:
            # Never opened (a pass-through: nested, untraced, recording off), already
            # closed, or superseded (see __enter__): its capture already ended.
            return False
        session.open_step = None
        region = self._region
        if region is None:
            # CPU: the step's event, a memory reading without peaks (as the tracker's
            # read() gives off CUDA) and the completion, in one call.
            if exc_type is None:
                complete_step_capture(self._capture, (RAW_STEP_TIME, self._t0, t1, None, None),
                                      self._tracker.device)
            else:
                abort_step_capture(self._capture)
            return False
        region.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            abort_step_capture(self._capture)
            return False
        self._tracker.read()
        complete_step_capture(self._capture)
        return False
