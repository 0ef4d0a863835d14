"""Patching `Accelerator.prepare_model` once per process, now or when accelerate is imported."""
from __future__ import annotations

import functools
import importlib.util
import sys
import threading
from typing import Any

from traceml.settings import kill_switch

from ..import_hook import PostImportHook
from ..patching import Patch, patch_once
from ..warn_once import OnceWarnings

_ACCELERATOR_MODULE = "accelerate.accelerator"

warn_once = OnceWarnings("TraceML Accelerate: ")
_lock = threading.RLock()
_hook: PostImportHook | None = None
_patches: list[Patch] = []


def _naming_the_model(original):
    @functools.wraps(original)
    def prepare_model(self, model, *args, **kwargs):
        prepared = original(self, model, *args, **kwargs)
        evaluation = kwargs.get("evaluation_mode", args[1] if len(args) > 1 else False)
        if not evaluation:
            try:
                from traceml.step_boundary import note_model

                note_model(prepared)
            except Exception as exc:  # noqa: BLE001 - never break the user's prepare()
                warn_once("note_model", f"naming the prepared model failed ({exc!r}); its forward "
                          "is found at the first update instead")
        return prepared

    return prepare_model


def _install(module: Any) -> bool:
    with _lock:
        accelerator = getattr(module, "Accelerator", None)
        if accelerator is None or not callable(getattr(accelerator, "prepare_model", None)):
            warn_once("no_seam", f"{module.__name__}.Accelerator has no prepare_model; steps are "
                      "still inferred from optimizer updates, forward is found at the first update")
            return False
        record = patch_once(accelerator, "prepare_model", _naming_the_model)
        if record is not None:
            _patches.append(record)
        return True


def _on_import(module: Any) -> None:
    _remove_hook()
    try:
        _install(module)
    except Exception as exc:  # noqa: BLE001 - the user's import must still succeed
        warn_once("install", f"installation failed ({exc!r})")


def _remove_hook() -> None:
    global _hook
    with _lock:
        if _hook is not None:
            _hook.remove()
        _hook = None


def init() -> bool:
    """Install now (imports accelerate); False when TraceML is disabled or accelerate is absent."""
    if kill_switch():
        return False
    try:
        import accelerate.accelerator as module
    except ImportError:
        return False
    return _install(module)


def auto_attach() -> bool:
    """What `traceml run` calls after `traceml.init()`: install now if accelerate is loaded,
    else when the script imports it. Returns False when disabled or accelerate is absent."""
    global _hook
    if kill_switch():
        return False
    module = sys.modules.get(_ACCELERATOR_MODULE)
    if module is not None:
        return _install(module)
    if importlib.util.find_spec("accelerate") is None:
        return False
    with _lock:
        if _hook is None and not _patches:
            _hook = PostImportHook((_ACCELERATOR_MODULE,), _on_import)
            _hook.install()
    return True


def is_installed() -> bool:
    return bool(_patches)


def remove() -> None:
    """Undo: stop watching imports, restore `prepare_model`."""
    _remove_hook()
    with _lock:
        while _patches:
            _patches.pop().undo()
