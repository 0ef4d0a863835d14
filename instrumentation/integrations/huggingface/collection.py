"""The collection window: training input measured while `get_batch_samples` collects a group.

`Trainer.get_batch_samples` reads the group's microbatches before `on_step_begin`.
Inside a guarded attempt its iterator is wrapped so that each `next()` enables
DataLoader timing and Accelerate's batch placement timing, then restores the outer
(disabled) policy. `skip_first_batches` is watched for Accelerate's lazy resume
skip, whose group is then left out whole. `Accelerator.gather` called while the group
is collected (the token count of `average_tokens_across_devices`, in which a fast
rank waits for a slow one's batch) records a matching traced-step segment, as a
placement does: the collective wait timed inside it is then part of the step's
time, not an interval outside the step that nothing contains. `install` puts the seams in together;
the guard asks `bypassed()` once per attempt.
"""
from __future__ import annotations

import functools
import threading
from typing import Any

from traceml import timing
from traceml.schema.vocabulary import RAW_H2D, RAW_STEP_TIME

from ..patching import is_wrapper, patch_once
from .attempt import active_attempt, close_step, discard_pending
from .reporting import CustomCollectionWarning, warn_once

_local = threading.local()  # .placing: > 0 while a measured next() runs; .collecting: > 0 inside get_batch_samples
_installed = False
"""True once `install` ran (transformers new enough); until then every attempt is bypassed."""


def bypassed(trainer: Any) -> bool:
    """True when this trainer's input cannot be measured (it warns once per class)."""
    if not _installed:
        return True  # too old a transformers: init() warned already
    trainer_type = type(trainer)
    collect = getattr(trainer_type, "get_batch_samples", None)
    if collect is not None and not is_wrapper(collect):
        warn_once(f"custom_collection:{trainer_type.__module__}.{trainer_type.__qualname__}",
                  f"{trainer_type.__qualname__} overrides Trainer.get_batch_samples; TraceML "
                  "records no training Input Wait and no pre-step H2D for it (never a partial "
                  "input measurement)", CustomCollectionWarning)
        return True
    return False


class _CollectionIterator:
    """The training iterator as `get_batch_samples` sees it: each `next()` is measured.

    DataLoader timing and batch-placement timing are enabled only for the duration
    of the call; the outer (disabled) policy is restored afterwards.
    """

    __slots__ = ("_inner",)

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        _local.placing = getattr(_local, "placing", 0) + 1
        try:
            with timing.dataloader_timing_scope(True):
                return next(self._inner)
        finally:
            _local.placing -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _wrap_get_batch_samples(original):
    @functools.wraps(original)
    def get_batch_samples(self, epoch_iterator, *args, **kwargs):
        attempt = active_attempt()
        if attempt is None or attempt.trainer is not self or attempt.collection_bypassed:
            return original(self, epoch_iterator, *args, **kwargs)
        if attempt.step_cm is not None:
            # The previous group stopped before on_step_end (a stop request mid-group):
            # it is not published, and this group's input must not land in its capture.
            close_step(attempt, RuntimeError("unfinished group"))
            discard_pending()
        if attempt.lazy_skip_pending:
            # This call consumes Accelerate's skipped batches and the first real one.
            attempt.lazy_skip_pending = False
            attempt.omit_group = True
            return original(self, epoch_iterator, *args, **kwargs)
        _local.collecting = getattr(_local, "collecting", 0) + 1
        try:
            return original(self, _CollectionIterator(epoch_iterator), *args, **kwargs)
        finally:
            _local.collecting -= 1

    return get_batch_samples


def _wrap_gather(original):
    @functools.wraps(original)
    def gather(self, *args, **kwargs):
        if not getattr(_local, "collecting", 0) or getattr(_local, "placing", 0):
            return original(self, *args, **kwargs)
        with timing.timed_region(RAW_STEP_TIME):
            return original(self, *args, **kwargs)

    return gather


def _on_accelerator(device: Any) -> bool:
    """True for a placement onto a non-host device (a CPU-only run transfers nothing)."""
    if device is None:
        return False
    kind = getattr(device, "type", None)
    if kind is None:
        kind = str(device).split(":", 1)[0]
    return kind != "cpu"


def _wrap_send_to_device(original):
    @functools.wraps(original)
    def send_to_device(tensor, device, *args, **kwargs):
        if not getattr(_local, "placing", 0) or not _on_accelerator(device):
            return original(tensor, device, *args, **kwargs)
        if timing.event_pool() is None and getattr(device, "type", None) == "cuda":
            # The first group's transfers run before the first trace_step configured
            # CUDA timing; give them events too so every occurrence has a GPU time.
            timing.configure_gpu_timing(timing.gpu_timing_enabled(), pool=timing.CudaEventPool())
        # A placement nested inside another one is timed once, by the outer call.
        depth = _local.placing
        _local.placing = 0
        try:
            with timing.timed_region(RAW_STEP_TIME, device=device), \
                    timing.timed_region(RAW_H2D, device=device):
                return original(tensor, device, *args, **kwargs)
        finally:
            _local.placing = depth

    return send_to_device


def _wrap_skip_first_batches(original):
    @functools.wraps(original)
    def skip_first_batches(dataloader, *args, **kwargs):
        result = original(dataloader, *args, **kwargs)
        attempt = active_attempt()
        # Map-style datasets skip in the sampler (skip_batches stays 0): measured normally.
        if attempt is not None and (getattr(result, "skip_batches", 0) or 0) > 0:
            attempt.lazy_skip_pending = True
        return result

    return skip_first_batches


def install(trainer_class: type, trainer_module: Any) -> None:
    """Wrap `get_batch_samples`, Accelerate's `send_to_device` and `Accelerator.gather`, and `skip_first_batches`."""
    global _installed
    patch_once(trainer_class, "get_batch_samples", _wrap_get_batch_samples)
    try:
        import accelerate.data_loader as accelerate_data_loader

        patch_once(accelerate_data_loader, "send_to_device", _wrap_send_to_device)
        from accelerate import Accelerator

        patch_once(Accelerator, "gather", _wrap_gather)
    except ImportError:
        pass
    patch_once(trainer_module, "skip_first_batches", _wrap_skip_first_batches)
    _installed = True
