"""Fails on its first elastic attempt after --first-steps steps, succeeds on the next with --steps."""
import argparse
import os
import sys

import torch
from torch import nn

import traceml

parser = argparse.ArgumentParser()
parser.add_argument("--first-steps", type=int, default=8)
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(attempt)
model = nn.Linear(16, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(args.first_steps if attempt == 0 else args.steps):
    with traceml.trace_step(model):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
print(f"attempt {attempt} done", flush=True)
if attempt == 0:
    sys.exit(5)
