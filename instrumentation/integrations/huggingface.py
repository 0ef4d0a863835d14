"""Hugging Face `transformers.Trainer` integration.

One TraceML step is one optimizer-update attempt: the owning callback opens
`traceml.trace_step` at `on_step_begin` and closes it at `on_step_end`, so the
accumulation microbatches of a group (`on_substep_end`) fold into one step and a
shorter last group of an epoch is one shorter step.

`init()` patches `transformers.Trainer` (the class, once per process) at five seams:

- `_inner_training_loop` gets the lifecycle guard. It is the function Accelerate's
  automatic batch-size retry calls again, so an exception leaving one attempt aborts
  the open capture before the retry starts. The guard also picks one owning TraceML
  callback for the attempt (adding one when the Trainer has none), keeps DataLoader
  timing off for the attempt, and releases ownership when the attempt exits.
- `get_batch_samples` opens the collection window: the Trainer's training iterator is
  wrapped in a proxy whose `next()` enables DataLoader timing and Accelerate's
  batch placement timing, then restores the outer policy.
- `accelerate.data_loader.send_to_device` is timed only inside that window; each
  observed placement records H2D plus a traced-step segment of the same span.
- `transformers.trainer.skip_first_batches` notes Accelerate's lazy skip (iterable
  datasets on resume), so the first resumed group is omitted entirely.
- `evaluate` and `predict` run with DataLoader timing off, also outside `train()`,
  and what their forward passes and copies record is removed when they return.

Nothing here imports transformers or torch at module import; `auto_attach()` (what
`traceml run` calls) defers installation to the moment the user's script imports
`transformers.trainer`.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import re
import sys
import threading
import warnings
from typing import Any

import traceml
from traceml import step_events, timing
from traceml.schema.environment import TRACEML_DISABLE, env_flag
from traceml.schema.vocabulary import RAW_H2D, RAW_STEP_TIME

MIN_TRANSFORMERS = (4, 46, 1)
"""First release whose Trainer collects microbatches through `get_batch_samples`."""

_WRAPPED = "__traceml_hf_wrapped__"
"""Attribute set on every function this module installs (idempotence check)."""

_install_lock = threading.RLock()
_installed = False
_collection_installed = False
_warned: set[str] = set()
_local = threading.local()


class CustomCollectionWarning(RuntimeWarning):
    """A Trainer subclass overrides `get_batch_samples`: its input is not measured."""


# --- small helpers -----------------------------------------------------------------


def _disabled() -> bool:
    return env_flag(os.environ.get(TRACEML_DISABLE))


def _tracing() -> bool:
    """True while TraceML records in this process (initialised, not disabled)."""
    return traceml.is_initialized() and not _disabled()


def _warn_once(key: str, message: str, category: type[Warning] = RuntimeWarning) -> None:
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(f"TraceML: {message}", category, stacklevel=3)


def _report(what: str, exc: BaseException) -> None:
    """A TraceML failure never stops training: say it once per kind and carry on."""
    _warn_once(f"failure:{what}", f"Hugging Face integration: {what} failed "
               f"({type(exc).__name__}: {exc}); training continues")


def _attempts() -> list:
    stack = getattr(_local, "attempts", None)
    if stack is None:
        stack = _local.attempts = []
    return stack


def _active_attempt() -> "_Attempt | None":
    stack = _attempts()
    return stack[-1] if stack else None


def _version_tuple(text: str) -> tuple[int, ...]:
    """'4.46.1' -> (4, 46, 1); pre-release suffixes end the tuple ('4.47.0rc1' -> (4, 47, 0))."""
    parts = []
    for piece in text.split(".")[:3]:
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.end() != len(piece):
            break
    return tuple(parts)


# --- per-attempt state ----------------------------------------------------------------


class _Attempt:
    """One guarded `_inner_training_loop` call: who owns the steps and what is open."""

    __slots__ = ("trainer", "owner", "added_callback", "collection_bypassed",
                 "lazy_skip_pending", "omit_group", "step_cm")

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.owner: Any = None
        self.added_callback: Any = None
        self.collection_bypassed = False
        self.lazy_skip_pending = False
        self.omit_group = False
        self.step_cm: Any = None


def _close_step(holder: Any, exc: BaseException | None = None) -> None:
    """Finish the trace_step held by `holder` (complete on None, abort on an exception)."""
    cm = holder.step_cm
    if cm is None:
        return
    holder.step_cm = None
    try:
        if exc is None:
            cm.__exit__(None, None, None)
        else:
            cm.__exit__(type(exc), exc, exc.__traceback__)
    except BaseException as inner:  # noqa: BLE001 - never replace the training exception
        if inner is not exc:
            _report("closing the step", inner)


def _discard_pending() -> None:
    step_events.abort_step_capture()


# --- the callback ------------------------------------------------------------------------

_callback_type: type | None = None


def _make_callback_type() -> type:
    """Build the TrainerCallback subclass (needs transformers, hence built on demand)."""
    global _callback_type
    if _callback_type is not None:
        return _callback_type
    from transformers import TrainerCallback

    class TraceMLTrainerCallback(TrainerCallback):
        """Brackets each optimizer-update group with `traceml.trace_step`.

        Inside a guarded attempt only the attempt's owner acts, so a Trainer that
        carries two of these callbacks still records each group once. Without the
        guard (a subclass whose `_inner_training_loop` bypasses it) the callback keeps
        its own state: steps are bracketed, but there is no exception cleanup, no
        input timing and no resume handling.
        """

        def __init__(self) -> None:
            super().__init__()
            self.step_cm: Any = None
            self.omit_group = False

        def _holder(self) -> Any:
            attempt = _active_attempt()
            if attempt is None:
                return self
            return attempt if attempt.owner is self else None

        def on_step_begin(self, args, state, control, **kwargs):
            if not _tracing():
                return
            holder = self._holder()
            if holder is None or holder.omit_group:
                return
            try:
                if holder.step_cm is not None:
                    # A previous group never reached on_step_end and this group's input
                    # went into its capture: drop both rather than publish a mixture.
                    _close_step(holder, RuntimeError("step left open"))
                    _discard_pending()
                    holder.omit_group = True
                    return
                cm = traceml.trace_step(kwargs.get("model"))
                cm.__enter__()
                holder.step_cm = cm
            except Exception as exc:  # noqa: BLE001
                holder.step_cm = None
                _report("opening the step", exc)

        def on_step_end(self, args, state, control, **kwargs):
            holder = self._holder()
            if holder is None:
                return
            if holder.omit_group:
                # Lazy resume skip: drop everything this group produced, count nothing.
                holder.omit_group = False
                try:
                    _close_step(holder, RuntimeError("omitted group"))
                    _discard_pending()
                except Exception as exc:  # noqa: BLE001
                    _report("omitting the resumed group", exc)
                return
            _close_step(holder)

        def on_train_end(self, args, state, control, **kwargs):
            # Only the unguarded fallback needs this; the guard cleans up its attempt.
            if _active_attempt() is None and self.step_cm is not None:
                _close_step(self, RuntimeError("training ended inside a step"))
                _discard_pending()

    _callback_type = TraceMLTrainerCallback
    return TraceMLTrainerCallback


def __getattr__(name: str) -> Any:
    if name == "TraceMLTrainerCallback":
        return _make_callback_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- the lifecycle guard ------------------------------------------------------------


def _begin_attempt(trainer: Any) -> _Attempt:
    attempt = _Attempt(trainer)
    callback_type = _make_callback_type()
    handler = trainer.callback_handler
    ours = [cb for cb in handler.callbacks if isinstance(cb, callback_type)]
    if not ours:
        attempt.added_callback = callback_type()
        handler.callbacks.append(attempt.added_callback)
        ours = [attempt.added_callback]
    attempt.owner = ours[0]
    trainer_type = type(trainer)
    collect = getattr(trainer_type, "get_batch_samples", None)
    if not _collection_installed:
        attempt.collection_bypassed = True  # too old a transformers: init() warned already
    elif collect is not None and not getattr(collect, _WRAPPED, False):
        attempt.collection_bypassed = True
        _warn_once(f"custom_collection:{trainer_type.__module__}.{trainer_type.__qualname__}",
                   f"{trainer_type.__qualname__} overrides Trainer.get_batch_samples; TraceML "
                   "records no training Input Wait and no pre-step H2D for it (never a partial "
                   "input measurement)", CustomCollectionWarning)
    # Events left pending before training (a batch inspected by hand, say) are not
    # part of the first optimizer group.
    _discard_pending()
    _attempts().append(attempt)
    return attempt


def _end_attempt(attempt: _Attempt, exc: BaseException | None) -> None:
    stack = _attempts()
    if attempt in stack:
        stack.remove(attempt)
    try:
        if attempt.step_cm is not None:
            # An exception, or a stop requested mid-group: the group is not published.
            _close_step(attempt, exc if exc is not None else RuntimeError("unfinished group"))
        _discard_pending()
    except Exception as inner:  # noqa: BLE001
        _report("cleaning up the training attempt", inner)
    finally:
        attempt.owner = None
        attempt.omit_group = False
        attempt.lazy_skip_pending = False
        added = attempt.added_callback
        attempt.added_callback = None
        if added is not None:
            callbacks = attempt.trainer.callback_handler.callbacks
            if added in callbacks:
                callbacks.remove(added)


def _guard_inner_training_loop(original):
    @functools.wraps(original)
    def _inner_training_loop(self, *args, **kwargs):
        if not _tracing():
            return original(self, *args, **kwargs)
        try:
            attempt = _begin_attempt(self)
        except Exception as exc:  # noqa: BLE001
            _report("starting the training attempt", exc)
            return original(self, *args, **kwargs)
        try:
            with timing.dataloader_timing_scope(False):
                result = original(self, *args, **kwargs)
        except BaseException as exc:
            _end_attempt(attempt, exc)
            raise
        _end_attempt(attempt, None)
        return result

    setattr(_inner_training_loop, _WRAPPED, True)
    return _inner_training_loop


# --- the collection window ----------------------------------------------------------


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
        attempt = _active_attempt()
        if attempt is None or attempt.trainer is not self or attempt.collection_bypassed:
            return original(self, epoch_iterator, *args, **kwargs)
        if attempt.step_cm is not None:
            # The previous group stopped before on_step_end (a stop request mid-group):
            # it is not published, and this group's input must not land in its capture.
            _close_step(attempt, RuntimeError("unfinished group"))
            _discard_pending()
        if attempt.lazy_skip_pending:
            # This call consumes Accelerate's skipped batches and the first real one.
            attempt.lazy_skip_pending = False
            attempt.omit_group = True
            return original(self, epoch_iterator, *args, **kwargs)
        return original(self, _CollectionIterator(epoch_iterator), *args, **kwargs)

    setattr(get_batch_samples, _WRAPPED, True)
    return get_batch_samples


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

    setattr(send_to_device, _WRAPPED, True)
    return send_to_device


def _wrap_skip_first_batches(original):
    @functools.wraps(original)
    def skip_first_batches(dataloader, *args, **kwargs):
        result = original(dataloader, *args, **kwargs)
        attempt = _active_attempt()
        # Map-style datasets skip in the sampler (skip_batches stays 0): measured normally.
        if attempt is not None and (getattr(result, "skip_batches", 0) or 0) > 0:
            attempt.lazy_skip_pending = True
        return result

    setattr(skip_first_batches, _WRAPPED, True)
    return skip_first_batches


class _OutsideTraining:
    """Keeps evaluate/predict out of every training capture.

    DataLoader timing is off inside. Forward timing and host-to-device copies still
    record while recording is on, so what the call adds to the capture is removed
    afterwards: a capture that did not exist before is discarded whole, an existing
    one (evaluate called from inside an open step) is cut back to its length before.
    """

    __slots__ = ("_scope", "_capture", "_length")

    def __enter__(self):
        self._capture = None
        self._length = 0
        try:
            if step_events.has_active_capture():
                self._capture = step_events.current_capture()
                self._length = len(self._capture.events)
        except Exception as exc:  # noqa: BLE001
            _report("isolating evaluation", exc)
        self._scope = timing.dataloader_timing_scope(False)
        self._scope.__enter__()
        return self

    def __exit__(self, *exc_info) -> bool:
        self._scope.__exit__(*exc_info)
        try:
            capture = self._capture
            if capture is None:
                if step_events.has_active_capture():
                    step_events.abort_step_capture()
            elif step_events.has_active_capture() and step_events.current_capture() is capture:
                del capture.events[self._length:]
        except Exception as exc:  # noqa: BLE001
            _report("isolating evaluation", exc)
        return False


def _wrap_outside_train(original):
    """evaluate/predict consume their dataloaders directly: never measured as training."""

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if not _tracing():
            return original(self, *args, **kwargs)
        with _OutsideTraining():
            return original(self, *args, **kwargs)

    setattr(wrapper, _WRAPPED, True)
    return wrapper


# --- installation ---------------------------------------------------------------------


def _patch(owner: Any, name: str, make) -> bool:
    current = getattr(owner, name, None)
    if current is None:
        return False
    if getattr(current, _WRAPPED, False):
        return True
    setattr(owner, name, make(current))
    return True


def _install_patches() -> bool:
    """Patch transformers.Trainer and the two Accelerate seams (once per process)."""
    global _installed, _collection_installed
    with _install_lock:
        if _installed:
            return True
        import transformers
        import transformers.trainer as trainer_module
        from transformers import Trainer

        version = _version_tuple(getattr(transformers, "__version__", "0"))
        _patch(Trainer, "_inner_training_loop", _guard_inner_training_loop)
        _patch(Trainer, "evaluate", _wrap_outside_train)
        _patch(Trainer, "predict", _wrap_outside_train)
        if version >= MIN_TRANSFORMERS and hasattr(Trainer, "get_batch_samples"):
            _patch(Trainer, "get_batch_samples", _wrap_get_batch_samples)
            try:
                import accelerate.data_loader as accelerate_data_loader

                _patch(accelerate_data_loader, "send_to_device", _wrap_send_to_device)
            except ImportError:
                pass
            _patch(trainer_module, "skip_first_batches", _wrap_skip_first_batches)
            _collection_installed = True
        else:
            _warn_once("old_transformers", f"transformers {transformers.__version__} is older than "
                       "4.46.1: steps are recorded but training input is not timed")
        _installed = True
        return True


def init(**traceml_options: Any) -> bool:
    """Enable TraceML for every `transformers.Trainer` in this process.

    Calls `traceml.init(**traceml_options)` (idempotent), then installs the guard,
    the collection window and the callback ownership described in the module
    docstring. Calling it again does nothing more. Returns False when TraceML is
    disabled (`TRACEML_DISABLE`) or transformers is not installed.
    """
    if _disabled():
        return False
    start = getattr(traceml, "init", None)
    if start is not None:
        start(**traceml_options)
    try:
        return _install_patches()
    except ImportError as exc:
        _warn_once("no_transformers", f"Hugging Face integration not installed: {exc}")
    except Exception as exc:  # noqa: BLE001 - training goes on without the integration
        _report("installation", exc)
    return False


# --- automatic attach (`traceml run`) ------------------------------------------


class _TrainerImportHook(importlib.abc.MetaPathFinder):
    """Installs the patches right after the user's script imports `transformers.trainer`."""

    target = "transformers.trainer"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _InstallingLoader(spec.loader)
                return spec
        return None


class _InstallingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _remove_import_hook()
        try:
            _install_patches()
        except Exception as exc:  # noqa: BLE001 - the user's import must still succeed
            _report("automatic attach", exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


_hook: _TrainerImportHook | None = None


def _remove_import_hook() -> None:
    global _hook
    with _install_lock:
        if _hook is not None and _hook in sys.meta_path:
            sys.meta_path.remove(_hook)
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
    if _disabled():
        return False
    if "transformers.trainer" in sys.modules:
        return _install_patches()
    if importlib.util.find_spec("transformers") is None:
        return False
    with _install_lock:
        if _installed:
            return True
        if _hook is None:
            _hook = _TrainerImportHook()
            sys.meta_path.insert(0, _hook)
    return True


def is_installed() -> bool:
    return _installed


__all__ = ["init", "auto_attach", "is_installed", "CustomCollectionWarning", "TraceMLTrainerCallback"]
