"""A tiny Lightning fit with no TraceML code at all (CPU, DDP over gloo under torchrun)."""
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
nproc = int(sys.argv[2]) if len(sys.argv) > 2 else 2
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(512, 16, generator=g), torch.randn(512, 2, generator=g))
trainer = L.Trainer(accelerator="cpu", devices=nproc, strategy="ddp", max_steps=steps,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0)
trainer.fit(Tiny(), DataLoader(data, batch_size=8))
