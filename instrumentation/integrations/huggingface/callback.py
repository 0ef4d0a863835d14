"""The TrainerCallback that brackets each optimizer-update group with `traceml.trace_step`.

The class subclasses transformers' `TrainerCallback`, so it is built on first use
(`callback_type()`), never at import.
"""
from __future__ import annotations

from typing import Any

import traceml

from .attempt import active_attempt, close_step, discard_pending, tracing
from .reporting import report

_callback_type: type | None = None


def callback_type() -> type:
    """The `TraceMLTrainerCallback` class (needs transformers, hence built on demand)."""
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
            attempt = active_attempt()
            if attempt is None:
                return self
            return attempt if attempt.owner is self else None

        def on_step_begin(self, args, state, control, **kwargs):
            if not tracing():
                return
            holder = self._holder()
            if holder is None or holder.omit_group:
                return
            try:
                if holder.step_cm is not None:
                    # A previous group never reached on_step_end and this group's input
                    # went into its capture: drop both rather than publish a mixture.
                    close_step(holder, RuntimeError("step left open"))
                    discard_pending()
                    holder.omit_group = True
                    return
                cm = traceml.trace_step(kwargs.get("model"))
                cm.__enter__()
                holder.step_cm = cm
            except Exception as exc:  # noqa: BLE001
                holder.step_cm = None
                report("opening the step", exc)

        def on_step_end(self, args, state, control, **kwargs):
            holder = self._holder()
            if holder is None:
                return
            if holder.omit_group:
                # Lazy resume skip: drop everything this group produced, count nothing.
                holder.omit_group = False
                try:
                    close_step(holder, RuntimeError("omitted group"))
                    discard_pending()
                except Exception as exc:  # noqa: BLE001
                    report("omitting the resumed group", exc)
                return
            close_step(holder)

        def on_train_end(self, args, state, control, **kwargs):
            # Only the unguarded fallback needs this; the guard cleans up its attempt.
            if active_attempt() is None and self.step_cm is not None:
                close_step(self, RuntimeError("training ended inside a step"))
                discard_pending()

    TraceMLTrainerCallback.__module__ = "traceml.integrations.huggingface"  # its public home
    _callback_type = TraceMLTrainerCallback
    return TraceMLTrainerCallback
