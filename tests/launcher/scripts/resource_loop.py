"""A plain training loop for the resource findings: optionally leaking host memory from a step on
(a growing list of tensors kept alive, as a loop that stores its losses' graphs would), and
optionally input-bound (a dataset whose items take a while to load).

No traceml import: under `traceml run` the steps are inferred from optimizer updates, and the
resource sampler runs on its own thread.
"""
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=120)
parser.add_argument("--leak-from", type=int, default=None, help="from this step on, keep --leak-mb per step alive")
parser.add_argument("--leak-mb", type=float, default=8.0)
parser.add_argument("--input-sleep", type=float, default=0.0, help="seconds each batch takes to load")
parser.add_argument("--step-sleep", type=float, default=0.02, help="seconds of the step outside the model")
args = parser.parse_args()


class Items(Dataset):
    def __len__(self):
        return args.steps * 4

    def __getitem__(self, index):
        if args.input_sleep:
            time.sleep(args.input_sleep / 4)  # batch of 4: the batch takes --input-sleep
        return torch.randn(32), torch.randn(4)


torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
kept = []
for step, (x, y) in enumerate(DataLoader(Items(), batch_size=4)):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if args.leak_from is not None and step >= args.leak_from:
        kept.append(torch.ones(int(args.leak_mb * 2**20 / 4)))  # written, so resident
    time.sleep(args.step_sleep)
print(f"done, kept {len(kept)} tensors", flush=True)
