"""Manual mode: the `wrap_*` wrappers and the `timed_*` region shorthands.

For jobs that time their phases themselves instead of (or besides) the automatic
patches. Each wrapper instruments the object it is given and returns it (or, for
a DataLoader, a timed view of it); under the kill switch they return their
argument untouched. Nothing here opens steps: that is `trace_step`.
"""
from __future__ import annotations

from traceml.schema.vocabulary import RAW_BACKWARD, RAW_DATALOADER_NEXT, RAW_FORWARD, RAW_H2D, RAW_OPTIMIZER_STEP

from . import timing as _timing
from .forward import time_forward_or_warn
from .hooks import TimedIterable, instrument_optimizer
from .process_state import session as _session


def wrap_dataloader(iterable):
    """Return an iterable whose `next()` calls are timed as input wait."""
    if _session.disabled:
        return iterable
    return TimedIterable(iterable)


def wrap_forward(module):
    """Time every call of `module` (the outermost model) as forward; returns the module.

    A module whose calls cannot be timed (not an `nn.Module`, a TorchScript module)
    is returned as it is, with a warning: its steps have no forward region.
    """
    if not _session.disabled:
        time_forward_or_warn(module)
    return module


def wrap_optimizer(optimizer):
    """Time `optimizer.step()` through its step hooks; returns the optimizer."""
    if not _session.disabled:
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

timed_input = _timing.region_type(RAW_DATALOADER_NEXT, "timed_input")
timed_input.__doc__ = ("`with traceml.timed_input(): x, y = get_batch()` (a new timed_region): input wait "
                       "for a batch fetched without a DataLoader (a generator, a memory-mapped reader).")

timed_optimizer_step = _timing.region_type(RAW_OPTIMIZER_STEP, "timed_optimizer_step")
timed_optimizer_step.__doc__ = "`with traceml.timed_optimizer_step(): optimizer.step()` (a new timed_region)."
