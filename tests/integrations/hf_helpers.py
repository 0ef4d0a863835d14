"""Tiny, offline Hugging Face Trainer set-ups for the integration tests.

The model is a plain `torch.nn.Module` that follows the Trainer's loss contract
(`forward(**batch)` returns a dict with `loss` when labels are given); the data are
in-memory map-style and iterable datasets. Nothing is downloaded.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Callable

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from traceml.schema.vocabulary import (
    RAW_BACKWARD,
    RAW_DATALOADER_NEXT,
    RAW_FORWARD,
    RAW_H2D,
    RAW_OPTIMIZER_STEP,
    RAW_STEP_TIME,
)

FEATURES = 4

SHORT = {
    RAW_DATALOADER_NEXT: "fetch",
    RAW_H2D: "h2d",
    RAW_FORWARD: "forward",
    RAW_BACKWARD: "backward",
    RAW_OPTIMIZER_STEP: "optimizer",
    RAW_STEP_TIME: "step",
}


def _sample(index: int, poisoned: frozenset[int]) -> dict[str, torch.Tensor]:
    value = math.inf if index in poisoned else index / 10.0
    return {"x": torch.full((FEATURES,), value), "labels": torch.tensor([index / 10.0])}


class MapDataset(torch.utils.data.Dataset):
    """`size` samples; samples listed in `poisoned` carry inf inputs (forces an AMP overflow)."""

    def __init__(self, size: int, poisoned: tuple[int, ...] = ()) -> None:
        self.size = size
        self.poisoned = frozenset(poisoned)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return _sample(index, self.poisoned)


class StreamDataset(torch.utils.data.IterableDataset):
    """The same samples, streamed: resuming makes Accelerate skip them lazily."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self):
        for index in range(self.size):
            yield _sample(index, frozenset())


class TinyRegressor(nn.Module):
    """One linear layer with the HF loss contract.

    `failure(model, x)` is called on every training forward and may raise (a crash
    mid-group, a CPU out-of-memory error that Accelerate retries).
    """

    def __init__(self, failure: Callable[["TinyRegressor", torch.Tensor], None] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(FEATURES, 1)
        self.failure = failure
        self.train_calls = 0
        self.eval_calls = 0
        self.batch_sizes: list[int] = []

    def forward(self, x, labels=None):
        if self.training:
            self.train_calls += 1
            self.batch_sizes.append(int(x.shape[0]))
            if self.failure is not None:
                self.failure(self, x)
        else:
            self.eval_calls += 1
        logits = self.proj(x)
        if labels is None:
            return {"logits": logits}
        return {"loss": ((logits - labels) ** 2).mean(), "logits": logits}


class HfStepLog(TrainerCallback):
    """What HF itself reports per update: global steps and whether Accelerate skipped the update."""

    def __init__(self, trainer_ref: list) -> None:
        self.trainer_ref = trainer_ref
        self.global_steps: list[int] = []
        self.skipped: list[bool] = []
        self.substeps = 0

    def on_substep_end(self, args, state, control, **kwargs):
        self.substeps += 1

    def on_step_end(self, args, state, control, **kwargs):
        self.global_steps.append(state.global_step)
        self.skipped.append(bool(self.trainer_ref[0].accelerator.optimizer_step_was_skipped))


def training_args(output_dir: str, **overrides) -> TrainingArguments:
    options = dict(
        output_dir=output_dir,
        per_device_train_batch_size=1,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=4,
        num_train_epochs=1,
        learning_rate=0.01,
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    options.update(overrides)
    return TrainingArguments(**options)


def make_trainer(output_dir: str, *, train_dataset, model: TinyRegressor | None = None,
                 trainer_class: type = Trainer, callbacks: list | None = None,
                 eval_dataset=None, **arg_overrides) -> tuple[Trainer, HfStepLog, TinyRegressor]:
    model = model or TinyRegressor()
    holder: list = []
    log = HfStepLog(holder)
    trainer = trainer_class(model=model, args=training_args(output_dir, **arg_overrides),
                            train_dataset=train_dataset, eval_dataset=eval_dataset,
                            callbacks=[log, *(callbacks or [])])
    holder.append(trainer)
    return trainer, log, model


def event_counts(record) -> dict[str, int]:
    """{'forward': 4, 'backward': 4, ...} for one published step (absent events omitted)."""
    return {SHORT.get(name, name): totals.count for name, totals in record.events.items()}


def per_step(records, kind: str) -> list[int]:
    return [event_counts(r).get(kind, 0) for r in records]


def totals(records) -> Counter:
    out: Counter = Counter()
    for record in records:
        out.update(event_counts(record))
    return out
