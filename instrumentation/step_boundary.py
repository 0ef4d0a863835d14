"""Inferred step boundaries: in automatic mode an unmarked loop gets one step per optimizer update.

A job run with `traceml run` (or `traceml.init()` in auto mode) that never calls
`trace_step` still has a natural step: the optimizer update. A global optimizer
step post-hook, registered after the optimizer-step timer's, ends one step at the
end of every update of the *boundary optimizer*; the step runs from the end of the
previous update (for the first step: the start of the first event timed since
`init()`) to the end of this one, input wait included. The rule, exactly:

- The first update also runs one full garbage collection, outside every step
  (`_settle_garbage`: the pending full pass of the import-time objects otherwise
  lands inside a step's region, usually the DataLoader's collate).
- Gradient accumulation needs nothing: a step is an update, however many
  backward passes fed it (accelerate's `AcceleratedOptimizer` only calls the
  inner optimizer on real updates, so a skipped micro-batch step is not one).
- Several optimizers: one step per update round. The boundary optimizer is the
  first one seen, replaced by any other that steps after it before any backward
  has run since its update (the later optimizers of the same round:
  `opt_a.step(); opt_b.step()` ends the round with `opt_b`). The first time an
  optimizer steps after a backward that followed the boundary's update (a GAN's
  generator after the discriminator), or the boundary steps a second time, the
  rule is fixed for the rest of the process. Only the first round can end early.
- No optimizer update at all (inference, evaluation): no step is guessed;
  `shutdown` warns once and the end marker says so (`boundary_kind()`).
- An explicit boundary always wins: the first `trace_step` entered in the process,
  or an integration that marks its own steps (HF Trainer, Lightning) calling
  `claim_explicit()`, removes the hook for good. Inferred steps already published
  stay (they are earlier, distinct steps); events recorded since the last inferred
  boundary are the pending capture the explicit step adopts, as for any step.

The step's own event is `INFERRED_STEP` (training side only, never on the wire):
the timing sampler turns it into the traced step time (`traced_totals`): the
whole interval minus the step's input wait, so that Step Time = Input Wait +
Traced Step Time holds as for a `trace_step` around everything after `next()`.
A step in which no DataLoader `next()` was timed (a generator, a memory-mapped
`get_batch`, tensors the loop makes) gets as its input wait the time from its start
to its first timed phase (`before_forward_wait`, on the sampler thread).

Forward timing (auto mode times only the outermost module, which `trace_step(model)`
names): when an optimizer is built (`Optimizer.__init__`, patched while armed), the
outermost module holding its first parameter (`model_search`) gets forward timing,
unless an integration already named it (`note_model`, e.g. `Accelerator.prepare`).
An optimizer built before `init()` is looked at on its first update instead (then
the first step has no forward), outside the step's measured interval.
"""
from __future__ import annotations

import functools
import gc
import threading
import time
import warnings
import weakref

from traceml.schema.vocabulary import (
    RAW_BACKWARD,
    RAW_DATALOADER_NEXT,
    RAW_STEP_TIME,
    STEP_BOUNDARY_EXPLICIT,
    STEP_BOUNDARY_NONE,
    STEP_BOUNDARY_OPTIMIZER,
)

from . import step_events as _se
from .records import EventTotals
from .process_state import recording as _rec
from .process_state import session as _session
from .process_state import timing_policy as _policy

INFERRED_STEP = "_traceml_internal:inferred_step"
"""The raw event of an inferred step's whole interval; resolved into RAW_STEP_TIME by the sampler."""

_perf_ns = time.perf_counter_ns
_get_ident = threading.get_ident
_MAX_EVENTS = _se.MAX_EVENTS_PER_CAPTURE


def _nothing() -> None:
    return None


class BoundaryState:
    """The inferred-boundary state of the process (training thread only, except `arm`/`disarm`)."""

    __slots__ = ("handle", "init_patch", "explicit", "boundary", "fixed", "start_ns", "g0",
                 "tracker", "seen", "models", "updates", "inferred_steps", "warned")

    def __init__(self) -> None:
        self.handle = None  # the global post-hook's RemovableHandle while armed
        self.init_patch = None  # (Optimizer, its own __init__, ours) while armed
        self.explicit = False  # a trace_step or an integration owns the boundaries (for good)
        self.boundary = _nothing  # weakref to the boundary optimizer
        self.fixed = False  # the boundary optimizer can no longer change
        self.start_ns: int | None = None  # the current inferred step's start (None: first step)
        self.g0 = None  # CUDA event recorded at the last boundary (the next step's GPU start)
        self.tracker = None  # StepMemoryTracker of the boundary optimizer's device
        self.seen = weakref.WeakSet()  # optimizers whose model was looked for
        self.models: list = []  # weak references to modules noted by integrations
        self.updates = 0  # optimizer updates seen while armed
        self.inferred_steps = 0  # steps this module published
        self.warned = False


_state = BoundaryState()
_lock = threading.Lock()


# --- arming (lifecycle) ---------------------------------------------------------------


def arm() -> bool:
    """Register the boundary hook (auto mode, `init`); False when an explicit boundary was claimed."""
    with _lock:
        st = _state
        if st.explicit or st.handle is not None:
            return st.handle is not None
        from torch.optim.optimizer import Optimizer, register_optimizer_step_post_hook

        st.handle = register_optimizer_step_post_hook(_on_update)
        _patch_optimizer_init(Optimizer)
        _session.inferring = True
        return True


def _patch_optimizer_init(optimizer_type) -> None:
    """Find each new optimizer's model when it is built: forward is then timed from step 0."""
    original = optimizer_type.__dict__["__init__"]

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if _session.inferring:
            try:
                _model_for(self)
            except Exception:  # telemetry never breaks the job's optimizer
                pass

    optimizer_type.__init__ = __init__
    _state.init_patch = (optimizer_type, original, __init__)


def _unpatch_optimizer_init() -> None:
    patch, _state.init_patch = _state.init_patch, None
    if patch is not None:
        owner, original, ours = patch
        if owner.__dict__.get("__init__") is ours:  # someone patched over us since: theirs stays
            owner.__init__ = original


def disarm() -> None:
    """Remove the hook (shutdown); a later `init` arms again unless explicit was claimed."""
    with _lock:
        st = _state
        _session.inferring = False
        handle, st.handle = st.handle, None
        if handle is not None:
            handle.remove()
        _unpatch_optimizer_init()
        st.g0 = None


def claim_explicit() -> None:
    """An explicit boundary owns this process's steps from now on: inferred ones stop for good.

    `trace_step` calls it on its first entry while the hook is armed; integrations
    that complete captures themselves (HF Trainer, Lightning) call it before
    training starts.
    """
    _state.explicit = True
    disarm()


def is_inferring() -> bool:
    return _session.inferring


def note_model(model) -> None:
    """An integration knows the trained model (e.g. `Accelerator.prepare`): time its forward now.

    Only while inferring (auto mode, no explicit boundary): `trace_step(model)`
    does this itself otherwise. The first update of an optimizer whose first
    parameter this model holds then skips the search.
    """
    if not _session.inferring:
        return
    from . import model_search

    if model_search.instrument(model):
        try:
            _state.models.append(weakref.ref(model))
        except TypeError:
            pass


def boundary_kind() -> str:
    """How this process's steps were delimited, for the end marker (`traceml.steps.boundary`)."""
    st = _state
    if st.explicit:
        return STEP_BOUNDARY_EXPLICIT
    if st.inferred_steps:
        return STEP_BOUNDARY_OPTIMIZER if st.inferred_steps == _se.steps_completed() else STEP_BOUNDARY_EXPLICIT
    return STEP_BOUNDARY_EXPLICIT if _se.steps_completed() else STEP_BOUNDARY_NONE


def warn_if_no_boundary() -> None:
    """At shutdown: an auto-mode process that saw no update and no explicit step says so, once."""
    st = _state
    if st.warned or st.explicit or st.handle is None or st.updates or _se.steps_completed():
        return
    st.warned = True
    # Raised at shutdown (often at interpreter exit): no line of the job's code caused
    # it, so the warning names TraceML rather than a source line.
    warnings.warn_explicit(
        "TraceML: no step was recorded in this process: no optimizer.step() ran and no "
        "traceml.trace_step() marked a step (an inference or evaluation loop?). Steps are "
        "inferred from optimizer updates only; mark steps with `with traceml.trace_step(model):`.",
        RuntimeWarning, filename="traceml", lineno=0, module="traceml")


# --- the hook (training thread) ----------------------------------------------------------


def _on_update(optimizer, _args, _kwargs) -> None:
    """Global optimizer step post-hook: end the step at the boundary optimizer's update."""
    rec = _rec
    if not rec.recording or _get_ident() != rec.owner:
        return
    st = _state
    st.updates += 1
    if optimizer is st.boundary():
        st.fixed = True  # its second update at the latest: the round is known
        _end_step(st)
        return
    _other_update(st, optimizer)


def _other_update(st: BoundaryState, optimizer) -> None:
    """An update of an optimizer that is not (yet) the boundary: learn the round."""
    if st.boundary() is None:  # the first update of the process
        _adopt(st, optimizer)
        _end_step(st)
        if optimizer not in st.seen:  # built before init(): look for its model now
            _model_for(optimizer)
        _settle_garbage()
        st.start_ns = _perf_ns()  # the search and the collection are not part of the next step
        return
    if not st.fixed:
        if _backward_since_boundary():
            st.fixed = True  # a new round began with this optimizer: the boundary stays
        else:
            _adopt(st, optimizer)  # a later optimizer of the same round ends it
    if optimizer not in st.seen:
        _model_for(optimizer)


def _settle_garbage() -> None:
    """One full garbage collection at the process's first update, between two inferred steps.

    A process that has just imported torch (and its model's libraries) holds a few
    hundred thousand objects that no full collection has seen yet; CPython runs one
    when the objects promoted since the last full pass exceed a quarter of those it
    saw then, at whatever allocation comes next. TraceML's own per-step allocations
    bring that moment into the first tens of steps, and its pause landed in whatever
    region was allocating, mostly the DataLoader's collate: a one-off input wait and
    step that the job, run without TraceML, did not have in those steps (figures in
    docs/compatibility.md, the newest column's note).
    Collected here, the pause is paid once outside every measured step (the caller
    starts the next step after it), and the next automatic full pass is far away
    (it needs a quarter as many new long-lived objects as the process then holds).
    """
    gc.collect()


def _adopt(st: BoundaryState, optimizer) -> None:
    try:
        st.boundary = weakref.ref(optimizer)
    except TypeError:
        st.boundary = lambda: optimizer
    if st.tracker is None:
        _choose_tracker(st, optimizer)


def _backward_since_boundary() -> bool:
    capture = _rec.active
    if capture is None:
        return False
    for event in reversed(capture.events):
        if event[0] == RAW_BACKWARD:
            return True
    return False


def _choose_tracker(st: BoundaryState, optimizer) -> None:
    """The memory tracker and clock of inferred steps: the optimizer's first parameter's device."""
    from . import timing as _timing
    from .memory import StepMemoryTracker

    device = None
    try:
        device = optimizer.param_groups[0]["params"][0].device
    except Exception:
        pass
    try:
        tracker = StepMemoryTracker(device)
    except Exception:
        tracker = StepMemoryTracker(None)
    st.tracker = tracker
    _timing.configure_gpu_timing(tracker.is_cuda, device_index=tracker.cuda_index)


def _model_for(optimizer) -> None:
    """Time the forward of the outermost module holding `optimizer`'s first parameter (once)."""
    from . import model_search

    try:
        _state.seen.add(optimizer)
    except TypeError:
        pass
    try:
        param = optimizer.param_groups[0]["params"][0]
    except Exception:
        return
    for ref in _state.models:
        model = ref()
        if model is not None and model_search.holds(model, param):
            return
    model = model_search.outermost_module_holding(param)
    if model is not None:
        model_search.instrument(model)


def _end_step(st: BoundaryState) -> None:
    """Complete the capture as one step: [start, now], plus memory (CUDA) or its device label."""
    t1 = _perf_ns()
    capture = _rec.active
    if capture is None:
        capture = _se.current_capture()
    start = st.start_ns
    if start is None:  # the first step starts with the first event timed since init()
        events = capture.events
        start = min([e[1] for e in events]) if events else t1
    tracker = st.tracker
    g0, g1 = st.g0, None
    cuda = tracker is not None and tracker._cuda
    if cuda and _policy.pool is not None:
        try:
            g1 = _policy.pool.acquire()
            g1.record()
            st.g0 = _policy.pool.acquire()
            st.g0.record()
        except Exception:
            g0 = g1 = st.g0 = None
    if g1 is None:
        g0 = None
    event = (INFERRED_STEP, start, t1, g0, g1)
    st.start_ns = t1
    if cuda:
        if len(capture.events) < _MAX_EVENTS:
            capture.events.append(event)
        tracker.read()
        step = _se.complete_step_capture(capture)
        tracker.reset()
    else:
        step = _se.complete_step_capture(capture, event,
                                         tracker.device if tracker is not None else "cpu")
    if step is not None:
        st.inferred_steps += 1


# --- the sampler side ------------------------------------------------------------------


def before_forward_wait(ordered: list, gpu_available: bool = True):
    """The input wait of an inferred step in which no DataLoader was seen: the host time from
    the end of the previous update (the step's start) to the first phase timed after it (the
    forward, or a copy or collective that precedes it). That interval holds the batch fetch of
    any reader the loop uses instead of a DataLoader (a generator, a memory-mapped
    `get_batch`, tensors it makes) and whatever host work comes before forward.

    Sampler thread, from the stamps the step already holds (nothing more is recorded on the
    training thread); `ordered`: the step's events sorted by start, CUDA events not yet
    released. Returns `EventTotals(cpu_ms, gpu_ms, 0)`: a count of 0 says no `next()` was
    timed (the wire and the store keep it: `input_wait_count` = 0), so the processor can say
    "input wait measured as the time before forward". The GPU value is the time between the
    CUDA event recorded at the previous update and the first phase's start event, when both
    exist. None when the step has no DataLoader-free shape to measure (no inferred interval,
    or no phase after its start).
    """
    step = first = None
    for event in ordered:  # plain loops: a generator's frame costs more than these few events
        if event[0] == INFERRED_STEP:
            step = event
            break
    if step is None:
        return None
    start = step[1]
    for event in ordered:
        if event[1] >= start and event is not step:
            first = event
            break
    if first is None:
        return None
    gpu = None
    g0, g1 = step[3], first[3]
    if gpu_available and g0 is not None and g1 is not None:
        try:
            gpu = max(0.0, float(g0.elapsed_time(g1)))
        except Exception:
            gpu = None
    return tuple.__new__(EventTotals, (max(0, first[1] - step[1]) / 1e6, gpu, 0))


def resolve_inferred(totals: dict, phases: tuple) -> tuple:
    """An inferred step's interval becomes its traced step time (sampler thread, in place).

    In `totals`: traced = the interval minus the input wait timed inside it (a
    DataLoader's, or the time before forward, `before_forward_wait`), CPU and GPU
    apart (GPU: None unless both are known), so Step Time = Input Wait + Traced. In
    `phases` (returned): the interval is named as the traced step, and a wait measured
    before forward gets its own interval at the step's start.
    """
    inferred = totals.pop(INFERRED_STEP, None)
    if inferred is None:
        return phases
    cpu, gpu = inferred[0], inferred[1]
    wait = totals.get(RAW_DATALOADER_NEXT)
    if wait is not None:
        cpu = max(0.0, cpu - wait[0])
        gpu = None if gpu is None or wait[1] is None else max(0.0, gpu - wait[1])
    traced = totals.get(RAW_STEP_TIME)
    if traced is not None:  # an integration's own segments in the same step (never expected)
        cpu += traced[0]
        gpu = None if gpu is None or traced[1] is None else gpu + traced[1]
    totals[RAW_STEP_TIME] = tuple.__new__(type(inferred), (cpu, gpu, 1))
    before_ns = None if wait is None or wait[2] else int(wait[0] * 1e6)  # measured before forward
    out = []
    for p in phases:
        if p[0] == INFERRED_STEP:
            if before_ns is not None:  # its interval for the trace, at the step's start
                out.append(tuple.__new__(type(p), (RAW_DATALOADER_NEXT, p[1], p[1] + before_ns)))
            p = tuple.__new__(type(p), (RAW_STEP_TIME, p[1], p[2]))
        out.append(p)
    return tuple(out)
