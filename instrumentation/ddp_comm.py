"""DDP's gradient all-reduce wait, measured at the end of backward around DDP's own wait.

DDP launches one all-reduce per gradient bucket from inside backward, as soon as the
bucket's gradients are ready, and at the end of backward the Reducer's finalize (an
autograd final callback that DDP queues at the first ready gradient) waits for all of
them. What the training thread waits for is the tail: from the moment this rank's
backward graph finished (its last local gradient was ready, so its last bucket was
launched) until DDP's wait returned. That interval is this rank's collective wait:

    wait = end of DDP's finalize - end of the local backward graph

Why this one: a straggler finishes its graph last, when every other rank already
waits inside the last all-reduce, so its wait is short; every other rank finished
earlier and waits until the straggler's buckets arrive, so theirs is long. The rank
with the least wait is the one the others waited for, and
`traceml.collective.last_entry` (the graph's end, seconds from the step's first timed
event) is latest on it. Bucket all-reduces launched earlier overlap with backward
compute and are not waiting. The interval lies inside backward: backward's wall time
still includes it (the processor subtracts it or reports it apart; see
docs/wire-format.md).

The seam (automatic mode): `DistributedDataParallel._pre_forward` is wrapped to note
that the next backward synchronises (grad enabled, `require_backward_grad_sync`, not
under `no_sync()`, not DDP's Python reducer). The backward patch then (`arm`) adds a
pre-hook to the loss's `grad_fn`, which runs before any gradient is ready and
queues an autograd final callback; final callbacks run in the order queued, so ours
(`_graph_done`: the stamp) runs right before DDP's finalize, after every node of the
graph. `finish`, called by the backward patch when `Tensor.backward` returns and before
backward's own end stamp, stamps the end and records one `RAW_COLLECTIVE_WAIT` event.
Nothing of DDP is replaced: no communication hook is registered, so a user's own hook
(Python or builtin) is untouched and DDP's buckets cost TraceML nothing; the cost is a
few Python calls per synchronising backward.

Clock: CPU stamps always; on a CUDA run (the process timing policy) also a CUDA event
recorded in the final callback (the autograd engine has synchronised the graph's
streams with the caller's stream by then) and one recorded when backward returns, on
the training thread's current stream, which DDP's NCCL wait made wait for the
all-reduce: their distance is the stream's wait. Nothing is synchronised. On NCCL the
CPU interval is only how long finalize took to enqueue the waits; read the GPU time.
"""
from __future__ import annotations

import time

from traceml.schema.vocabulary import RAW_COLLECTIVE_WAIT

from . import step_events as _se
from .process_state import recording as _rec
from .process_state import timing_policy as _policy

_perf_ns = time.perf_counter_ns


class SyncState:
    """Whether the next backward synchronises a DDP module, and the armed backward's stamps."""

    __slots__ = ("expected", "handle", "ready_ns", "gpu_ready")

    def __init__(self) -> None:
        self.expected = False  # a DDP forward ran that the next backward synchronises
        self.handle = None  # the armed pre-hook on the loss's grad_fn (removed by finish)
        self.ready_ns = 0  # when the backward graph finished (0: not yet)
        self.gpu_ready = None


state = SyncState()


def _graph_done() -> None:
    """Autograd final callback queued before DDP's finalize: the local gradients are all ready."""
    state.ready_ns = _perf_ns()
    if _policy.gpu_default and _policy.pool is not None:
        try:
            event = _policy.pool.acquire()
            event.record()
            state.gpu_ready = event
        except Exception:
            state.gpu_ready = None


def _queue_graph_done(_grad_outputs):
    """Pre-hook of the loss's grad_fn (runs first in backward): queue `_graph_done`."""
    if state.handle is not None:
        import torch

        torch.autograd.Variable._execution_engine.queue_callback(_graph_done)
    return None


def arm(tensor) -> None:
    """Before a synchronising `tensor.backward()`: have the graph's end stamped (training thread)."""
    state.expected = False
    grad_fn = tensor.grad_fn
    if grad_fn is None:
        return
    state.ready_ns = 0
    state.gpu_ready = None
    try:
        state.handle = grad_fn.register_prehook(_queue_graph_done)
    except Exception:  # telemetry never breaks the backward
        state.handle = None


def finish() -> None:
    """When the armed backward returned (before backward's end stamp): record the wait."""
    end = _perf_ns()
    handle, state.handle = state.handle, None
    if handle is not None:
        handle.remove()
    ready, g0 = state.ready_ns, state.gpu_ready
    state.ready_ns, state.gpu_ready = 0, None
    pool = _policy.pool
    if not ready:
        if g0 is not None and pool is not None:
            pool.release(g0)
        return
    g1 = None
    if g0 is not None:
        try:
            g1 = pool.acquire()
            g1.record()
        except Exception:
            pool.release(g0)
            g0 = g1 = None
    event = (RAW_COLLECTIVE_WAIT, ready, end if end > ready else ready, g0, g1)
    capture = _rec.active
    if capture is not None and len(capture.events) < _se.MAX_EVENTS_PER_CAPTURE:
        capture.events.append(event)  # record_timing_event's common case, inline
    elif not _se.record_timing_event(event) and g0 is not None:
        pool.release(g0)
        pool.release(g1)


def install(patch) -> bool:
    """Wrap `DistributedDataParallel._pre_forward` (notes that the next backward synchronises)."""
    try:
        import torch
        import torch.distributed as dist

        if not dist.is_available():
            return False
        from torch.nn.parallel import DistributedDataParallel as DDP
    except Exception:
        return False
    pre_forward = DDP.__dict__.get("_pre_forward")
    if pre_forward is None:
        return False
    grad_enabled = torch.is_grad_enabled
    sync = state

    def _pre_forward(self, *inputs, **kwargs):
        # _use_python_reducer (compiled autograd's reducer) is newer than torch 2.1: absent means off.
        if _rec.recording and self.require_backward_grad_sync and grad_enabled() \
                and not getattr(self, "_use_python_reducer", False):
            sync.expected = True
        return pre_forward(self, *inputs, **kwargs)

    _pre_forward.__wrapped__ = pre_forward
    patch(DDP, "_pre_forward", _pre_forward)
    return True
