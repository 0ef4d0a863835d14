"""Bounded polling: how tests wait for another thread or process without a fixed sleep."""
from __future__ import annotations

import time
from typing import Callable


def wait_until(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.02) -> bool:
    """Poll `predicate` until it is truthy or `timeout_s` has passed; one last look at the end.

    The timeout is a "did not hang" bound, never a performance claim: a slow machine
    only makes the wait longer, not the test wrong.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
