"""A plain Hugging Face Accelerate loop (no Trainer, no `traceml` import).

`Accelerator.prepare`, `accelerator.accumulate(model)`, `accelerator.backward`,
`optimizer.step()` on every micro-batch; Accelerate skips the update until the
group is complete or the prepared DataLoader ends. With --accum 3 and 11
micro-batches per process the updates come after 3, 3, 3 and 2 micro-batches.
"""
import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--accum", type=int, default=3)
parser.add_argument("--micro-batches", type=int, default=11, help="per process")
args = parser.parse_args()

torch.set_num_threads(1)
accelerator = Accelerator(gradient_accumulation_steps=args.accum, cpu=True)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
n = args.micro_batches * accelerator.num_processes
loader = DataLoader(TensorDataset(torch.randn(n, 16), torch.randn(n, 2)), batch_size=1)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
updates = 0
for x, y in loader:
    with accelerator.accumulate(model):
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        updates += int(accelerator.sync_gradients)
print(f"process {accelerator.process_index}: {updates} updates", flush=True)
accelerator.wait_for_everyone()
accelerator.end_training()
