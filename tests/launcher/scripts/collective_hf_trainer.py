"""HF Trainer with its default settings on 2 gloo ranks, rank 1's dataset slow (no TraceML code).

`average_tokens_across_devices` is True by default and the model's forward takes the loss
kwargs, so `get_batch_samples` gathers the token count across ranks (Accelerate's
`gather` -> `torch.distributed.all_gather` on gloo): the fast rank waits there, before
the step, for the slow rank's batches.
"""
import os
import sys
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

SLOW_S = 0.02 if os.environ.get("RANK") == "1" else 0.0


class Tokens(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randn(n, 2, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if SLOW_S:
            time.sleep(SLOW_S)
        return {"x": self.x[i], "labels": self.y[i]}


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, x, labels=None, num_items_in_batch=None, **kwargs):
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
torch.set_num_threads(1)
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=4, learning_rate=0.01, report_to=[],
        save_strategy="no", logging_strategy="no", use_cpu=True, ddp_backend="gloo",
        ddp_find_unused_parameters=False, dataloader_num_workers=0, disable_tqdm=True,
    )
    assert args.average_tokens_across_devices  # the default this scenario is about
    Trainer(model=Tiny(), args=args, train_dataset=Tokens(256)).train()
