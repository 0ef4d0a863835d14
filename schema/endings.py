"""How a rank ended: the outcome values of the end marker and of the final summary.

The rank's end marker (`traceml.run.end`) carries `traceml.run.outcome` when the
process knew how its script ended (the `traceml run` bootstrap does); the final
summary reports one outcome per rank, combining that with the launcher's exit
codes (`processor/endings.py` owns the rule). Public strings: they appear in
`final_summary.json` and on the card. Standard library only.
"""
from __future__ import annotations

OUTCOME_FINISHED = "finished"
"""The script returned (or exited with status 0)."""
OUTCOME_INTERRUPTED = "interrupted"
"""KeyboardInterrupt / SIGINT (Ctrl-C), or a signal the launcher forwarded."""
OUTCOME_FAILED = "failed"
"""An exception or a non-zero exit status; the exit code says which when known."""
OUTCOME_LOST = "lost"
"""No end marker and no exit code: nothing says how the rank ended (summary only)."""

MARKER_OUTCOMES: tuple[str, ...] = (OUTCOME_FINISHED, OUTCOME_INTERRUPTED, OUTCOME_FAILED)
"""What a rank can say about itself on its end marker."""
OUTCOMES: tuple[str, ...] = (*MARKER_OUTCOMES, OUTCOME_LOST)
"""What the final summary reports per rank, in the card's order."""

EXIT_CODE_INTERRUPTED = 130
"""The shell's status for a process ended by SIGINT (128 + 2): what `python script.py`
exits with after an unhandled KeyboardInterrupt."""
