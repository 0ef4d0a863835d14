"""The deep-capture job (issue 33): two gloo ranks train a DDP model, rank 1 a straggler, until the
processor's automatic capture of the run ended. One job for the tests, the benchmark and the check:

    traceml run --nproc-per-node 2 -m harness.sort_straggler_job [options]

with the repository root on the ranks' module path (the caller's PYTHONPATH: `harness` is not an
installed package). Its callers:
- tests/launcher/test_capture_runs.py: `--slow op --ask` and `--slow input`, on the CPU;
- benchmarks/bench_capture_latency.py: `--max-steps 1500`, on the CPU;
- checks/gpu.py's deep-capture case: `--device cuda --extra-ms 30 --forward-wait-ms 0
  --max-seconds 60 --max-steps 5000 --seen-to capture_seen.json` (and its `--device cpu` form).

--slow op     rank 1's forward also sorts a tensor (aten::sort; on a GPU its sort kernels) that
              rank 0 never sorts: a compute straggler whose cause is one operator. Once per forward,
              or with --extra-ms repeated until it costs about that much per step (calibrated on
              rank 1 before training: CUDA events on a GPU, the clock on a CPU), so the difference
              dominates the step whatever the device's speed.
--slow input  rank 1's fetch sleeps --delay seconds inside `traceml.timed_input()`: an input straggler.
--device cuda both ranks' model and tensors on cuda:0, whatever their LOCAL_RANK, and a wider model:
              gloo, not NCCL, since two NCCL ranks cannot share one device while gloo reduces CUDA
              tensors through the host.
--ask         once the automatic capture finished, rank 0 asks for one more with `traceml capture`
              against the live run (a person's request) and writes what the command printed to
              capture_cli.json in the working directory.
--seen-to P   once the automatic capture ended (or --max-seconds passed), rank 0 writes what the
              captures route last answered (each captured rank's activities included) and whether
              the bound ended the wait to P.

Steps are marked with `traceml.trace_step(model)`; every rank's forward first waits
--forward-wait-ms (as on a device). Rank 0 watches the run's captures (harness.capture_watch) and
all ranks stop at the same update; --max-steps bounds the loop.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import traceml
from harness.capture_watch import CaptureWatch, control_endpoint, stop_together

# (input width, hidden width, batch, learning rate) per device: a GPU step needs real work to show.
SHAPES = {"cpu": (32, 64, 8, 0.01), "cuda": (1024, 1024, 256, 1e-4)}
CPU_SORT_ELEMENTS, GPU_SORT_ELEMENTS = 100_000, 1 << 26


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="harness.sort_straggler_job")
    parser.add_argument("--slow", choices=("op", "input"), default="op")
    parser.add_argument("--delay", type=float, default=0.02, help="--slow input: rank 1's extra seconds per fetch")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sort-elements", type=int, default=None,
                        help=f"default: {CPU_SORT_ELEMENTS:,} on a CPU, 2**26 on a GPU")
    parser.add_argument("--extra-ms", type=float, default=None,
                        help="--slow op: repeat rank 1's sort to about this much per step (default: one sort)")
    parser.add_argument("--forward-wait-ms", type=float, default=20.0)
    parser.add_argument("--ask", action="store_true")
    parser.add_argument("--seen-to", default=None)
    parser.add_argument("--max-seconds", type=float, default=None, help="rank 0 stops watching after this")
    parser.add_argument("--max-steps", type=int, default=600)
    return parser.parse_args(argv)


def sort_ms(values: torch.Tensor, on_gpu: bool, repeats: int = 3) -> float:
    """Median time of one sort of `values`: CUDA events on a GPU, the clock on a CPU."""
    for _ in range(2):
        torch.sort(values)
    if on_gpu:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if on_gpu:
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


def person_asks(run_id: str) -> dict:
    """`traceml capture` against this live run, retried while another capture is in progress."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    env["TRACEML_CONTROL_ENDPOINT"] = control_endpoint()
    command = [sys.executable, "-m", "traceml.launcher.cli", "capture", "--run", run_id, "--rank", "1",
               "--reference", "0", "--steps", "3", "--wait", "90"]
    for _ in range(60):
        cli = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        if not (cli.returncode == 2 and ": 409" in cli.stderr):
            break
        time.sleep(0.5)
    return {"returncode": cli.returncode, "stdout": cli.stdout, "stderr": cli.stderr}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(0)  # both ranks on the one device
    else:
        torch.set_num_threads(1)
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    slow = rank == 1
    width, hidden, batch, lr = SHAPES[args.device]

    sorts, to_sort = 0, None
    if slow and args.slow == "op":
        elements = args.sort_elements or (GPU_SORT_ELEMENTS if on_gpu else CPU_SORT_ELEMENTS)
        to_sort = torch.rand(elements, device=device)
        if args.extra_ms is None:
            sorts = 1
        else:
            sorts = max(1, math.ceil(args.extra_ms / sort_ms(to_sort, on_gpu)))
            print(f"rank 1: {sorts} sort(s) of {elements} elements per forward "
                  f"(about {args.extra_ms:.0f} ms on {device})", flush=True)
    wait_s = args.forward_wait_ms / 1000.0

    inner = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 4)).to(device)

    def forward_pre(module, inputs):
        if wait_s:
            time.sleep(wait_s)
        for _ in range(sorts):  # rank 0: none
            torch.sort(to_sort)

    inner.register_forward_pre_hook(forward_pre)
    model = DistributedDataParallel(inner, device_ids=[0] if on_gpu else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def then(watch: CaptureWatch) -> None:
        if args.seen_to:
            with open(args.seen_to, "w") as out:
                json.dump({"captures": watch.seen, "timed_out": watch.timed_out}, out)
        if args.ask:
            with open("capture_cli.json", "w") as out:
                json.dump(person_asks(os.environ["TRACEML_RUN_ID"]), out)

    watch = CaptureWatch(args.max_seconds, then).start() if rank == 0 else None

    def fetch():
        if slow and args.slow == "input":
            time.sleep(args.delay)  # this rank's reader is slower
        return torch.randn(batch, width, device=device), torch.randn(batch, 4, device=device)

    updates = 0
    t0 = time.monotonic()
    for _ in range(args.max_steps):
        with traceml.timed_input():
            x, y = fetch()
        with traceml.trace_step(model):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        updates += 1
        if stop_together(watch):
            break
    if on_gpu:
        torch.cuda.synchronize()
    print(f"rank {rank}: {updates} updates in {time.monotonic() - t0:.1f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
