"""One guarded training attempt: who owns its steps and what it holds open.

An attempt is one call of `Trainer._inner_training_loop` (the guard in `guard.py`
opens and closes it). The callback, the collection window and the resume handling
all read the innermost attempt of the calling thread from here; this module does
not decide when an attempt starts or ends.
"""
from __future__ import annotations

import threading
from typing import Any

import traceml
from traceml import step_events
from traceml.settings import kill_switch

from .reporting import report

_local = threading.local()


def tracing() -> bool:
    """True while TraceML records in this process (initialised, not disabled)."""
    return traceml.is_initialized() and not kill_switch()


class Attempt:
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


def attempts() -> list:
    """This thread's open attempts, innermost last."""
    stack = getattr(_local, "attempts", None)
    if stack is None:
        stack = _local.attempts = []
    return stack


def active_attempt() -> Attempt | None:
    stack = attempts()
    return stack[-1] if stack else None


def close_step(holder: Any, exc: BaseException | None = None) -> None:
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
            report("closing the step", inner)


def discard_pending() -> None:
    step_events.abort_step_capture()
