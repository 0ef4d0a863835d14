"""The Lightning callback: Lightning's hooks, turned into one training session per fit.

The callback owns what spans a whole stage (the DataLoader timing policy, the
holds that keep validation and non-fit stages out of training steps) and hands
each training hook to the `TrainSession` of the current fit (`session.py`). A
TraceML failure inside a hook warns once and ends recording for that fit; it never
reaches the training loop.
"""
from __future__ import annotations

from traceml.schema.vocabulary import (
    RAW_BACKWARD,
    RAW_DATALOADER_NEXT,
    RAW_FORWARD,
    RAW_H2D,
    RAW_OPTIMIZER_STEP,
)
from traceml.settings import kill_switch
from traceml.step_events import RegionHold

from .namespaces import PUBLIC_MODULE, callback_class, default_namespace
from .reporting import warn_once
from .session import TrainSession

PHASES = (RAW_DATALOADER_NEXT, RAW_H2D, RAW_FORWARD, RAW_BACKWARD, RAW_OPTIMIZER_STEP)
"""The phases this callback times itself: automatic mode's regions of these names stay quiet."""


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
            warn_once("hook_failed", f"{method.__name__} failed ({exc!r}); "
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
            cls = callback_class(namespace or default_namespace())
        return object.__new__(cls)

    def __init__(self, *, namespace: str | None = None) -> None:
        if namespace is not None and namespace != type(self).namespace:
            raise ValueError(f"namespace {namespace!r} does not match {type(self).namespace!r}")
        self._session: TrainSession | None = None
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
        if kill_switch():
            return
        _ensure_recording()
        # Lightning's steps come from this callback: none is inferred from optimizer updates.
        from traceml.step_boundary import claim_explicit

        claim_explicit()
        if self._scope is None:
            from traceml.timing import dataloader_timing_scope

            scope = dataloader_timing_scope(False)
            scope.__enter__()
            self._scope = scope
        if stage != "fit" and self._stage_hold is None:
            # validate/test/predict: nothing here is a training step
            self._stage_hold = RegionHold(PHASES)

    @_guarded
    def on_validation_start(self, trainer, pl_module) -> None:
        """Sanity check and validation inside fit never count towards a training step."""
        if self._eval_hold is None and not kill_switch():
            self._eval_hold = RegionHold(PHASES)

    @_guarded
    def on_validation_end(self, trainer, pl_module) -> None:
        hold, self._eval_hold = self._eval_hold, None
        if hold is not None:
            hold.release()

    @_guarded
    def on_train_start(self, trainer, pl_module) -> None:
        """Install hooks now: after checkpoint restore, strategy and EMA set-up."""
        if kill_switch():
            return
        self._drop_session()
        from traceml.step_events import abort_step_capture

        # Whatever sits in the pending capture was recorded before training
        # (sanity check, set-up): it belongs to no training step.
        abort_step_capture()
        session = self._session = TrainSession(trainer, pl_module)
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
            warn_once("hook_failed", f"on_exception failed ({exc!r})")
        finally:
            self._exit_scope()

    def teardown(self, trainer, pl_module, stage) -> None:
        try:
            self._release_holds()
            self._drop_session()
        except Exception as exc:
            warn_once("cleanup_failed", f"teardown failed ({exc!r})")
        finally:
            self._exit_scope()

    # -- internals -------------------------------------------------------------------

    def _drop_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                session.finish()
            except Exception as exc:
                warn_once("cleanup_failed", f"cleaning up after the fit failed ({exc!r})")

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


TraceMLCallback.__module__ = PUBLIC_MODULE


def _ensure_recording() -> None:
    """A manually added callback works without `traceml.init()`: start in manual mode."""
    import traceml

    initialised = getattr(traceml, "is_initialized", None)
    init = getattr(traceml, "init", None)
    if callable(initialised) and callable(init) and not initialised():
        init(mode="manual")
