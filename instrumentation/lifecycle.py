"""TraceML's life in one process: init, shutdown, the forked child, the exit flush.

`init()` starts the two step samplers and the resource sampler (`resources`), installs
the automatic patches in `auto` mode, starts the OTLP exporter when one is configured
and claims the calling thread as the training thread; `shutdown()` undoes all of it in
order (recording off, the samplers drained, the exporter flushed, the patches removed). What the hot path
needs of this (disabled, initialised, mode, default device) is written to
`process_state.session`; the samplers and the exporter sink stay here.
This module does not time anything itself: see `traced_step`, `timing`, `hooks`.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

from . import settings as _settings
from . import sharding
from . import step_boundary
from . import step_events as _se
from . import timing as _timing
from .process_state import session as _session
from .resources import ResourceSampler, start_resource_sampler
from .samplers import StepMemorySampler, StepTimeSampler, register_sink, unregister_sink
from .traced_step import reset_tracker_cache

_log = logging.getLogger("traceml")
_lock = threading.RLock()
_time_sampler: StepTimeSampler | None = None
_memory_sampler: StepMemorySampler | None = None
_resource_sampler: ResourceSampler | None = None
_exporter_sink = None
_atexit_registered = False
_exporter_failure_logged = False


def is_initialized() -> bool:
    return _session.initialized


def mode() -> str | None:
    """`auto` or `manual` after init, else None."""
    return _session.mode


def init(mode: str | None = None, *, endpoint: str | None = None, protocol: str | None = None,
         run_id: str | None = None, strategy: str | None = None,
         phase_spans: bool | None = None) -> None:
    """Start TraceML in this process (idempotent; a no-op under TRACEML_DISABLE).

    Starts the two step samplers and the resource sampler, installs the automatic
    patches in `auto` mode, and starts the OTLP exporter when an endpoint is configured
    (argument, TRACEML_OTLP_ENDPOINT or an OTEL_EXPORTER_OTLP_*ENDPOINT variable). An invalid mode raises ValueError; a failing
    exporter is logged and training continues without export.
    """
    global _time_sampler, _memory_sampler, _resource_sampler, _exporter_sink, _atexit_registered
    session = _session
    with _lock:
        config = _settings.read_settings(mode)
        session.disabled = config.disabled
        if config.disabled or session.initialized:
            return
        # A component below its floor: UnsupportedVersion naming it, before anything is patched.
        from traceml.schema.version_floors import TRAINING, require

        require(TRAINING)
        session.default_device = _detect_default_device()
        if session.default_device is not None:
            # Regions before the first step (input wait) get CUDA events too once the
            # job uses CUDA, so step 0 has GPU times for every phase; the first
            # trace_step(model) then decides from the model's device.
            _timing.prepare_gpu_timing()
        mode_now = config.mode
        if mode_now == _settings.MODE_AUTO:
            try:
                from . import patches

                patches.install()
                step_boundary.arm()  # an unmarked loop's steps: one per optimizer update
            except Exception:  # e.g. no torch in this process: manual regions still work
                _log.exception("TraceML: automatic patches could not be installed; "
                               "continuing in manual mode")
                mode_now = _settings.MODE_MANUAL
        _time_sampler = StepTimeSampler()
        _memory_sampler = StepMemorySampler()
        _time_sampler.start()
        _memory_sampler.start()
        try:
            _resource_sampler = start_resource_sampler()  # None under TRACEML_RESOURCES=0
        except Exception:  # resource figures are optional; the step telemetry is not
            _log.exception("TraceML: the resource sampler could not be started")
            _resource_sampler = None
        _exporter_sink = _start_exporter(endpoint=endpoint, protocol=protocol, run_id=run_id,
                                         strategy=strategy, phase_spans=phase_spans)
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_after_fork_in_child)
            _atexit_registered = True
        session.mode = mode_now
        session.initialized = True
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
    """Stop recording, drain both step samplers, take the resource sampler's last sample, then
    flush and close the exporter (idempotent).

    The exporter sink gets `on_run_end(steps_completed, dropped_counts, step_boundary=...)`
    (when it has that method; `step_boundary.boundary_kind()`) after the samplers
    drained, then `shutdown(timeout_s)`. An auto-mode process that completed no step
    and saw no optimizer update warns once first (`step_boundary.warn_if_no_boundary`).
    """
    global _time_sampler, _memory_sampler, _resource_sampler, _exporter_sink
    session = _session
    with _lock:
        if not session.initialized:
            return
        _end_deep_capture()
        _se.set_recording(False)
        step_boundary.warn_if_no_boundary()
        for sampler in (_time_sampler, _memory_sampler, _resource_sampler):
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
                    on_run_end(_se.steps_completed(), _se.dropped_counts(),
                               step_boundary=step_boundary.boundary_kind())
                close = getattr(sink, "shutdown", None)
                if close is not None:
                    close(timeout_s)
            except Exception:
                _log.exception("TraceML: exporter shutdown failed")
        step_boundary.disarm()
        if session.mode == _settings.MODE_AUTO:
            from . import patches

            patches.uninstall()
        _time_sampler = _memory_sampler = _resource_sampler = _exporter_sink = None
        reset_tracker_cache()  # a later init re-selects and re-hooks
        sharding.reset()  # a later init's model is looked at afresh
        session.initialized = False
        session.mode = None


def _end_deep_capture() -> None:
    """A deep capture that records when the run ends stops and answers with the steps it has
    (`deep_capture.end_of_run`); only where a capture was ever asked for (the module is loaded)."""
    module = sys.modules.get("traceml.deep_capture")
    if module is not None:
        try:
            module.end_of_run()
        except Exception:
            _log.exception("TraceML: the deep capture could not be ended")


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) is not the training process: it records nothing.

    Its copies of the sampler threads do not exist after fork; queues and captures
    inherited from the parent are left alone and never published.
    """
    global _time_sampler, _memory_sampler, _resource_sampler, _exporter_sink
    _se.set_recording(False)
    _session.initialized = False
    _time_sampler = _memory_sampler = _resource_sampler = _exporter_sink = None


def _shutdown_at_exit() -> None:
    try:
        shutdown(timeout_s=2.0)
    except Exception:
        pass
