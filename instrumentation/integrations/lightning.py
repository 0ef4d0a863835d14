"""Lightning integration: TraceML steps from a Lightning `Trainer`, in either namespace.

`lightning.pytorch` and `pytorch_lightning` ship the same loops under two import
names whose classes are distinct, so nothing here imports either at module import:
the callback class is built on first use for the namespace of the trainer at hand.

Step boundaries (docs/integrations/lightning.md has the full story):
- automatic optimisation: one TraceML step is one accumulation group. Every
  micro-batch opens and closes its own traced region; the capture and the peak-memory
  window stay open until `fit_loop._should_accumulate()` turns false;
- manual optimisation: one TraceML step is one batch;
- an exception aborts everything captured since the last completed group.

Timed phases and where they come from:
- input wait: the training fetcher's own before/after-fetch seam (validation and
  test fetchers have their own fetcher and are never timed);
- traced step: one region per micro-batch, from its transfer to the device until
  `on_train_batch_end`;
- H2D: `strategy.batch_to_device` during training;
- forward: calls to the LightningModule or one of its direct children while
  `training_step` runs (outermost call only; never while the autograd engine
  runs, so activation-checkpointing recomputation is not counted);
- backward: `on_before_backward` .. `on_after_backward`;
- optimizer: `on_before_optimizer_step` .. return of `strategy.optimizer_step`.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import math
import os
import sys
import threading
import warnings

from traceml.schema.environment import TRACEML_DISABLE, env_flag
from traceml.schema.vocabulary import (
    RAW_BACKWARD,
    RAW_DATALOADER_NEXT,
    RAW_FORWARD,
    RAW_H2D,
    RAW_OPTIMIZER_STEP,
    RAW_STEP_TIME,
)
from traceml.step_events import RegionHold

__all__ = [
    "NAMESPACES",
    "TraceMLCallback",
    "attach",
    "auto_attach",
    "callback_class",
    "remove_auto_attach",
    "trainer_namespace",
]

_log = logging.getLogger(__name__)

NAMESPACES: tuple[str, ...] = ("lightning.pytorch", "pytorch_lightning")
"""Lightning import names this integration supports (2.x)."""

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"TraceML Lightning: {message}", RuntimeWarning, stacklevel=3)


def _disabled() -> bool:
    return env_flag(os.environ.get(TRACEML_DISABLE))


# --- Namespaces and the callback class ----------------------------------------------


def trainer_namespace(trainer) -> str:
    """`lightning.pytorch` or `pytorch_lightning`, from the trainer's class."""
    for klass in type(trainer).__mro__:
        module = klass.__module__ or ""
        for namespace in NAMESPACES:
            if module == namespace or module.startswith(namespace + "."):
                return namespace
    raise TypeError(f"{type(trainer).__qualname__} is not a Lightning Trainer "
                    f"(expected one from {' or '.join(NAMESPACES)})")


def _default_namespace() -> str:
    """The namespace already imported; `lightning.pytorch` when both or neither are."""
    if "lightning.pytorch" not in sys.modules and "pytorch_lightning" in sys.modules:
        return "pytorch_lightning"
    return "lightning.pytorch"


_classes: dict[str, type] = {}
_classes_lock = threading.Lock()


def callback_class(namespace: str) -> type:
    """The concrete `TraceMLCallback` subclass of `<namespace>.callbacks.Callback`."""
    if namespace not in NAMESPACES:
        raise ValueError(f"unknown Lightning namespace {namespace!r}; expected one of {NAMESPACES}")
    with _classes_lock:
        klass = _classes.get(namespace)
        if klass is None:
            base = importlib.import_module(namespace + ".callbacks").Callback
            klass = type("TraceMLCallback", (TraceMLCallback, base),
                         {"__module__": __name__, "namespace": namespace,
                          "__doc__": TraceMLCallback.__doc__})
            _classes[namespace] = klass
    return klass


def _rebuild(namespace: str):
    return callback_class(namespace)()


def _guarded(method):
    """Run a hook body so that a TraceML failure never reaches the training loop."""

    def hook(self, *args, **kwargs):
        try:
            session = self._session
            if session is not None and session.failed:
                self._drop_session()  # a wrapper failed: clean up at the next hook
            method(self, *args, **kwargs)
        except Exception as exc:  # telemetry must never break training
            _warn_once("hook_failed", f"{method.__name__} failed ({exc!r}); "
                       "TraceML stops recording this fit")
            self._drop_session()

    hook.__name__ = method.__name__
    hook.__doc__ = method.__doc__
    return hook


class TraceMLCallback:
    """Lightning callback that turns training batches into TraceML steps.

    `TraceMLCallback()` builds the subclass for the Lightning namespace already
    imported (pass `namespace=` to choose); `attach(trainer)` picks the trainer's own.
    Instances of either concrete class are instances of `TraceMLCallback`.
    """

    namespace: str | None = None

    def __new__(cls, *args, namespace: str | None = None, **kwargs):
        if cls.namespace is None:
            cls = callback_class(namespace or _default_namespace())
        return object.__new__(cls)

    def __init__(self, *, namespace: str | None = None) -> None:
        if namespace is not None and namespace != type(self).namespace:
            raise ValueError(f"namespace {namespace!r} does not match {type(self).namespace!r}")
        self._session: _TrainSession | None = None
        self._scope = None
        self._stage_hold: RegionHold | None = None
        self._eval_hold: RegionHold | None = None

    def __reduce__(self):
        return (_rebuild, (type(self).namespace,))

    # -- lifecycle -----------------------------------------------------------------

    @_guarded
    def setup(self, trainer, pl_module, stage) -> None:
        """Hold DataLoader auto-timing off for the whole stage (only the training
        fetcher is timed, by this callback), and make sure recording runs."""
        if _disabled():
            return
        _ensure_recording()
        if self._scope is None:
            from traceml.timing import dataloader_timing_scope

            scope = dataloader_timing_scope(False)
            scope.__enter__()
            self._scope = scope
        if stage != "fit" and self._stage_hold is None:
            # validate/test/predict: nothing here is a training step
            self._stage_hold = RegionHold(_PHASES)

    @_guarded
    def on_validation_start(self, trainer, pl_module) -> None:
        """Sanity check and validation inside fit never count towards a training step."""
        if self._eval_hold is None and not _disabled():
            self._eval_hold = RegionHold(_PHASES)

    @_guarded
    def on_validation_end(self, trainer, pl_module) -> None:
        hold, self._eval_hold = self._eval_hold, None
        if hold is not None:
            hold.release()

    @_guarded
    def on_train_start(self, trainer, pl_module) -> None:
        """Install hooks now: after checkpoint restore, strategy and EMA set-up."""
        if _disabled():
            return
        self._drop_session()
        from traceml.step_events import abort_step_capture

        # Whatever sits in the pending capture was recorded before training
        # (sanity check, set-up): it belongs to no training step.
        abort_step_capture()
        session = self._session = _TrainSession(trainer, pl_module)
        session.install()  # a failure here is cleaned up by _guarded's _drop_session

    @_guarded
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx, *args) -> None:
        if self._session is not None:
            self._session.batch_start()

    @_guarded
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, *args) -> None:
        if self._session is not None:
            self._session.batch_end(batch_idx)

    @_guarded
    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._session is not None:
            self._session.backward_start()

    @_guarded
    def on_after_backward(self, trainer, pl_module) -> None:
        if self._session is not None:
            self._session.backward_end()

    @_guarded
    def on_before_optimizer_step(self, trainer, pl_module, optimizer, *args) -> None:
        if self._session is not None:
            self._session.optimizer_start()

    @_guarded
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._session is not None:
            self._session.epoch_end()

    @_guarded
    def on_train_end(self, trainer, pl_module) -> None:
        self._drop_session()

    def on_exception(self, trainer, pl_module, exception) -> None:
        try:
            self._release_holds()
            session, self._session = self._session, None
            if session is not None:
                session.fail()
        except Exception as exc:
            _warn_once("hook_failed", f"on_exception failed ({exc!r})")
        finally:
            self._exit_scope()

    def teardown(self, trainer, pl_module, stage) -> None:
        try:
            self._release_holds()
            self._drop_session()
        except Exception as exc:
            _warn_once("cleanup_failed", f"teardown failed ({exc!r})")
        finally:
            self._exit_scope()

    # -- internals -------------------------------------------------------------------

    def _drop_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                session.finish()
            except Exception as exc:
                _warn_once("cleanup_failed", f"cleaning up after the fit failed ({exc!r})")

    def _release_holds(self) -> None:
        for name in ("_eval_hold", "_stage_hold"):
            hold = getattr(self, name)
            setattr(self, name, None)
            if hold is not None:
                hold.release()

    def _exit_scope(self) -> None:
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.__exit__(None, None, None)


def _ensure_recording() -> None:
    """A manually added callback works without `traceml.init()`: start in manual mode."""
    import traceml

    initialised = getattr(traceml, "is_initialized", None)
    init = getattr(traceml, "init", None)
    if callable(initialised) and callable(init) and not initialised():
        init(mode="manual")


# --- One fit: the installed hooks and the open group -----------------------------------


def _graph_task_probe():
    """A function returning True inside the autograd engine (where activation
    checkpointing recomputes forward), or None when this torch has no such probe."""
    import torch

    task_id = getattr(torch._C, "_current_graph_task_id", None)
    if task_id is None:
        _warn_once("no_graph_task_id", "torch has no _current_graph_task_id; forward calls "
                   "during backward are excluded only inside Lightning's backward hooks")
        return None
    return lambda: task_id() != -1


_SHOULD_ACCUMULATE = "_should_accumulate"
"""The private FitLoop method that says whether the current micro-batch keeps accumulating."""

_PHASES = (RAW_DATALOADER_NEXT, RAW_H2D, RAW_FORWARD, RAW_BACKWARD, RAW_OPTIMIZER_STEP)


class _TrainSession:
    """Hooks, wrappers and group state for one `fit` of one trainer (training thread only)."""

    def __init__(self, trainer, pl_module) -> None:
        from traceml.memory import StepMemoryTracker

        self.trainer = trainer
        self.module = pl_module
        self.thread = threading.get_ident()
        self.manual = not getattr(pl_module, "automatic_optimization", True)
        self.memory = StepMemoryTracker(getattr(trainer.strategy, "root_device", None))
        self.installed = False
        self.failed = False
        self.regions: list = []  # open timed regions, innermost last
        self.batch_region = None
        self.backward_region = None
        self.optimizer_region = None
        self.fetch_region = None
        self.forward_region = None
        self.optimizer_hold: RegionHold | None = None
        self.forward_depth = 0
        self.forward_stack: list[bool] = []
        self.armed = 0
        self.in_backward = False
        self.group_open = False
        self.handles: list = []
        self.patches: list = []  # (owner, name, had_own, previous, replacement)
        self.should_accumulate = self._accumulation_rule()
        self.in_autograd = _graph_task_probe() or (lambda: False)

    # -- regions -------------------------------------------------------------------------

    def _open(self, raw_event: str, device=None):
        from traceml.timing import timed_region

        region = timed_region(raw_event, device=device)
        region.start()
        self.regions.append(region)
        return region

    def _close(self, region) -> None:
        if region is None:
            return
        try:
            self.regions.remove(region)
        except ValueError:
            return
        region.stop()

    def _release_optimizer_hold(self) -> None:
        hold, self.optimizer_hold = self.optimizer_hold, None
        if hold is not None:
            hold.release()

    def _close_all(self) -> None:
        self._release_optimizer_hold()
        while self.regions:
            self.regions.pop().stop()
        self.batch_region = self.backward_region = self.optimizer_region = None
        self.fetch_region = self.forward_region = None
        self.forward_depth = 0
        self.forward_stack.clear()
        self.in_backward = False

    # -- installation --------------------------------------------------------------------

    def _patch(self, owner, name: str, make) -> bool:
        previous = getattr(owner, name, None)
        if not callable(previous):
            return False
        own = vars(owner)
        had_own = name in own
        before = own.get(name)
        replacement = make(previous)
        setattr(owner, name, replacement)
        self.patches.append((owner, name, had_own, before, replacement))
        return True

    def install(self) -> None:
        from traceml.timing import configure_gpu_timing

        trainer, strategy = self.trainer, self.trainer.strategy
        root = getattr(strategy, "root_device", None)
        configure_gpu_timing(self.memory.is_cuda, device_index=getattr(root, "index", None))
        self._patch(strategy, "training_step", self._arming_wrapper)
        self._patch(strategy, "batch_to_device", self._transfer_wrapper)
        self._patch(strategy, "optimizer_step", self._optimizer_wrapper)
        epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if callable(getattr(epoch_loop, "_on_before_fetch", None)) and \
                callable(getattr(epoch_loop, "_on_after_fetch", None)):
            self._patch(epoch_loop, "_on_before_fetch", self._fetch_start_wrapper)
            self._patch(epoch_loop, "_on_after_fetch", self._fetch_end_wrapper)
        else:
            _warn_once("no_fetch_seam", "this Lightning version has no training fetch seam "
                       "(epoch_loop._on_before_fetch); input wait is not measured")
        modules = [self.module, *self.module.children()]
        for module in modules:
            self.handles.append(module.register_forward_pre_hook(self._forward_pre))
            self.handles.append(module.register_forward_hook(self._forward_post, always_call=True))
        self.installed = True

    def uninstall(self) -> None:
        self.installed = False
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for owner, name, had_own, previous, replacement in reversed(self.patches):
            if vars(owner).get(name) is not replacement:
                continue  # someone patched over us; leave theirs in place
            if had_own:
                setattr(owner, name, previous)
            else:
                delattr(owner, name)
        self.patches.clear()

    def _on_training_thread(self) -> bool:
        return self.installed and threading.get_ident() == self.thread

    # -- the accumulation rule -------------------------------------------------------------

    def _accumulation_rule(self):
        """`fit_loop._should_accumulate` when present, else the documented fallback."""
        trainer = self.trainer
        private = getattr(getattr(trainer, "fit_loop", None), _SHOULD_ACCUMULATE, None)
        if callable(private):
            return lambda batch_idx: bool(private())
        _warn_once("no_should_accumulate",
                   "fit_loop._should_accumulate() is missing in this Lightning version; a group "
                   "now ends when (batch_idx + 1) is a multiple of accumulate_grad_batches or at "
                   "the epoch's last batch")

        def fallback(batch_idx: int) -> bool:
            every = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
            if (batch_idx + 1) % every == 0:
                return False
            if getattr(trainer.strategy, "handles_gradient_accumulation", False):
                return True
            total = getattr(trainer, "num_training_batches", math.inf)
            return not (total != math.inf and batch_idx + 1 >= total)

        return fallback

    # -- wrappers around Lightning's own calls ----------------------------------------------

    def _safely(self, step, *args):
        """Run one piece of bookkeeping inside a wrapper or hook of Lightning's own
        calls; a failure disarms this session (every wrapper then passes straight
        through) instead of reaching the training loop."""
        try:
            return step(*args)
        except Exception as exc:
            _warn_once("wrapper_failed", f"{getattr(step, '__name__', step)} failed ({exc!r}); "
                       "TraceML stops recording this fit")
            self.installed = False
            self.failed = True
            return None

    def _arming_wrapper(self, original):
        session = self

        def training_step(*args, **kwargs):
            if not session._on_training_thread():
                return original(*args, **kwargs)
            session.armed += 1
            try:
                return original(*args, **kwargs)
            finally:
                session.armed -= 1
                if not session.armed and session.forward_region is not None:
                    session._safely(session._close_forward)

        return training_step

    def _transfer_wrapper(self, original):
        session = self

        def batch_to_device(*args, **kwargs):
            if not (session._on_training_thread() and session.trainer.training):
                return original(*args, **kwargs)
            transfer = session._safely(session._transfer_start)
            try:
                return original(*args, **kwargs)
            finally:
                if transfer is not None:
                    session._safely(session._close, transfer)

        return batch_to_device

    def _optimizer_wrapper(self, original):
        session = self

        def optimizer_step(*args, **kwargs):
            if not session._on_training_thread():
                return original(*args, **kwargs)
            session._safely(session._optimizer_call_start)
            try:
                return original(*args, **kwargs)
            finally:
                session._safely(session._optimizer_call_end)

        return optimizer_step

    def _fetch_start_wrapper(self, original):
        session = self

        def before_fetch():
            original()
            if session._on_training_thread() and session.trainer.training \
                    and session.fetch_region is None:
                session._safely(session._fetch_start)

        return before_fetch

    def _fetch_end_wrapper(self, original):
        session = self

        def after_fetch():
            if session.fetch_region is not None:
                session._safely(session._fetch_end, isinstance(sys.exc_info()[1], StopIteration))
            original()

        return after_fetch

    # -- what the wrappers do ----------------------------------------------------------------

    def _transfer_start(self):
        # The micro-batch's traced region starts here, so it covers its transfer.
        self.open_batch_region()
        return self._open(RAW_H2D)

    def _optimizer_call_start(self) -> None:
        # The closure (training_step and backward) runs inside optimizer.step():
        # keep global optimizer hooks inert until on_before_optimizer_step.
        if self.optimizer_hold is None:
            self.optimizer_hold = RegionHold((RAW_OPTIMIZER_STEP,))

    def _optimizer_call_end(self) -> None:
        self._release_optimizer_hold()
        if self.optimizer_region is not None:
            self._close(self.optimizer_region)
            self.optimizer_region = None

    def _fetch_start(self) -> None:
        # device policy as for every phase: on CUDA the event pair gives the GPU-clock
        # input wait (how long the stream sat idle waiting for the batch)
        self.fetch_region = self._open(RAW_DATALOADER_NEXT)

    def _fetch_end(self, exhausted: bool) -> None:
        region, self.fetch_region = self.fetch_region, None
        if not exhausted:
            self._close(region)
        elif region in self.regions:
            # the epoch-ending next() delivered no batch: not input wait
            self.regions.remove(region)
            region.discard()

    def _close_forward(self) -> None:
        """A forward that raised left its region open."""
        self._close(self.forward_region)
        self.forward_region = None
        self.forward_depth = 0
        self.forward_stack.clear()

    # -- forward hooks -----------------------------------------------------------------------

    def _forward_pre(self, module, args):
        if self._on_training_thread():
            self._safely(self._forward_enter)
        return None

    def _forward_post(self, module, args, output):
        if self._on_training_thread() and self.forward_stack:
            self._safely(self._forward_exit)
        return None

    def _forward_enter(self) -> None:
        counted = self.armed > 0 and not self.in_backward and not self.in_autograd()
        self.forward_stack.append(counted)
        if counted:
            if self.forward_depth == 0:
                self.forward_region = self._open(RAW_FORWARD)
            self.forward_depth += 1

    def _forward_exit(self) -> None:
        if self.forward_stack.pop() and self.forward_depth:
            self.forward_depth -= 1
            if self.forward_depth == 0:
                self._close(self.forward_region)
                self.forward_region = None

    # -- callback events ---------------------------------------------------------------------

    def open_batch_region(self) -> None:
        """Start a micro-batch's traced region (and the group's memory window if new)."""
        if not self.group_open:
            self.group_open = True
            self.memory.reset()
        if self.batch_region is not None:  # a batch skipped without its end hook
            self._close(self.batch_region)
        self.batch_region = self._open(RAW_STEP_TIME)

    def batch_start(self) -> None:
        if self.batch_region is None:  # no transfer seen (e.g. a dataloader_iter step)
            self.open_batch_region()

    def batch_end(self, batch_idx: int) -> None:
        self._close(self.batch_region)
        self.batch_region = None
        if self.manual or not self.should_accumulate(batch_idx):
            self._complete_group()

    def backward_start(self) -> None:
        self.in_backward = True
        if self.backward_region is None:
            self.backward_region = self._open(RAW_BACKWARD)

    def backward_end(self) -> None:
        self._close(self.backward_region)
        self.backward_region = None
        self.in_backward = False

    def optimizer_start(self) -> None:
        self._release_optimizer_hold()
        if self.optimizer_region is None:
            self.optimizer_region = self._open(RAW_OPTIMIZER_STEP)

    def epoch_end(self) -> None:
        # A group still open here never reached an update Lightning performs at a
        # group boundary (a skipped batch, a stop request, or a strategy that owns
        # accumulation and carries the remainder over): it is not published.
        if self.group_open or self.regions:
            self._discard()

    def _complete_group(self) -> None:
        from traceml.step_events import complete_step_capture

        self._close_all()
        self.memory.read()
        complete_step_capture()
        self.group_open = False

    def _discard(self) -> None:
        from traceml.step_events import abort_step_capture

        self._close_all()
        abort_step_capture()
        self.group_open = False

    def finish(self) -> None:
        """Normal end of training (or teardown): drop an unfinished group, remove hooks."""
        try:
            self._discard()
        finally:
            self.uninstall()

    def fail(self) -> None:
        """An exception: abort everything since the last completed group, remove hooks."""
        self.finish()


# --- Attaching ------------------------------------------------------------------------------


def attach(trainer):
    """Add a TraceML callback to `trainer` (or reuse one already there); return it.

    Returns None and installs nothing when TraceML is disabled. The callback goes
    before the checkpoint callbacks, which Lightning keeps last, so checkpoint saving
    after a group stays outside the group's measured window.
    """
    if _disabled():
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


_CONNECTOR_MODULES = {ns + ".trainer.connectors.callback_connector": ns for ns in NAMESPACES}
_auto_lock = threading.Lock()
_finder: _ConnectorFinder | None = None


def _patch_connector(module) -> bool:
    """Wrap `_CallbackConnector._attach_model_callbacks` so every run gets our callback.

    Lightning calls it at the start of fit/validate/test/predict, after the model's
    `configure_callbacks` are merged and before setup and checkpoint restoration.
    """
    connector = getattr(module, "_CallbackConnector", None)
    original = getattr(connector, "_attach_model_callbacks", None) if connector else None
    if original is None:
        _warn_once("no_connector_seam", f"{module.__name__} has no _CallbackConnector."
                   "_attach_model_callbacks; add TraceMLCallback() to the Trainer yourself")
        return False
    if getattr(original, "__traceml_original__", None) is not None:
        return True

    def _attach_model_callbacks(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        try:
            attach(self.trainer)
        except Exception as exc:  # never break the user's fit
            _warn_once("attach_failed", f"automatic attach failed ({exc!r})")
        return result

    _attach_model_callbacks.__traceml_original__ = original
    _attach_model_callbacks.__doc__ = original.__doc__
    connector._attach_model_callbacks = _attach_model_callbacks
    return True


def _unpatch_connector(module) -> None:
    connector = getattr(module, "_CallbackConnector", None)
    current = vars(connector).get("_attach_model_callbacks") if connector else None
    original = getattr(current, "__traceml_original__", None)
    if original is not None:
        connector._attach_model_callbacks = original


class _PatchAfterExec(importlib.abc.Loader):
    """Delegating loader: runs the real module code, then patches the connector."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        with _auto_lock:
            if _finder is not None:
                _patch_connector(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _ConnectorFinder(importlib.abc.MetaPathFinder):
    """Patches Lightning's callback connector when it is first imported, so that
    `auto_attach()` costs nothing for scripts that never import Lightning."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _CONNECTOR_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchAfterExec(spec.loader)
        return spec


def auto_attach() -> bool:
    """Attach TraceML to every Lightning Trainer run in this process (used by `traceml run`).

    Patches the callback connector of each Lightning namespace already imported, and
    the others when they get imported. Returns False (and does nothing) when
    TraceML is disabled. Idempotent; `remove_auto_attach()` undoes it.
    """
    global _finder
    if _disabled():
        return False
    with _auto_lock:
        if _finder is None:
            _finder = _ConnectorFinder()
            sys.meta_path.insert(0, _finder)
        for name in _CONNECTOR_MODULES:
            module = sys.modules.get(name)
            if module is not None:
                _patch_connector(module)
    return True


def remove_auto_attach() -> None:
    """Undo `auto_attach()`: unpatch imported connectors and stop watching imports."""
    global _finder
    with _auto_lock:
        if _finder is not None:
            try:
                sys.meta_path.remove(_finder)
            except ValueError:
                pass
            _finder = None
        for name in _CONNECTOR_MODULES:
            module = sys.modules.get(name)
            if module is not None:
                _unpatch_connector(module)
