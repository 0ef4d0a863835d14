"""A tiny Hugging Face Trainer run with no TraceML code at all (offline, CPU, gloo under torchrun)."""
import sys
import tempfile

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments


class Pairs(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randn(n, 2, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
torch.set_num_threads(1)
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=0.01, report_to=[], save_strategy="no", logging_strategy="no",
        use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False, dataloader_num_workers=0, disable_tqdm=True,
    )
    Trainer(model=Tiny(), args=args, train_dataset=Pairs(256)).train()
