"""Automatic mode: reversible patches that time the five regions without code changes.

Installed once per process by `traceml.init(mode="auto")`, removed by `uninstall()`:
- DataLoader iteration: `_BaseDataLoaderIter.__next__` (input wait,
  honouring `dataloader_timing_scope`; CUDA events too on CUDA runs);
- backward: `torch.Tensor.backward`;
- host-to-device copies: `torch.Tensor.to` / `torch.Tensor.cuda`, counted only when a
  CPU tensor really goes to a CUDA device; not patched at all where CUDA is not
  available (no call can be one there);
- optimizer step: global optimizer step pre/post hooks;
- collective wait: the torch.distributed collectives and `Work.wait` (`collectives`),
  and DDP's gradient all-reduce wait at the end of each synchronising
  `Tensor.backward` (`ddp_comm`);
- forward: the outermost module only (see `forward`), instrumented by
  `trace_step(model)` or `instrument_model(model)` (a global module hook would slow
  every submodule call).
"""
from __future__ import annotations

import threading
import time
import weakref

from . import collectives as _collectives
from . import ddp_comm as _ddp_comm
from . import forward as _forward
from . import hooks as _hooks
from . import step_events as _se
from . import timing as _timing
from .process_state import recording as _rec
from .timing import timed_region

_get_ident = threading.get_ident
_perf_ns = time.perf_counter_ns

_lock = threading.Lock()
_installed = False
_originals: list = []  # (owner, attribute, original)
_handles: list = []
_models: list = []  # weak references to modules given forward timing in auto mode
_optimizer_timer: _hooks.OptimizerTimer | None = None


def is_installed() -> bool:
    return _installed


_MISSING = object()


def _patch(owner, name: str, replacement) -> None:
    # An inherited attribute (Tensor.to lives on torch._C.TensorBase) is shadowed,
    # then deleted again on uninstall.
    _originals.append((owner, name, owner.__dict__.get(name, _MISSING)))
    setattr(owner, name, replacement)


def install() -> bool:
    """Install every automatic patch; returns False when they were already installed."""
    global _installed, _optimizer_timer
    with _lock:
        if _installed:
            return False
        import torch
        from torch.utils.data import dataloader as _dl

        from traceml.schema.vocabulary import RAW_BACKWARD

        iter_cls = _dl._BaseDataLoaderIter
        orig_next = iter_cls.__dict__["__next__"]

        _patch(iter_cls, "__next__", _hooks.timed_next_method(orig_next))

        tensor_cls = torch.Tensor
        orig_backward = tensor_cls.__dict__["backward"]
        backward_timer = _hooks.HookRegionTimer(RAW_BACKWARD)
        ddp_sync = _ddp_comm.state
        ddp_arm, ddp_finish = _ddp_comm.arm, _ddp_comm.finish
        current_capture, close_region = _se.current_capture, _hooks.close_region
        max_events = _se.MAX_EVENTS_PER_CAPTURE

        def backward(self, *args, **kwargs):
            rec = _rec
            if rec.fast and _get_ident() == rec.owner:
                # The common case, as one region in this frame's locals (no timer call):
                # a nested backward records its own, and the sampler keeps the outermost.
                capture = rec.active
                if capture is None:
                    capture = current_capture()
                t0 = _perf_ns()
                if ddp_sync.expected:
                    ddp_arm(self)  # a DDP forward ran: time DDP's gradient all-reduce wait (ddp_comm)
                try:
                    return orig_backward(self, *args, **kwargs)
                finally:
                    if ddp_sync.handle is not None:
                        ddp_finish()
                    t1 = _perf_ns()
                    if capture is rec.active and len(capture.events) < max_events:
                        capture.events.append((RAW_BACKWARD, t0, t1, None, None))
                    else:
                        close_region(capture, RAW_BACKWARD, t0, t1)
            if not rec.recording:
                return orig_backward(self, *args, **kwargs)
            # One reused timer on the training thread (its pre/post are the region, two
            # calls in all); another thread gets its own (its region counts the thread).
            timer = backward_timer if _get_ident() == rec.owner else _hooks.HookRegionTimer(RAW_BACKWARD)
            timer.pre()
            if ddp_sync.expected and timer is backward_timer:
                ddp_arm(self)  # a DDP forward ran: time DDP's gradient all-reduce wait (ddp_comm)
            try:
                return orig_backward(self, *args, **kwargs)
            finally:
                if ddp_sync.handle is not None and timer is backward_timer:
                    ddp_finish()
                timer.post()

        backward.__wrapped__ = orig_backward
        _patch(tensor_cls, "backward", backward)

        if _timing.cuda_available():
            _patch_host_to_device(tensor_cls)

        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        _collectives.install(_patch)
        _ddp_comm.install(_patch)

        timer = _optimizer_timer = _hooks.OptimizerTimer()
        _handles.append(register_optimizer_step_pre_hook(timer.pre))
        _handles.append(register_optimizer_step_post_hook(timer.post))
        _installed = True
        return True


def _patch_host_to_device(tensor_cls) -> None:
    """Time `Tensor.to`/`Tensor.cuda` calls that copy a CPU tensor onto a CUDA device.

    Installed only where CUDA is available: elsewhere no call can be a host-to-device
    copy, and the wrapper would only add its cost to every `.to()` of the job (about
    5 us of the training thread per call inside a real step, caches cold).
    """
    from traceml.schema.vocabulary import RAW_H2D

    orig_to = tensor_cls.to
    orig_cuda = tensor_cls.cuda
    moves = _hooks.moves_host_to_device

    def to(self, *args, **kwargs):
        if _rec.recording and moves(self, args, kwargs):
            with timed_region(RAW_H2D):
                return orig_to(self, *args, **kwargs)
        return orig_to(self, *args, **kwargs)

    def cuda(self, *args, **kwargs):
        if _rec.recording and getattr(self, "is_cpu", False) is True:
            with timed_region(RAW_H2D):
                return orig_cuda(self, *args, **kwargs)
        return orig_cuda(self, *args, **kwargs)

    to.__wrapped__ = orig_to
    cuda.__wrapped__ = orig_cuda
    _patch(tensor_cls, "to", to)
    _patch(tensor_cls, "cuda", cuda)


def instrument_model(model) -> None:
    """Time forward calls of `model` (the outermost module). Idempotent; undone by uninstall()."""
    if _forward.forward_timer(model) is not None:
        return
    _forward.instrument_forward(model)
    with _lock:
        _models.append(weakref.ref(model))


def uninstall() -> None:
    """Restore every patched attribute and remove every hook this module added."""
    global _installed, _optimizer_timer
    with _lock:
        while _originals:
            owner, name, original = _originals.pop()
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        while _handles:
            _handles.pop().remove()
        while _models:
            model = _models.pop()()
            if model is not None:
                _forward.remove_forward_instrumentation(model)
        _ddp_comm.state.expected = False
        _optimizer_timer = None
        _installed = False
