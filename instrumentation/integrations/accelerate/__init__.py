"""Hugging Face Accelerate without the Trainer: a plain `accelerate` loop, zero code changes.

A loop written against `Accelerator` (`prepare`, `accelerator.backward`,
`accelerator.accumulate(model)`, `optimizer.step()` every micro-batch) gets its
steps from automatic mode's inferred boundaries (`traceml.step_boundary`): one
step per real optimizer update. Accelerate's `AcceleratedOptimizer.step` calls
the wrapped optimizer only when `GradientState.sync_gradients` is true (every
`gradient_accumulation_steps` micro-batches, and at the end of a prepared
DataLoader, which Accelerate knows one batch ahead: `end_of_dataloader`), so
the groups come out as Accelerate forms them: 11 micro-batches with
accumulation 3 are steps of 3, 3, 3 and 2 micro-batches. Input wait is the
prepared DataLoader's own `next()` on the torch DataLoader it wraps (automatic
mode's patch); backward is `accelerator.backward`'s `loss.backward()`.

The one Accelerate seam (`installation`): `Accelerator.prepare_model` names the
model it returns (`step_boundary.note_model`), so forward is timed from the first
micro-batch on, on exactly the module the loop calls (the DDP wrapper on several
processes), with no search. Under the HF Trainer (which drives Accelerate too)
the Trainer integration owns the steps and this seam does nothing.

`auto_attach()` (what `traceml run` calls) never imports accelerate: it waits for
the script to import `accelerate.accelerator`.
"""
from __future__ import annotations

from .installation import auto_attach, init, is_installed, remove

__all__ = ["auto_attach", "init", "is_installed", "remove"]
