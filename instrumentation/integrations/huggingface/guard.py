"""The lifecycle guard on `Trainer._inner_training_loop`: one attempt per call.

It is the function Accelerate's automatic batch-size retry calls again, so an
exception leaving one attempt aborts the open capture before the retry starts. At
the start the guard picks one owning TraceML callback (adding one when the Trainer
has none) and keeps DataLoader timing off; at the end it releases ownership and
removes a callback it added.
"""
from __future__ import annotations

import functools
from typing import Any

from traceml import step_boundary, timing

from . import collection
from .attempt import Attempt, attempts, close_step, discard_pending, tracing
from .callback import callback_type
from .reporting import report


def begin_attempt(trainer: Any) -> Attempt:
    # The Trainer marks its own steps (one per optimizer-update group): no step is
    # inferred from optimizer updates in this process from now on.
    step_boundary.claim_explicit()
    attempt = Attempt(trainer)
    kind = callback_type()
    handler = trainer.callback_handler
    ours = [cb for cb in handler.callbacks if isinstance(cb, kind)]
    if not ours:
        attempt.added_callback = kind()
        handler.callbacks.append(attempt.added_callback)
        ours = [attempt.added_callback]
    attempt.owner = ours[0]
    attempt.collection_bypassed = collection.bypassed(trainer)
    # Events left pending before training (a batch inspected by hand, say) are not
    # part of the first optimizer group.
    discard_pending()
    attempts().append(attempt)
    return attempt


def end_attempt(attempt: Attempt, exc: BaseException | None) -> None:
    stack = attempts()
    if attempt in stack:
        stack.remove(attempt)
    try:
        if attempt.step_cm is not None:
            # An exception, or a stop requested mid-group: the group is not published.
            close_step(attempt, exc if exc is not None else RuntimeError("unfinished group"))
        discard_pending()
    except Exception as inner:  # noqa: BLE001
        report("cleaning up the training attempt", inner)
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


def guard_inner_training_loop(original):
    @functools.wraps(original)
    def _inner_training_loop(self, *args, **kwargs):
        if not tracing():
            return original(self, *args, **kwargs)
        try:
            attempt = begin_attempt(self)
        except Exception as exc:  # noqa: BLE001
            report("starting the training attempt", exc)
            return original(self, *args, **kwargs)
        try:
            with timing.dataloader_timing_scope(False):
                result = original(self, *args, **kwargs)
        except BaseException as exc:
            end_attempt(attempt, exc)
            raise
        end_attempt(attempt, None)
        return result

    return _inner_training_loop
