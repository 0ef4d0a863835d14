"""Where a fit's session hooks into Lightning's own calls, and how it comes out again.

Five wrappers (the strategy's `training_step`, `batch_to_device` and
`optimizer_step`, the training fetcher's before/after-fetch seam) and two forward
hooks on the LightningModule and its direct children. Each does its bookkeeping
through the session, only on the training thread, and `_safely`: a failure
disarms the session (every wrapper then passes straight through) instead of
reaching the training loop. The wrappers are instance attributes recorded as
`patching.Patch`, so `uninstall` restores exactly what was there.
"""
from __future__ import annotations

import functools
import sys

from ..patching import patch
from .reporting import warn_once


def install(session) -> None:
    """Wrap the strategy and the training fetcher, hook the module's forward calls."""
    from traceml.timing import configure_gpu_timing

    trainer, strategy = session.trainer, session.trainer.strategy
    root = getattr(strategy, "root_device", None)
    configure_gpu_timing(session.memory.is_cuda, device_index=getattr(root, "index", None))

    def wrap(owner, name: str, wrapper) -> None:
        record = patch(owner, name, functools.partial(wrapper, session))
        if record is not None:
            session.patches.append(record)

    wrap(strategy, "training_step", _arming_wrapper)
    wrap(strategy, "batch_to_device", _transfer_wrapper)
    wrap(strategy, "optimizer_step", _optimizer_wrapper)
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if callable(getattr(epoch_loop, "_on_before_fetch", None)) and \
            callable(getattr(epoch_loop, "_on_after_fetch", None)):
        wrap(epoch_loop, "_on_before_fetch", _fetch_start_wrapper)
        wrap(epoch_loop, "_on_after_fetch", _fetch_end_wrapper)
    else:
        warn_once("no_fetch_seam", "this Lightning version has no training fetch seam "
                  "(epoch_loop._on_before_fetch); input wait is not measured")
    forward_pre = functools.partial(_forward_pre, session)
    forward_post = functools.partial(_forward_post, session)
    for module in [session.module, *session.module.children()]:
        session.handles.append(module.register_forward_pre_hook(forward_pre))
        session.handles.append(module.register_forward_hook(forward_post, always_call=True))


def uninstall(session) -> None:
    """Remove the forward hooks and undo the wrappers, last installed first."""
    for handle in session.handles:
        handle.remove()
    session.handles.clear()
    for record in reversed(session.patches):
        record.undo()
    session.patches.clear()


def _safely(session, step, *args):
    """Run one piece of bookkeeping inside a wrapper or hook of Lightning's own calls."""
    try:
        return step(*args)
    except Exception as exc:
        warn_once("wrapper_failed", f"{getattr(step, '__name__', step)} failed ({exc!r}); "
                  "TraceML stops recording this fit")
        session.disarm()
        return None


# --- the five wrappers -------------------------------------------------------------------


def _arming_wrapper(session, original):
    def training_step(*args, **kwargs):
        if not session.on_training_thread():
            return original(*args, **kwargs)
        session.armed += 1
        try:
            return original(*args, **kwargs)
        finally:
            session.armed -= 1
            if not session.armed and session.forward_region is not None:
                _safely(session, session.close_forward)

    return training_step


def _transfer_wrapper(session, original):
    def batch_to_device(*args, **kwargs):
        if not (session.on_training_thread() and session.trainer.training):
            return original(*args, **kwargs)
        transfer = _safely(session, session.transfer_start)
        try:
            return original(*args, **kwargs)
        finally:
            if transfer is not None:
                _safely(session, session.close, transfer)

    return batch_to_device


def _optimizer_wrapper(session, original):
    def optimizer_step(*args, **kwargs):
        if not session.on_training_thread():
            return original(*args, **kwargs)
        _safely(session, session.optimizer_call_start)
        try:
            return original(*args, **kwargs)
        finally:
            _safely(session, session.optimizer_call_end)

    return optimizer_step


def _fetch_start_wrapper(session, original):
    def before_fetch():
        original()
        if session.on_training_thread() and session.trainer.training \
                and session.fetch_region is None:
            _safely(session, session.fetch_start)

    return before_fetch


def _fetch_end_wrapper(session, original):
    def after_fetch():
        if session.fetch_region is not None:
            _safely(session, session.fetch_end, isinstance(sys.exc_info()[1], StopIteration))
        original()

    return after_fetch


# --- the two forward hooks ---------------------------------------------------------------


def _forward_pre(session, module, args):
    if session.on_training_thread():
        _safely(session, session.forward_enter)
    return None


def _forward_post(session, module, args, output):
    if session.on_training_thread() and session.forward_stack:
        _safely(session, session.forward_exit)
    return None
