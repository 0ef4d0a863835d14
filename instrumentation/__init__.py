"""TraceML training-side API. Importing this package never imports torch.

    import traceml
    traceml.init()                       # auto mode: patches + samplers (+ exporter)
    for batch in loader:
        with traceml.trace_step(model):  # one TraceML step
            ...
    traceml.shutdown()

See docs/instrumentation.md for modes, lifecycle rules and misuse behaviour.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref

_get_ident = threading.get_ident
_perf_ns = time.perf_counter_ns

from traceml.schema.vocabulary import (
    RAW_BACKWARD,
    RAW_FORWARD,
    RAW_H2D,
    RAW_OPTIMIZER_STEP,
    RAW_STEP_TIME,
)

from . import forward as _forward
from . import settings as _settings
from . import step_events as _se
from . import timing as _timing
from .forward import instrument_forward
from .hooks import TimedIterable, instrument_optimizer
from .memory import StepMemoryTracker
from .records import (
    EventTotals,
    PhaseInterval,
    ResolvedStepTime,
    StepMemorySnapshot,
    TelemetrySink,
)
from .samplers import StepMemorySampler, StepTimeSampler, register_sink, unregister_sink
from .step_events import (
    abort_step_capture,
    complete_step_capture,
    current_capture,
    dropped_counts,
    misuse_counts,
    set_recording,
    steps_completed,
)
from .timing import dataloader_timing_scope, timed_region

__all__ = [
    "init", "shutdown", "trace_step", "is_initialized", "mode",
    "wrap_dataloader", "wrap_forward", "wrap_optimizer", "timed_region", "timed_forward",
    "timed_backward", "timed_h2d", "timed_optimizer_step", "dataloader_timing_scope",
    "register_sink", "unregister_sink", "dropped_counts", "misuse_counts", "steps_completed",
    "set_recording", "current_capture", "complete_step_capture", "abort_step_capture",
    "StepMemoryTracker", "EventTotals", "PhaseInterval", "ResolvedStepTime",
    "StepMemorySnapshot", "TelemetrySink",
]

_log = logging.getLogger("traceml")
_lock = threading.RLock()
_disabled = _settings.kill_switch()
_initialized = False
_mode: str | None = None
_time_sampler: StepTimeSampler | None = None
_memory_sampler: StepMemorySampler | None = None
_exporter_sink = None
_atexit_registered = False
_default_device = None
_open_step = None  # the trace_step currently open (never nested)
_exporter_failure_logged = False


def is_initialized() -> bool:
    return _initialized


def mode() -> str | None:
    """`auto` or `manual` after init, else None."""
    return _mode


def init(mode: str | None = None, *, endpoint: str | None = None, protocol: str | None = None,
         run_id: str | None = None, strategy: str | None = None,
         phase_spans: bool | None = None) -> None:
    """Start TraceML in this process (idempotent; a no-op under TRACEML_DISABLE).

    Starts the two samplers, installs the automatic patches in `auto` mode, and starts
    the OTLP exporter when an endpoint is configured (argument or
    OTEL_EXPORTER_OTLP_ENDPOINT). An invalid mode raises ValueError; a failing
    exporter is logged and training continues without export.
    """
    global _disabled, _initialized, _mode, _time_sampler, _memory_sampler, _exporter_sink
    global _atexit_registered, _default_device
    with _lock:
        config = _settings.read_settings(mode)
        _disabled = config.disabled
        if config.disabled or _initialized:
            return
        _default_device = _detect_default_device()
        if _default_device is not None:
            # Regions before the first step (input wait) get CUDA events too once the
            # job uses CUDA, so step 0 has GPU times for every phase; the first
            # trace_step(model) then decides from the model's device.
            _timing.prepare_gpu_timing()
        mode_now = config.mode
        if mode_now == _settings.MODE_AUTO:
            try:
                from . import patches

                patches.install()
            except Exception:  # e.g. no torch in this process: manual regions still work
                _log.exception("TraceML: automatic patches could not be installed; "
                               "continuing in manual mode")
                mode_now = _settings.MODE_MANUAL
        _time_sampler = StepTimeSampler()
        _memory_sampler = StepMemorySampler()
        _time_sampler.start()
        _memory_sampler.start()
        _exporter_sink = _start_exporter(endpoint=endpoint, protocol=protocol, run_id=run_id,
                                         strategy=strategy, phase_spans=phase_spans)
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_after_fork_in_child)
            _atexit_registered = True
        _mode = mode_now
        _initialized = True
        _se.claim_recording_thread()
        _se.set_recording(True)


def _detect_default_device():
    """`cuda` (no index) when torch is importable and CUDA is available, else None (CPU).

    No index and no CUDA call that creates a context: under torchrun each rank
    selects its device after `init()`; the index is resolved when first needed
    (the first event or the first step's tracker), on the rank's current device.
    """
    if not _timing.cuda_available():
        return None
    import torch

    return torch.device("cuda")


def _start_exporter(**kwargs):
    """Start the OTLP exporter through `traceml.exporter.start_from_settings`, guarded.

    The hook returns a TelemetrySink (or None when no endpoint is configured); it is
    registered here and flushed by `shutdown()`. Any failure is logged once and
    training goes on without export.
    """
    try:
        import traceml.exporter as exporter

        start = getattr(exporter, "start_from_settings", None)
        if start is None:
            return None
        sink = start(**kwargs)
    except Exception:
        global _exporter_failure_logged
        if not _exporter_failure_logged:
            _exporter_failure_logged = True
            _log.exception("TraceML: the OTLP exporter failed to start; training continues without export")
        return None
    if sink is not None:
        register_sink(sink)
    return sink


def shutdown(timeout_s: float = 5.0) -> None:
    """Stop recording, drain both samplers, then flush and close the exporter (idempotent).

    The exporter sink gets `on_run_end(steps_completed, dropped_counts)` (when it has
    that method) after the samplers drained, then `shutdown(timeout_s)`.
    """
    global _initialized, _mode, _time_sampler, _memory_sampler, _exporter_sink
    with _lock:
        if not _initialized:
            return
        _se.set_recording(False)
        for sampler in (_time_sampler, _memory_sampler):
            if sampler is not None:
                try:
                    sampler.stop(timeout_s)
                except Exception:
                    _log.exception("TraceML: sampler drain failed at shutdown")
        sink = _exporter_sink
        if sink is not None:
            unregister_sink(sink)
            try:
                on_run_end = getattr(sink, "on_run_end", None)
                if on_run_end is not None:
                    on_run_end(_se.steps_completed(), _se.dropped_counts())
                close = getattr(sink, "shutdown", None)
                if close is not None:
                    close(timeout_s)
            except Exception:
                _log.exception("TraceML: exporter shutdown failed")
        if _mode == _settings.MODE_AUTO:
            from . import patches

            patches.uninstall()
        _time_sampler = _memory_sampler = _exporter_sink = None
        _reset_tracker_cache()  # a later init re-selects and re-hooks
        _initialized = False
        _mode = None


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) is not the training process: it records nothing.

    Its copies of the sampler threads do not exist after fork; queues and captures
    inherited from the parent are left alone and never published.
    """
    global _initialized, _time_sampler, _memory_sampler, _exporter_sink
    _se.set_recording(False)
    _initialized = False
    _time_sampler = _memory_sampler = _exporter_sink = None


def _shutdown_at_exit() -> None:
    try:
        shutdown(timeout_s=2.0)
    except Exception:
        pass


# --- trace_step ---------------------------------------------------------------------

def _no_model() -> None:
    return None


def _forget_model(ref) -> None:
    """The cached model was collected: drop its tracker with it."""
    if _tracker_cache[0] is ref:
        _reset_tracker_cache()


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


def _reset_tracker_cache() -> None:
    _tracker_cache[0], _tracker_cache[1] = _no_model, None


def _tracker_for(model) -> StepMemoryTracker:
    """Select (and, when decided, cache) the memory tracker for `model`; trace_step
    calls this only when the cache does not hold `model`'s."""
    # Without a model (or one without parameters) the step runs on CUDA only once the
    # job itself initialised CUDA: a CPU job on a GPU machine gets no CUDA context.
    device = _default_device if _timing._cuda_ready() else None
    if model is not None:
        try:
            device = next(model.parameters()).device
        except (StopIteration, AttributeError, TypeError):
            pass
    tracker = StepMemoryTracker(device)
    _timing.configure_gpu_timing(tracker.is_cuda, device_index=tracker.cuda_index)
    if model is not None and _mode == _settings.MODE_AUTO:
        from . import patches

        _time_forward_or_warn(patches.instrument_model, model)
    if tracker.is_cuda or _default_device is None or model is not None:
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

    __slots__ = ("_model", "_capture", "_tracker", "_active", "_t0", "_region")

    def __init__(self, model=None) -> None:
        self._model = model
        self._active = False

    def __enter__(self):
        global _open_step
        if _disabled:
            return self
        if not _initialized:
            _se.warn_once("trace_step_without_init", "trace_step() was called before "
                          "traceml.init(); the step runs untraced")
            return self
        se = _se
        outer = _open_step
        if outer is not None:
            if outer._capture is se._active and se._recording:
                _se.warn_once("nested_trace_step", "trace_step() was nested inside another "
                              "trace_step(); the inner one is ignored and the outer step is kept")
                return self
            # The open step's capture was completed, aborted or discarded elsewhere
            # (its __exit__ never ran, e.g. a framework skipped its end callback):
            # it is superseded; its late __exit__, if any, will do nothing.
            _se.warn_once("superseded_trace_step", "a trace_step() was never exited and its "
                          "capture has ended; it is superseded by the new step")
            _open_step = None
        if not (se._recording and _get_ident() == se._owner) and not se.recording_allowed():
            return self  # recording off (e.g. an integration skipping a group) or another thread
        _open_step = self
        self._active = True
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
        capture = se._active
        self._capture = capture if capture is not None else se.current_capture()
        if tracker._cuda:
            tracker.reset()
        if tracker._cuda or _timing._gpu_default or se.held:
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
        global _open_step
        if not self._active:
            return False
        self._active = False
        if _open_step is not self:
            return False  # superseded (see __enter__): its capture already ended
        _open_step = None
        t1 = _perf_ns()
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


# --- Manual-mode wrappers -------------------------------------------------------------


def wrap_dataloader(iterable):
    """Return an iterable whose `next()` calls are timed as input wait."""
    if _disabled:
        return iterable
    return TimedIterable(iterable)


def wrap_forward(module):
    """Time every call of `module` (the outermost model) as forward; returns the module.

    A module whose calls cannot be timed (not an `nn.Module`, a TorchScript module)
    is returned as it is, with a warning: its steps have no forward region.
    """
    if not _disabled:
        _time_forward_or_warn(instrument_forward, module)
    return module


def _time_forward_or_warn(instrument, module) -> None:
    try:
        instrument(module)
    except Exception as exc:  # telemetry never stops the job
        _se.warn_once("forward_not_timed", f"the calls of {type(module).__name__} cannot be timed as "
                      f"forward ({exc!r}); its steps are traced without a forward region")


def wrap_optimizer(optimizer):
    """Time `optimizer.step()` through its step hooks; returns the optimizer."""
    if not _disabled:
        instrument_optimizer(optimizer)
    return optimizer


# The four region shorthands are timed_region classes without a Python __init__: with
# `with` inside every step, a Python constructor or wrapper would add one frame per region.
timed_forward = _timing.region_type(RAW_FORWARD, "timed_forward")
timed_forward.__doc__ = "`with traceml.timed_forward(): out = model(batch)` (a new timed_region)."

timed_backward = _timing.region_type(RAW_BACKWARD, "timed_backward")
timed_backward.__doc__ = "`with traceml.timed_backward(): loss.backward()` (a new timed_region)."

timed_h2d = _timing.region_type(RAW_H2D, "timed_h2d")
timed_h2d.__doc__ = ("`with traceml.timed_h2d(): batch = batch.to(device, non_blocking=True)` "
                     "(a new timed_region).")

timed_optimizer_step = _timing.region_type(RAW_OPTIMIZER_STEP, "timed_optimizer_step")
timed_optimizer_step.__doc__ = "`with traceml.timed_optimizer_step(): optimizer.step()` (a new timed_region)."


def _reset_for_tests() -> None:
    """Shut down and forget all process state (tests only)."""
    global _disabled, _open_step, _default_device
    shutdown(timeout_s=1.0)
    _forward._reset_for_tests()
    _se._reset_for_tests()
    _timing._reset_for_tests()
    _reset_tracker_cache()
    _disabled = _settings.kill_switch()
    _open_step = None
    _default_device = None
