"""Hugging Face `transformers.Trainer` integration.

One TraceML step is one optimizer-update attempt: the owning callback opens
`traceml.trace_step` at `on_step_begin` and closes it at `on_step_end`, so the
accumulation microbatches of a group (`on_substep_end`) fold into one step and a
shorter last group of an epoch is one shorter step.

`init()` patches `transformers.Trainer` (the class, once per process) at five seams,
each in the module named for it:

- `_inner_training_loop` gets the lifecycle guard (`guard`). It is the function
  Accelerate's automatic batch-size retry calls again, so an exception leaving one
  attempt (`attempt`) aborts the open capture before the retry starts. The guard
  also picks one owning TraceML callback (`callback`) for the attempt (adding one
  when the Trainer has none), keeps DataLoader timing off for the attempt, and
  releases ownership when the attempt exits.
- `get_batch_samples` opens the collection window (`collection`): the Trainer's
  training iterator is wrapped in a proxy whose `next()` enables DataLoader timing
  and Accelerate's batch placement timing, then restores the outer policy.
- `accelerate.data_loader.send_to_device` is timed only inside that window; each
  observed placement records H2D plus a traced-step segment of the same span.
- `transformers.trainer.skip_first_batches` notes Accelerate's lazy skip (iterable
  datasets on resume), so the first resumed group is omitted entirely.
- `evaluate` and `predict` run with DataLoader timing off (`evaluation`), also
  outside `train()`, and what their forward passes and copies record is removed
  when they return.

Nothing here imports transformers or torch at module import; `auto_attach()` (what
`traceml run` calls, `installation`) defers installation to the moment the user's
script imports `transformers.trainer`.
"""
from __future__ import annotations

from typing import Any

from .callback import callback_type
from .installation import MIN_TRANSFORMERS, auto_attach, init, is_installed
from .reporting import CustomCollectionWarning


def __getattr__(name: str) -> Any:
    if name == "TraceMLTrainerCallback":
        return callback_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["init", "auto_attach", "is_installed", "CustomCollectionWarning", "TraceMLTrainerCallback"]
