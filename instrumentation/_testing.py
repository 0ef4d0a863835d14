"""The test seam: `reset_for_tests()` returns the training side to the state of a fresh process.

A test suite runs many TraceML sessions in one interpreter, and some state outlives
`traceml.shutdown()` on purpose (in a job it lives as long as the process): the step
counter, the bounded queues and their drop counts, the misuse warnings already given,
the timing policy, `wrap_forward`'s class wrappers, the optimizer-boundary state, the
kill switch read at import, and the ending `traceml run`'s bootstrap noted. Between
tests all of it has to go.

This module is the one place that knows how; product modules carry no test code and
never import it, so it costs a job nothing (nothing on the import path of `traceml`
or of the step loads it). It reaches into those modules' private state by design:
each reset below names the module whose state it forgets, and a change to that
state's shape is mirrored here (tests/instrumentation exercise every piece).
Tests call `reset_for_tests()` before and after a session (tests/instrumentation's
conftest, the integration and exporter tests); see docs/instrumentation.md, "Testing
with TraceML".
"""
from __future__ import annotations

import sys

from . import forward, lifecycle, step_boundary, step_events
from .process_state import recording, session, timing_policy
from .settings import kill_switch
from .traced_step import reset_tracker_cache


def reset_for_tests() -> None:
    """Shut TraceML down and forget all process state, as a fresh process has it."""
    lifecycle.shutdown(timeout_s=1.0)
    _forget_deep_capture()
    _forget_forward_timing()
    _forget_step_events()
    _forget_timing_policy()
    _forget_step_boundary()
    reset_tracker_cache()
    session.disabled = kill_switch()
    session.open_step = None
    session.default_device = None
    _forget_noted_ending()


def _forget_deep_capture() -> None:
    """`deep_capture`: nothing armed or recording, no step-end hook. Only where it was loaded."""
    module = sys.modules.get("traceml.deep_capture")
    if module is not None:
        module.reset()


def _forget_forward_timing() -> None:
    """`forward`: undo every module's forward timing (`wrap_forward` outlives shutdown())."""
    with forward._lock:
        while forward._timers:
            forward._release(forward._timers.popitem()[1])


def _forget_step_events() -> None:
    """`step_events`: the step counter, both queues, drop counts, holds, warnings, the owner."""
    recording.active = None
    recording.recording = False
    recording.fast = recording.loader_fast = False
    recording.owner = None
    step_events._next_step = 0
    step_events._timing_queue = step_events.BoundedDropQueue()
    step_events._memory_queue = step_events.BoundedDropQueue()
    step_events._events_dropped = 0
    step_events._foreign_dropped = 0
    step_events.held.clear()
    step_events._warned.clear()
    step_events._misuse.clear()


def _forget_timing_policy() -> None:
    """`timing`'s policy (`process_state.timing_policy`): the CPU clock by default, no CUDA event pool, DataLoader waits timed."""
    timing_policy.gpu_default = timing_policy.gpu_undecided = False
    timing_policy.pool = None
    timing_policy.dataloader_timing = True
    step_events.refresh_fast_path()


def _forget_step_boundary() -> None:
    """`step_boundary`: unarmed, and no optimizer, model or explicit claim remembered."""
    step_boundary.disarm()
    step_boundary._state = step_boundary.BoundaryState()


def _forget_noted_ending() -> None:
    """`traceml.exporter.process_ending`: no ending noted. Only where it was loaded: this
    seam does not load the exporter itself."""
    module = sys.modules.get("traceml.exporter.process_ending")
    if module is not None:
        module.note_ending(None)  # type: ignore[arg-type]


__all__ = ["reset_for_tests"]
