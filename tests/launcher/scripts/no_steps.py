"""A script that never marks a step: inference only (no optimizer, no trace_step), or it fails first."""
import argparse
import sys

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--fail-with", type=int, default=None, help="exit with this code before any step")
parser.add_argument("--raise-error", action="store_true", help="raise an exception before any step")
args = parser.parse_args()

if args.raise_error:
    raise RuntimeError("broken before the first step")
if args.fail_with is not None:
    print(f"failing with exit code {args.fail_with} before any step", flush=True)
    sys.exit(args.fail_with)
torch.manual_seed(0)
model = nn.Linear(8, 2)
with torch.no_grad():
    for _ in range(5):
        model(torch.randn(4, 8))
print("inference done", flush=True)
