"""`evaluate` and `predict` kept out of every training capture.

They consume their own dataloaders, also outside `train()`. Inside them DataLoader
timing is off; forward timing and host-to-device copies still record while
recording is on, so what the call adds to the capture is removed when it returns.
"""
from __future__ import annotations

import functools

from traceml import step_events, timing

from .attempt import tracing
from .reporting import report


class _OutsideTraining:
    """A capture that did not exist before the call is discarded whole; an existing
    one (evaluate called from inside an open step) is cut back to its length before."""

    __slots__ = ("_scope", "_capture", "_length")

    def __enter__(self):
        self._capture = None
        self._length = 0
        try:
            if step_events.has_active_capture():
                self._capture = step_events.current_capture()
                self._length = len(self._capture.events)
        except Exception as exc:  # noqa: BLE001
            report("isolating evaluation", exc)
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
            report("isolating evaluation", exc)
        return False


def wrap_outside_train(original):
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if not tracing():
            return original(self, *args, **kwargs)
        with _OutsideTraining():
            return original(self, *args, **kwargs)

    return wrapper
