"""The training strategy as the model shows it: FSDP recognised from the trained module.

The resource's `traceml.training.strategy` is fixed when the exporter starts, from
`init(strategy=)`, `TRACEML_TRAINING_STRATEGY` or the world size (`ddp` above one rank),
before any model exists; an unmodified FSDP loop under `traceml run` would be diagnosed
by the DDP rules. When a module first gets forward timing (`trace_step(model)`,
`wrap_forward`, or automatic mode's model search at an optimizer's first update: once per
model, never per step), `note_model` looks for FSDP state on it or its submodules:
FSDP1's `FullyShardedDataParallel` wrapper, FSDP2's `fully_shard` (the module's class
becomes a subclass of `FSDPModule`). The classes are read from the modules torch has
already imported, so a job that never touched FSDP imports nothing more. What is found
rides on every later step record (`ResolvedStepTime.strategy`) and from there on the step
span (`docs/wire-format.md`).
"""
from __future__ import annotations

import sys

from traceml.schema.vocabulary import STRATEGY_FSDP

detected: str | None = None
"""The strategy recognised from the model (`fsdp`), else None: the resource's stands."""

_FSDP_CLASSES = (
    ("torch.distributed.fsdp", "FullyShardedDataParallel"),  # FSDP1
    ("torch.distributed.fsdp", "FSDPModule"),  # FSDP2, torch >= 2.6
    ("torch.distributed._composable.fsdp", "FSDPModule"),  # FSDP2 before 2.6
    ("torch.distributed._composable.fsdp.fully_shard", "FSDPModule"),
)


def _fsdp_classes() -> tuple[type, ...]:
    found = []
    for module_name, name in _FSDP_CLASSES:
        cls = getattr(sys.modules.get(module_name), name, None)
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return tuple(found)


def model_strategy(model) -> str | None:
    """`fsdp` when `model` or one of its submodules is FSDP-wrapped or `fully_shard`ed, else None."""
    classes = _fsdp_classes()
    if not classes:
        return None
    try:
        modules = model.modules()
        return STRATEGY_FSDP if any(issubclass(type(m), classes) for m in modules) else None
    except Exception:  # not an nn.Module, or a module whose traversal fails: nothing recognised
        return None


def note_model(model) -> None:
    """Remember the strategy `model` shows (once one is found it stays: a run does not change it)."""
    global detected
    if detected is None:
        detected = model_strategy(model)


def reset() -> None:
    """Forget what was recognised (a new session in the same process, tests)."""
    global detected
    detected = None


__all__ = ["detected", "model_strategy", "note_model", "reset"]
