"""The job `checks/gpu.py`'s deep-capture case runs under `traceml run --nproc-per-node 2` (issue 33).

Not a check itself: two gloo ranks train a DDP model on one device, and rank 1's forward also
sorts a large tensor (aten::sort, on a GPU its radix-sort kernels) that rank 0 never sorts, so
rank 1 is a compute straggler whose cause is one operator. tests/launcher/scripts/capture_job.py
is the suite's CPU form of the same case; this one is written for one GPU shared by both ranks:

- gloo, not NCCL: two NCCL ranks cannot share one device, while gloo reduces CUDA tensors
  through the host. Both ranks' model and tensors live on cuda:0 (`--device cuda`); with
  `--device cpu` the same job runs on the CPU, to exercise the check's reading of a run where
  no GPU is lent;
- the sort's size is calibrated on rank 1 before training (plain CUDA events on a GPU) and
  repeated until it costs about `--extra-ms` per step, so the difference dominates the step
  whatever the device's speed;
- rank 0 watches the processor's captures of the run (the URL `traceml run` gave the ranks in
  TRACEML_CONTROL_ENDPOINT) on a thread; once the automatic capture is done or failed, or
  `--max-seconds` passed, it writes what the route answered (each captured rank's activities
  included) to capture_seen.json in the working directory and tells rank 1 to stop through one
  all-reduce after each step, outside it.
"""
import argparse
import json
import math
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
parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
parser.add_argument("--extra-ms", type=float, default=30.0, help="rank 1's extra sort time per step")
parser.add_argument("--sort-elements", type=int, default=None,
                    help="default: 2**26 on a GPU, 100,000 on a CPU")
parser.add_argument("--max-seconds", type=float, default=60.0)
parser.add_argument("--max-steps", type=int, default=5000)
args = parser.parse_args()

ON_GPU = args.device == "cuda"
if ON_GPU:
    torch.cuda.set_device(0)  # both ranks on the one device, whatever their LOCAL_RANK
else:
    torch.set_num_threads(1)
DEVICE = torch.device("cuda", 0) if ON_GPU else torch.device("cpu")
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
slow = rank == 1
WIDTH, BATCH = (1024, 256) if ON_GPU else (32, 8)
ELEMENTS = args.sort_elements or ((1 << 26) if ON_GPU else 100_000)
RUN_ID = os.environ["TRACEML_RUN_ID"]
ENDPOINT = os.environ.get("TRACEML_CONTROL_ENDPOINT", "").split(",")[0].rstrip("/")


def sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def sort_ms(values: torch.Tensor, repeats: int = 3) -> float:
    """Median time of one sort of `values`: CUDA events on a GPU, the clock on a CPU."""
    for _ in range(2):
        torch.sort(values)
    sync()
    times = []
    for _ in range(repeats):
        if ON_GPU:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.sort(values)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            torch.sort(values)
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


to_sort = torch.rand(ELEMENTS, device=DEVICE) if slow else None
sorts = max(1, math.ceil(args.extra_ms / sort_ms(to_sort))) if slow else 0
if slow:
    print(f"rank 1: {sorts} sort(s) of {ELEMENTS} elements per forward "
          f"(about {args.extra_ms:.0f} ms on {DEVICE})", flush=True)

inner = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4)).to(DEVICE)


def extra_operator(module, inputs):
    for _ in range(sorts):  # rank 0: none
        torch.sort(to_sort)


inner.register_forward_pre_hook(extra_operator)
model = DistributedDataParallel(inner, device_ids=[0] if ON_GPU else None)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
done = threading.Event()


def captures() -> list:
    try:
        with urllib.request.urlopen(f"{ENDPOINT}{CAPTURES_PATH}?run_id={RUN_ID}", timeout=5) as answer:
            return json.loads(answer.read())["captures"]
    except OSError:  # a busy processor: ask again
        return []


def watch() -> None:
    """Rank 0: wait for the automatic capture to end (or the time bound), keep what the route said."""
    deadline = time.monotonic() + args.max_seconds
    seen: list = []
    try:
        while time.monotonic() < deadline:
            seen = captures()
            if any(c["trigger"] != "manual" and c["status"] in ("done", "failed") for c in seen):
                break
            time.sleep(0.3)
        with open("capture_seen.json", "w") as out:
            json.dump({"captures": seen, "timed_out": time.monotonic() >= deadline}, out)
    finally:
        done.set()


if rank == 0:
    threading.Thread(target=watch, daemon=True).start()

updates = 0
t0 = time.monotonic()
for _ in range(args.max_steps):
    with traceml.timed_input():
        x, y = torch.randn(BATCH, WIDTH, device=DEVICE), torch.randn(BATCH, 4, device=DEVICE)
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
sync()
print(f"rank {rank}: {updates} updates in {time.monotonic() - t0:.1f} s", flush=True)
dist.barrier()
dist.destroy_process_group()
