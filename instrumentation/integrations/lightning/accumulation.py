"""Where an accumulation group ends: Lightning's own rule when it has one, else ours.

Under automatic optimisation one TraceML step is one accumulation group, so the
session asks after every micro-batch whether the group goes on. Lightning answers
that in a private method; this module owns the fallback for versions without it.
"""
from __future__ import annotations

import math
from typing import Callable

from .reporting import warn_once

_SHOULD_ACCUMULATE = "_should_accumulate"
"""The private FitLoop method that says whether the current micro-batch keeps accumulating."""


def accumulation_rule(trainer) -> Callable[[int], bool]:
    """`fit_loop._should_accumulate` when present, else the documented fallback."""
    private = getattr(getattr(trainer, "fit_loop", None), _SHOULD_ACCUMULATE, None)
    if callable(private):
        return lambda batch_idx: bool(private())
    warn_once("no_should_accumulate",
              "fit_loop._should_accumulate() is missing in this Lightning version; a group "
              "now ends when (batch_idx + 1) is a multiple of accumulate_grad_batches or at "
              "the epoch's last batch")

    def fallback(batch_idx: int) -> bool:
        every = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        if (batch_idx + 1) % every == 0:
            return False
        if getattr(trainer.strategy, "handles_gradient_accumulation", False):
            return True
        total = getattr(trainer, "num_training_batches", math.inf)
        return not (total != math.inf and batch_idx + 1 >= total)

    return fallback
