"""Two gloo ranks (DDP on CPU) for `bench_capture_latency`, under `traceml run`: rank 1's forward
also sorts a tensor (aten::sort) that rank 0 never sorts, a compute straggler whose cause is one
operator (the case of tests/launcher/scripts/capture_job.py's `--slow op`, kept here because
benchmarks import no test module and the test's job also asks for a person's capture).

Steps are marked with `traceml.trace_step(model)`; every rank's forward waits 20 ms (as on a
device). The loop runs until the processor's automatic capture of the run has finished: rank 0
watches the run's captures on a thread (the URL `traceml run` gave the ranks in
TRACEML_CONTROL_ENDPOINT) and tells rank 1 through one all-reduce after each step, outside it.
--max-steps bounds it.
"""
import argparse
import json
import os
import threading
import time
import urllib.request

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import traceml
from traceml.schema.capture import CAPTURES_PATH

parser = argparse.ArgumentParser()
parser.add_argument("--sort-elements", type=int, default=100_000)
parser.add_argument("--max-steps", type=int, default=1500)
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
WIDTH, BATCH = 32, 8
RUN_ID = os.environ["TRACEML_RUN_ID"]
ENDPOINT = os.environ.get("TRACEML_CONTROL_ENDPOINT", "").split(",")[0].rstrip("/")

inner = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, 4))
to_sort = torch.rand(args.sort_elements)


def forward_wait(module, inputs):
    time.sleep(0.02)
    if rank == 1:
        torch.sort(to_sort)


inner.register_forward_pre_hook(forward_wait)
model = DistributedDataParallel(inner)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
done = threading.Event()


def finished() -> bool:
    try:
        with urllib.request.urlopen(f"{ENDPOINT}{CAPTURES_PATH}?run_id={RUN_ID}", timeout=5) as answer:
            captures = json.loads(answer.read())["captures"]
    except OSError:  # a busy processor: ask again
        return False
    return any(c["trigger"] != "manual" and c["status"] in ("done", "failed") for c in captures)


def watch() -> None:
    try:
        while not finished():
            time.sleep(0.3)
    finally:
        done.set()


if rank == 0:
    threading.Thread(target=watch, daemon=True).start()

updates = 0
for _ in range(args.max_steps):
    with traceml.timed_input():
        x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, 4)
    with traceml.trace_step(model):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    updates += 1
    flag = torch.tensor([1.0 if done.is_set() else 0.0])
    dist.all_reduce(flag)
    if flag.item() > 0:
        break
print(f"rank {rank}: {updates} updates", flush=True)
dist.barrier()
dist.destroy_process_group()
