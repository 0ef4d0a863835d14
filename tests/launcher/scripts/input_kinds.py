"""A gloo training loop fed by one of four kinds of input, with one rank slowed in one place.

The classes of issue 30 item 5, under `traceml run`: {DataLoader, no DataLoader} x
{marked, inferred steps} x {input, compute, inside-backward} stragglers, balanced runs,
DDP or FSDP2 (`fully_shard`) on CPU.

--input   dataloader: a torch DataLoader over tensors (its collate is the fetch);
          generator: a Python generator (a streaming reader);
          synthetic: tensors the loop makes itself each step;
          memmap: nanoGPT's `get_batch()`, random windows of a memory-mapped array.
--marked  steps marked with `traceml.trace_step(model)` (the fetch before it, as such loops
          are written); without it TraceML is not imported and steps are inferred from
          the optimizer updates. --time-input (marked) wraps the fetch in
          `traceml.timed_input()`, the one line DIAGNOSIS.md gives for it.
--slow    none, input (the rank's fetch sleeps), forward (its forward sleeps) or backward
          (a gradient hook sleeps, before DDP's all-reduce of that bucket), on --slow-rank,
          for --delay seconds per step.
Every rank's forward also waits --forward-sleep seconds (as on a device), so the step is
long enough that the scheduler's jitter on a busy 2-core host stays a small share of it.
--accum K: K micro-batches per update, `no_sync` on all but the last (DDP).
"""
import argparse
import contextlib
import os
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.dataloader import default_collate

parser = argparse.ArgumentParser()
parser.add_argument("--input", choices=("dataloader", "generator", "synthetic", "memmap"), default="generator")
parser.add_argument("--marked", action="store_true")
parser.add_argument("--time-input", action="store_true")
parser.add_argument("--slow", choices=("none", "input", "forward", "backward"), default="none")
parser.add_argument("--slow-rank", type=int, default=1)
parser.add_argument("--delay", type=float, default=0.04)
parser.add_argument("--forward-sleep", type=float, default=0.02)
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--accum", type=int, default=1)
parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
slow = rank == args.slow_rank
WIDTH, BATCH = 32, 8

inner = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, 4))
if slow and args.slow == "backward":
    inner[0].weight.register_hook(lambda grad: (time.sleep(args.delay), grad)[1])


def forward_wait(module, inputs):
    time.sleep(args.forward_sleep + (args.delay if slow and args.slow == "forward" else 0.0))


inner.register_forward_pre_hook(forward_wait)
if args.strategy == "fsdp":
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(inner)
else:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(inner)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def slow_fetch() -> None:
    if slow and args.slow == "input":
        time.sleep(args.delay)  # this rank's reader is slower


def batches():
    """The loop's input, one (x, y) per micro-batch, however the kind makes it."""
    total = args.steps * args.accum
    if args.input == "dataloader":
        def collate(items):
            slow_fetch()
            return default_collate(items)

        data = TensorDataset(torch.randn(total * BATCH, WIDTH), torch.randn(total * BATCH, 4))
        yield from DataLoader(data, batch_size=BATCH, collate_fn=collate)
    elif args.input == "generator":
        def stream():
            for _ in range(total):
                slow_fetch()
                yield torch.randn(BATCH, WIDTH), torch.randn(BATCH, 4)

        yield from stream()
    elif args.input == "synthetic":
        for _ in range(total):
            slow_fetch()
            yield torch.randn(BATCH, WIDTH), torch.randn(BATCH, 4)
    else:  # memmap, as nanoGPT's get_batch: random windows of a token file on disk
        folder = tempfile.mkdtemp(prefix=f"memmap-r{rank}-")
        path = os.path.join(folder, "tokens.bin")
        np.arange(64 * 1024, dtype=np.uint16).tofile(path)

        def get_batch():
            slow_fetch()
            data = np.memmap(path, dtype=np.uint16, mode="r")
            starts = np.random.randint(0, len(data) - WIDTH - 1, size=BATCH)
            x = torch.from_numpy(np.stack([data[s:s + WIDTH].astype(np.float32) for s in starts]))
            return x / 65536.0, torch.from_numpy(data[starts].astype(np.float32)).unsqueeze(1).repeat(1, 4)

        for _ in range(total):
            yield get_batch()


if args.marked:
    import traceml

    step_scope = lambda: traceml.trace_step(model)  # noqa: E731
    input_scope = traceml.timed_input if args.time_input else contextlib.nullcontext
else:
    step_scope = input_scope = contextlib.nullcontext

source = batches()
updates = 0
for _ in range(args.steps):
    micro = []
    for _ in range(args.accum):
        with input_scope():
            micro.append(next(source))  # the fetch, before the step as such loops are written
    with step_scope():
        for k, (x, y) in enumerate(micro):
            last = k == args.accum - 1
            sync = contextlib.nullcontext() if last or args.strategy == "fsdp" else model.no_sync()
            with sync:
                loss = nn.functional.mse_loss(model(x), y) / args.accum
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    updates += 1
print(f"rank {rank}: {updates} updates", flush=True)
dist.barrier()
dist.destroy_process_group()
