"""How this rank's script ended, noted by whoever ran it and read by the run-end marker.

The exporter sends `traceml.run.end` from `traceml.shutdown()`, which does not
know why it is called: after a clean return, a KeyboardInterrupt or a crash the
marker looked the same, and a run stopped by Ctrl-C read as finished cleanly.
The `traceml run` bootstrap runs the script, so it knows; it notes the ending
here just before it shuts TraceML down, and the marker carries it
(`traceml.run.outcome`, `traceml.run.exit_code`). Nothing noted (a script that
calls `traceml.shutdown()` itself, or one not started by `traceml run`): the
marker carries no outcome and the processor goes by the launcher's exit codes.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from traceml.schema.endings import (
    EXIT_CODE_INTERRUPTED,
    OUTCOME_FAILED,
    OUTCOME_FINISHED,
    OUTCOME_INTERRUPTED,
)


@dataclass(frozen=True, slots=True)
class ProcessEnding:
    outcome: str  # schema.endings.MARKER_OUTCOMES
    exit_code: int | None  # the status this ending gives the process; None: not known


_lock = threading.Lock()
_noted: ProcessEnding | None = None


def ending_of(exc: BaseException | None) -> ProcessEnding:
    """The ending a script's exception (None: it returned) implies, as `python script.py` exits."""
    if exc is None:
        return ProcessEnding(OUTCOME_FINISHED, 0)
    if isinstance(exc, KeyboardInterrupt):
        return ProcessEnding(OUTCOME_INTERRUPTED, EXIT_CODE_INTERRUPTED)
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None or code == 0:
            return ProcessEnding(OUTCOME_FINISHED, 0)
        # sys.exit("message") prints the message and exits 1; an int is the status (mod 256).
        status = code & 0xFF if isinstance(code, int) and not isinstance(code, bool) else 1
        return ProcessEnding(OUTCOME_FINISHED if status == 0 else OUTCOME_FAILED, status)
    return ProcessEnding(OUTCOME_FAILED, 1)


def note_ending(ending: ProcessEnding) -> None:
    global _noted
    with _lock:
        _noted = ending


def noted_ending() -> ProcessEnding | None:
    with _lock:
        return _noted
