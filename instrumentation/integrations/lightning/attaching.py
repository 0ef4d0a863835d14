"""Putting the callback on trainers: by hand (`attach`) or on every run (`auto_attach`).

Automatic attach wraps the callback connector's `_attach_model_callbacks`, which
Lightning calls at the start of fit/validate/test/predict, after the model's
`configure_callbacks` are merged and before setup and checkpoint restoration. It
imports no Lightning: a namespace already imported is patched now, the other when
the script imports it.
"""
from __future__ import annotations

import importlib
import sys
import threading

from traceml.settings import kill_switch

from ..import_hook import PostImportHook
from ..patching import Patch, patch_once
from .callback import TraceMLCallback
from .namespaces import NAMESPACES, callback_class, trainer_namespace
from .reporting import warn_once


def attach(trainer):
    """Add a TraceML callback to `trainer` (or reuse one already there); return it.

    Returns None and installs nothing when TraceML is disabled. The callback goes
    before the checkpoint callbacks, which Lightning keeps last, so checkpoint saving
    after a group stays outside the group's measured window.
    """
    if kill_switch():
        return None
    callbacks = trainer.callbacks
    for callback in callbacks:
        if isinstance(callback, TraceMLCallback):
            return callback
    namespace = trainer_namespace(trainer)
    callback = callback_class(namespace)()
    checkpoint_base = getattr(importlib.import_module(namespace + ".callbacks"), "Checkpoint", ())
    position = next((i for i, cb in enumerate(callbacks) if isinstance(cb, checkpoint_base)),
                    len(callbacks))
    callbacks.insert(position, callback)
    return callback


_CONNECTOR_MODULES = tuple(ns + ".trainer.connectors.callback_connector" for ns in NAMESPACES)
_SEAM = "_attach_model_callbacks"
_auto_lock = threading.Lock()
_hook: PostImportHook | None = None
_patches: list[Patch] = []


def _attaching(original):
    def _attach_model_callbacks(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        try:
            attach(self.trainer)
        except Exception as exc:  # never break the user's fit
            warn_once("attach_failed", f"automatic attach failed ({exc!r})")
        return result

    _attach_model_callbacks.__doc__ = original.__doc__
    return _attach_model_callbacks


def _patch_connector(module) -> bool:
    """Wrap `_CallbackConnector._attach_model_callbacks` so every run gets our callback."""
    connector = getattr(module, "_CallbackConnector", None)
    if getattr(connector, _SEAM, None) is None:
        warn_once("no_connector_seam", f"{module.__name__} has no _CallbackConnector."
                  "_attach_model_callbacks; add TraceMLCallback() to the Trainer yourself")
        return False
    record = patch_once(connector, _SEAM, _attaching)
    if record is not None:
        _patches.append(record)
    return True


def _on_connector_import(module) -> None:
    with _auto_lock:
        if _hook is not None:  # auto-attach may have been removed since the import began
            _patch_connector(module)


def auto_attach() -> bool:
    """Attach TraceML to every Lightning Trainer run in this process (used by `traceml run`).

    Patches the callback connector of each Lightning namespace already imported, and
    the others when they get imported. Returns False (and does nothing) when
    TraceML is disabled. Idempotent; `remove_auto_attach()` undoes it.
    """
    global _hook
    if kill_switch():
        return False
    with _auto_lock:
        if _hook is None:
            # Stays armed: the second namespace may be imported later than the first.
            _hook = PostImportHook(_CONNECTOR_MODULES, _on_connector_import)
            _hook.install()
        for name in _CONNECTOR_MODULES:
            module = sys.modules.get(name)
            if module is not None:
                _patch_connector(module)
    return True


def remove_auto_attach() -> None:
    """Undo `auto_attach()`: unpatch imported connectors and stop watching imports."""
    global _hook
    with _auto_lock:
        if _hook is not None:
            _hook.remove()
            _hook = None
        while _patches:
            _patches.pop().undo()
