"""An unmodified plain PyTorch DDP loop on gloo (no `traceml` import unless --marked).

`traceml run` must give it steps from its optimizer updates. Variants:
--accum K (K micro-batches per update, `no_sync` on all but the last),
--optimizers 2 (two optimizers stepping in turn), --no-optimizer (an inference
loop), --marked (the same loop with `traceml.trace_step`, for comparison), and
--straggler-rank R with --delay-ms D (that rank's input pipeline sleeps D ms
per batch: an input straggler), --until-capture (rank 0 watches the job's processor until an
automatic deep capture of the run is done or failed, and the loop stops there; --updates then bounds
it: harness.capture_watch, so the repository root must be on PYTHONPATH).
"""
import argparse
import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.dataloader import default_collate

parser = argparse.ArgumentParser()
parser.add_argument("--updates", type=int, default=12)
parser.add_argument("--accum", type=int, default=1)
parser.add_argument("--optimizers", type=int, default=1, choices=(1, 2))
parser.add_argument("--no-optimizer", action="store_true")
parser.add_argument("--marked", action="store_true")
parser.add_argument("--straggler-rank", type=int, default=None)
parser.add_argument("--delay-ms", type=float, default=20.0)
parser.add_argument("--until-capture", action="store_true")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
slow = args.straggler_rank == rank


def collate(items):
    if slow:
        time.sleep(args.delay_ms / 1000.0)  # a slow input pipeline on this rank only
    return default_collate(items)


model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4)))
batches = args.updates * args.accum
data = TensorDataset(torch.randn(batches * 16, 64), torch.randn(batches * 16, 4))
loader = DataLoader(data, batch_size=16, collate_fn=collate)

if args.no_optimizer:
    model.eval()
    with torch.no_grad():
        for x, _ in loader:
            model(x)
    print(f"rank {rank}: evaluated {batches} batches", flush=True)
else:
    params = list(model.parameters())
    if args.optimizers == 2:
        optimizers = [torch.optim.SGD(params[:2], lr=0.01), torch.optim.Adam(params[2:], lr=1e-3)]
    else:
        optimizers = [torch.optim.SGD(params, lr=0.01)]
    if args.marked:
        import traceml

        step_scope = lambda: traceml.trace_step(model)  # noqa: E731
    else:
        step_scope = contextlib.nullcontext
    def update(micro_batches):
        for k, (x, y) in enumerate(micro_batches):
            sync = contextlib.nullcontext() if k == args.accum - 1 else model.no_sync()
            with sync:
                loss = nn.functional.mse_loss(model(x), y) / args.accum
                loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)

    watch = None
    if args.until_capture:  # imports traceml's wire vocabulary: only this variant does
        from harness.capture_watch import CaptureWatch, stop_together

        watch = CaptureWatch().start() if rank == 0 else None

    updates = 0
    it = iter(loader)
    for _ in range(args.updates):
        if args.accum == 1:
            batch = next(it)  # as a marked loop is written: next() before the step
            with step_scope():
                update([batch])
        else:
            with step_scope():
                update(next(it) for _ in range(args.accum))
        updates += 1
        if args.until_capture and stop_together(watch):  # every rank stops at the same update
            break
    print(f"rank {rank}: {updates} updates", flush=True)
dist.barrier()
dist.destroy_process_group()
