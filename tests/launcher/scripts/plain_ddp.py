"""Plain PyTorch DDP on gloo: no traceml.init(), only the step boundary (traceml run does the rest)."""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import traceml

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--fail-at", type=int, default=5)
parser.add_argument("--exit-code", type=int, default=7)
parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (long runs)")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
# What the bootstrap promises: run as __main__, argv as given, launched under traceml.
print(f"rank {rank}: __name__={__name__} argv={sys.argv[1:]} launched={os.environ.get('TRACEML_LAUNCHED')} "
      f"run_id={os.environ.get('TRACEML_RUN_ID')}", flush=True)
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(args.steps * 8, 32), torch.randn(args.steps * 8, 4))
for i, (x, y) in enumerate(DataLoader(data, batch_size=8)):
    with traceml.trace_step(model):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if args.step_sleep:
        time.sleep(args.step_sleep)
    if args.fail_rank == rank and i + 1 == args.fail_at:
        print(f"rank {rank}: failing on purpose after step {i + 1}", flush=True)
        sys.exit(args.exit_code)
dist.barrier()
dist.destroy_process_group()
traceml.shutdown()  # what the launcher would do after the script; done here because of the exit below
# torch 2.13 DDP on gloo can abort ("terminate called without an active exception") in interpreter
# teardown on a loaded CPU, with or without TraceML; everything is flushed, so leave without it.
sys.stdout.flush()
os._exit(0)
