"""Stopping on SIGTERM / SIGINT without taking a lock inside the signal handler.

A Python signal handler runs on the main thread between two bytecodes, wherever that
thread is: inside `threading.Event.wait` (which holds the event's lock on its way in and
out), inside a logging call (the handler's lock), or inside an earlier handler that a
second signal interrupted. A handler that takes one of those locks then waits for
itself forever: an ingest worker whose parent was killed got its parent-death SIGTERM
more than once and hung in `Event.set` under `Event.wait`, outliving the processor.
So the handler here only stores the signal's number in a plain attribute, and the main
thread polls it (`wait`), logging and stopping outside the handler.
"""
from __future__ import annotations

import signal
import threading
import time

POLL_S = 0.25
"""How often the waiting main thread looks at the flag: the stop's added latency at most."""


class SignalStop:
    """The first of the installed signals to arrive, noted without any lock."""

    __slots__ = ("signum",)

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self, *signals: int) -> "SignalStop":
        """Handle `signals` on this (the main) thread from now on."""
        for sig in signals:
            signal.signal(sig, self._note)
        return self

    def _note(self, signum, _frame) -> None:
        if self.signum is None:  # an attribute store: nothing here can block
            self.signum = signum

    def wait(self, also: threading.Event | None = None, poll_s: float = POLL_S) -> int | None:
        """Block until a signal arrived (its number) or `also` is set (None)."""
        while self.signum is None:
            if also is None:
                time.sleep(poll_s)
            elif also.wait(poll_s):
                break
        return self.signum
