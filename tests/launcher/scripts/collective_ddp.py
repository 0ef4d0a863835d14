"""DDP on gloo with an optional slow rank inside backward (a gradient hook that sleeps), or an
explicit all_reduce per step: the collective-wait scenarios `traceml run` is tested on.

No traceml import: under `traceml run` the steps are inferred from optimizer updates.
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--slow-rank", type=int, default=None, help="this rank's backward sleeps --delay s")
parser.add_argument("--delay", type=float, default=0.04)
parser.add_argument("--explicit-sleep", type=float, default=0.0,
                    help="rank 0 sleeps this before an explicit all_reduce each step (the others wait for it)")
parser.add_argument("--allreduce-mb", type=float, default=0.0,
                    help="every rank all-reduces a tensor this large each step (communication-bound)")
parser.add_argument("--forward-sleep", type=float, default=0.0,
                    help="every rank's forward also waits this long (s), as on a device: a step long enough"
                         " that the scheduler's jitter on a busy host is a small share of it")
parser.add_argument("--drift-from", type=int, default=None, help="from this step on, every rank is slower")
parser.add_argument("--drift-delay", type=float, default=0.02, help="seconds added per step from --drift-from")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
inner = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
if rank == args.slow_rank:
    # A slower device during backward: the hook runs on this rank's autograd, before DDP's
    # all-reduce of that bucket, so the other ranks wait for it inside their backward.
    inner[0].weight.register_hook(lambda grad: (time.sleep(args.delay), grad)[1])
if args.forward_sleep:
    inner.register_forward_pre_hook(lambda module, inputs: time.sleep(args.forward_sleep))
model = DistributedDataParallel(inner)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn(args.steps * 8, 32), torch.randn(args.steps * 8, 4))
payload = torch.ones(int(args.allreduce_mb * 2**20 / 4)) if args.allreduce_mb else None
for step, (x, y) in enumerate(DataLoader(data, batch_size=8)):
    if args.drift_from is not None and step >= args.drift_from:
        time.sleep(args.drift_delay)  # the whole job slows down alike: cross-rank rules cannot see it
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    if args.explicit_sleep:
        if rank == 0:
            time.sleep(args.explicit_sleep)  # rank 0 is late to every all_reduce: the others wait
        flag = torch.ones(1)
        dist.all_reduce(flag)
    if payload is not None:
        dist.all_reduce(payload)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"rank {rank}: done", flush=True)
dist.barrier()
dist.destroy_process_group()
