"""Leaving a process without the interpreter's teardown, once what a normal exit owes is done.

After `import torch`, the interpreter's teardown (freeing every module torch loaded, one by
one) is the slowest part of ending a process (docs/performance.md). A process that holds
nothing the teardown would save can skip it: the steps of a normal exit that matter run
first, atexit handlers (logging's flush among them) and flushing stdout and stderr, then the
process ends with its status. `traceml`'s console script leaves this way after a command
that imported torch (`run`, `demo`), and a rank does after its flush when
TRACEML_EXIT_AFTER_FLUSH is set (`launcher/bootstrap.py`).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def others_still_running() -> bool:
    """A non-daemon thread besides this one is alive: a normal exit would wait for it."""
    current = threading.current_thread()
    return any(t is not current and not t.daemon and t.is_alive() for t in threading.enumerate())


def exit_without_teardown(code: int) -> NoReturn:
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, a broken pipe, or None
            pass
    os._exit(code)
