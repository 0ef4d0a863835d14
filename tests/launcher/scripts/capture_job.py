"""Two gloo ranks (DDP on CPU) for the deep-capture real runs of issue 33, under `traceml run`.

--slow op     rank 1's forward also sorts a tensor (aten::sort), which rank 0 skips: a compute
              straggler whose cause is one operator.
--slow input  rank 1's fetch sleeps --delay seconds inside `traceml.timed_input()`: an input
              straggler.
--ask         once the processor's automatic capture of the run finished, rank 0 asks for one
              more with `traceml capture` against the live run (a person's request), and writes
              what the command printed to capture_cli.json in the working directory.

Steps are marked with `traceml.trace_step(model)`. The loop runs until what the run is for has
happened (the automatic capture finished, and with --ask the command returned): rank 0 watches the
processor's captures of the run (the URL `traceml run` gave the ranks in TRACEML_CONTROL_ENDPOINT)
on a thread and tells rank 1 through one all-reduce after each step, outside it. --max-steps bounds
it; every rank's forward waits 20 ms (as on a device).
"""
import argparse
import json
import os
import subprocess
import sys
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
parser.add_argument("--slow", choices=("op", "input"), required=True)
parser.add_argument("--delay", type=float, default=0.02)
parser.add_argument("--sort-elements", type=int, default=100_000)
parser.add_argument("--ask", action="store_true")
parser.add_argument("--max-steps", type=int, default=600)
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
slow = rank == 1
WIDTH, BATCH = 32, 8
RUN_ID = os.environ["TRACEML_RUN_ID"]
ENDPOINT = os.environ.get("TRACEML_CONTROL_ENDPOINT", "").split(",")[0].rstrip("/")

inner = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, 4))
to_sort = torch.rand(args.sort_elements)


def forward_wait(module, inputs):
    time.sleep(0.02)
    if slow and args.slow == "op":
        torch.sort(to_sort)


inner.register_forward_pre_hook(forward_wait)
model = DistributedDataParallel(inner)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
done = threading.Event()


def captures() -> list:
    try:
        with urllib.request.urlopen(f"{ENDPOINT}{CAPTURES_PATH}?run_id={RUN_ID}", timeout=5) as answer:
            return json.loads(answer.read())["captures"]
    except OSError:  # a busy processor: ask again
        return []


def person_asks() -> dict:
    """`traceml capture` against this live run, retried while another capture is in progress."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    env["TRACEML_CONTROL_ENDPOINT"] = ENDPOINT
    command = [sys.executable, "-m", "traceml.launcher.cli", "capture", "--run", RUN_ID, "--rank", "1",
               "--reference", "0", "--steps", "3", "--wait", "90"]
    for _ in range(60):
        cli = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        if not (cli.returncode == 2 and ": 409" in cli.stderr):
            break
        time.sleep(0.5)
    return {"returncode": cli.returncode, "stdout": cli.stdout, "stderr": cli.stderr}


def watch() -> None:
    """Rank 0: wait for the automatic capture to finish, then (--ask) ask for another."""
    try:
        while not any(c["trigger"] != "manual" and c["status"] in ("done", "failed") for c in captures()):
            time.sleep(0.3)
        if args.ask:
            with open("capture_cli.json", "w") as out:
                json.dump(person_asks(), out)
    finally:
        done.set()


if rank == 0:
    threading.Thread(target=watch, daemon=True).start()


def fetch():
    if slow and args.slow == "input":
        time.sleep(args.delay)  # this rank's reader is slower
    return torch.randn(BATCH, WIDTH), torch.randn(BATCH, 4)


updates = 0
for _ in range(args.max_steps):
    with traceml.timed_input():
        x, y = fetch()
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
