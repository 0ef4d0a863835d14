"""Collective wait: the training thread's time blocked in torch.distributed collectives.

In synchronous data-parallel training every rank waits for the slowest one inside a
collective, so equal step times hide the straggler; the rank that waited least is the
one the others waited for. This module times the blocking collectives the training
thread calls itself (explicit calls in a loop, a framework's gather such as Hugging
Face's token count, FSDP's all-gathers in forward); `ddp_comm` times DDP's gradient
all-reduces, which run inside backward.

Seams (automatic mode, installed by `patches.install`, undone by `uninstall`):
- every function in `COLLECTIVES` on `torch.distributed` and on
  `torch.distributed.distributed_c10d` (the same function objects: callers that
  look it up in either module at call time, Accelerate's `gather` included, are
  covered; a name bound by `from torch.distributed import all_reduce` before
  `init()` is not);
- `Work.wait()` of the C++ `Work` class, so an `async_op=True` call is timed at its
  `wait()` (the call itself only enqueues and is not timed).

All of it records one raw event, `RAW_COLLECTIVE_WAIT`, through one shared hook
timer whose depth makes nested calls count once (`all_gather_object` calls
`all_gather`, a blocking call waits on its own `Work`): a nested call only checks the
depth and calls through. Only the training thread is timed; other threads (DDP's
comm hook on an autograd device thread, a data-loading thread) call straight
through and are not counted as foreign-thread misuse. Clock: the process policy,
so CUDA event pairs around the call on a CUDA run (NCCL: a blocking call makes the
current stream wait for the collective, so the pair measures how long the stream
waited; nothing is synchronised), the CPU clock otherwise (gloo).
"""
from __future__ import annotations

import inspect
import threading

from traceml.schema.vocabulary import RAW_COLLECTIVE_WAIT

from .hooks import HookRegionTimer
from .process_state import recording as _rec

_get_ident = threading.get_ident

COLLECTIVES: tuple[str, ...] = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_to_all", "all_to_all_single",
)
"""The blocking torch.distributed collectives timed in automatic mode (those the installed
torch has). Point-to-point send/recv is not a collective and is left alone."""

timer = HookRegionTimer(RAW_COLLECTIVE_WAIT)
"""The one timer every collective seam shares (its depth is the nesting rule)."""


def _async_index(function) -> int | None:
    """Position of the `async_op` parameter (None when the function has none)."""
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("async_op") if "async_op" in names else None


def timed_collective(original, async_index: int | None = None):
    """`original` timed as collective wait on the training thread unless called with async_op=True."""
    shared = timer

    def collective(*args, **kwargs):
        rec = _rec
        if not rec.recording or shared._depth or _get_ident() != rec.owner \
                or (kwargs and kwargs.get("async_op")) \
                or (async_index is not None and len(args) > async_index and args[async_index]):
            return original(*args, **kwargs)
        shared.pre()
        try:
            return original(*args, **kwargs)
        finally:
            shared.post()

    collective.__wrapped__ = original
    collective.__name__ = getattr(original, "__name__", "collective")
    collective.__qualname__ = getattr(original, "__qualname__", collective.__name__)
    collective.__doc__ = getattr(original, "__doc__", None)
    return collective


def timed_wait(original):
    """`Work.wait` timed as collective wait on the training thread (outside another collective)."""
    shared = timer

    def wait(self, *args, **kwargs):
        rec = _rec
        if not rec.recording or shared._depth or _get_ident() != rec.owner:
            return original(self, *args, **kwargs)
        shared.pre()
        try:
            return original(self, *args, **kwargs)
        finally:
            shared.post()

    wait.__wrapped__ = original
    return wait


def install(patch) -> bool:
    """Patch the collectives and `Work.wait` with `patch(owner, name, replacement)`; False without c10d."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return False
        from torch.distributed import distributed_c10d as c10d
    except Exception:
        return False
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None or not callable(original):
            continue
        wrapper = timed_collective(original, _async_index(original))
        patch(dist, name, wrapper)
        if c10d.__dict__.get(name) is original:
            patch(c10d, name, wrapper)
    work = getattr(dist, "Work", None)
    if work is not None and "wait" in work.__dict__:
        patch(work, "wait", timed_wait(work.__dict__["wait"]))
    return True
