"""Turning the integration on: patching `transformers.Trainer` once per process.

`init()` installs now; `auto_attach()` (what `traceml run` calls) installs now if
`transformers.trainer` is already imported, else arms a one-shot import hook.
"""
from __future__ import annotations

import importlib.util
import sys
import threading
from typing import Any

import traceml
from traceml.schema.version_floors import UnsupportedVersion, release, require
from traceml.settings import kill_switch

from . import collection
from ..import_hook import PostImportHook
from ..patching import patch_once
from .evaluation import wrap_outside_train
from .guard import guard_inner_training_loop
from .reporting import report, warn_once

MIN_TRANSFORMERS = (4, 46, 1)
"""First release whose Trainer collects microbatches through `get_batch_samples`."""

_TRAINER_MODULE = "transformers.trainer"

_install_lock = threading.RLock()
_installed = False
_hook: PostImportHook | None = None


def _install_patches() -> bool:
    """Patch transformers.Trainer and the two Accelerate seams (once per process)."""
    global _installed
    with _install_lock:
        if _installed:
            return True
        # The huggingface extra's own torch floor (Accelerate needs torch.cpu.set_device):
        # an older torch gets the integration refused by name, not a Trainer that cannot start.
        require(("torch", "transformers", "accelerate"), extra="huggingface")
        import transformers
        import transformers.trainer as trainer_module
        from transformers import Trainer

        version = release(getattr(transformers, "__version__", "0"))
        patch_once(Trainer, "_inner_training_loop", guard_inner_training_loop)
        patch_once(Trainer, "evaluate", wrap_outside_train)
        patch_once(Trainer, "predict", wrap_outside_train)
        if version >= MIN_TRANSFORMERS and hasattr(Trainer, "get_batch_samples"):
            collection.install(Trainer, trainer_module)
        else:
            warn_once("old_transformers", f"transformers {transformers.__version__} is older than "
                      "4.46.1: steps are recorded but training input is not timed")
        _installed = True
        return True


def init(**traceml_options: Any) -> bool:
    """Enable TraceML for every `transformers.Trainer` in this process.

    Calls `traceml.init(**traceml_options)` (idempotent), then installs the guard,
    the collection window and the callback ownership described in the package
    docstring. Calling it again does nothing more. Returns False when TraceML is
    disabled (`TRACEML_DISABLE`) or transformers is not installed; raises
    `UnsupportedVersion` when torch, transformers or Accelerate is below the
    huggingface extra's floor (`version_floors.floors("huggingface")`).
    """
    if kill_switch():
        return False
    start = getattr(traceml, "init", None)
    if start is not None:
        start(**traceml_options)
    try:
        return _install_patches()
    except UnsupportedVersion:
        raise
    except ImportError as exc:
        warn_once("no_transformers", f"Hugging Face integration not installed: {exc}")
    except Exception as exc:  # noqa: BLE001 - training goes on without the integration
        report("installation", exc)
    return False


def _on_trainer_import(module: Any) -> None:
    """One shot: the hook goes, the patches go in; the user's import still succeeds."""
    _remove_import_hook()
    try:
        _install_patches()
    except Exception as exc:  # noqa: BLE001 - the user's import must still succeed
        report("automatic attach", exc)


def _remove_import_hook() -> None:
    global _hook
    with _install_lock:
        if _hook is not None:
            _hook.remove()
        _hook = None


def auto_attach() -> bool:
    """What `traceml run` calls in each rank after `traceml.init()`.

    It never imports transformers itself: importing it costs seconds and the script
    may not train with it at all. If `transformers.trainer` is already loaded the
    patches go in now; otherwise a one-shot import hook installs them as soon as the
    script imports it (`from transformers import Trainer` does). Returns True when
    installed or armed, False when disabled or transformers is absent.
    """
    global _hook
    if kill_switch():
        return False
    if _TRAINER_MODULE in sys.modules:
        return _install_patches()
    if importlib.util.find_spec("transformers") is None:
        return False
    with _install_lock:
        if _installed:
            return True
        if _hook is None:
            _hook = PostImportHook((_TRAINER_MODULE,), _on_trainer_import)
            _hook.install()
    return True


def is_installed() -> bool:
    return _installed
