"""Lightning integration: TraceML steps from a Lightning `Trainer`, in either namespace.

`lightning.pytorch` and `pytorch_lightning` ship the same loops under two import
names whose classes are distinct, so nothing here imports either at module import:
the callback class is built on first use for the namespace of the trainer at hand
(`namespaces`).

Step boundaries (docs/integrations/lightning.md has the full story):
- automatic optimisation: one TraceML step is one accumulation group. Every
  micro-batch opens and closes its own traced region; the capture and the peak-memory
  window stay open until `fit_loop._should_accumulate()` turns false (`accumulation`);
- manual optimisation: one TraceML step is one batch;
- an exception aborts everything captured since the last completed group.

Timed phases and where they come from (the callback's hooks, `callback`, and the
wrappers around Lightning's own calls, `seams`, both feeding one `session` per fit):
- input wait: the training fetcher's own before/after-fetch seam (validation and
  test fetchers have their own fetcher and are never timed);
- traced step: one region per micro-batch, from its transfer to the device until
  `on_train_batch_end`;
- H2D: `strategy.batch_to_device` during training;
- forward: calls to the LightningModule or one of its direct children while
  `training_step` runs (outermost call only; never while the autograd engine
  runs, so activation-checkpointing recomputation is not counted);
- backward: `on_before_backward` .. `on_after_backward`;
- optimizer: `on_before_optimizer_step` .. return of `strategy.optimizer_step`.

`attach(trainer)` and `auto_attach()` (what `traceml run` calls) live in `attaching`.
"""
from __future__ import annotations

from .attaching import attach, auto_attach, remove_auto_attach
from .callback import TraceMLCallback
from .namespaces import NAMESPACES, callback_class, trainer_namespace

__all__ = [
    "NAMESPACES",
    "TraceMLCallback",
    "attach",
    "auto_attach",
    "callback_class",
    "remove_auto_attach",
    "trainer_namespace",
]
