"""The training script `traceml demo` launches on every rank (CPU, gloo, DDP).

A small MLP on a synthetic in-memory dataset, with one real bottleneck injected
per scenario:

- balanced: nothing injected.
- input-bound: every rank's DataLoader sleeps before handing over each batch.
- input-straggler: only the straggler rank's DataLoader sleeps; the other ranks
  then wait for it inside DDP's gradient all-reduce (visible in backward).
- compute-straggler: the straggler rank does extra matrix multiplications in
  its forward pass (outside autograd), with the same effect on the others.

The delays are sized against the diagnosis thresholds (10 % warn, 20 % critical
of the step): roughly one compute-step's worth, far above both.
Run it through `traceml demo`, or by hand: `traceml run --nproc-per-node 2 demo_workload.py`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

SCENARIOS = ("balanced", "input-bound", "input-straggler", "compute-straggler")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=SCENARIOS, default="input-straggler")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--straggler-rank", type=int, default=None,
                        help="rank that gets the injected slowdown (default: the last rank)")
    parser.add_argument("--delay-ms", type=float, default=None,
                        help="injected input delay per batch (default: calibrated to the compute time)")
    parser.add_argument("--extra-matmuls", type=int, default=None,
                        help="extra forward matmuls on the straggler (default: calibrated)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.dataloader import default_collate

    import traceml

    torch.set_num_threads(1)  # ranks share few cores; one thread each keeps them comparable
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    straggler = world - 1 if args.straggler_rank is None else args.straggler_rank
    torch.manual_seed(args.seed)

    class DemoModel(nn.Module):
        """MLP whose forward returns the loss, so the whole step's compute is in forward/backward."""

        def __init__(self, width: int, extra_matmuls: int) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(width, width), nn.ReLU(),
                nn.Linear(width, width), nn.ReLU(),
                nn.Linear(width, width), nn.ReLU(),
                nn.Linear(width, 10),
            )
            self.extra_matmuls = extra_matmuls
            # A plain tensor, not a buffer: DDP would broadcast a buffer in every forward.
            self.burn = torch.randn(width, width) / width ** 0.5

        def forward(self, x, y):
            if self.extra_matmuls:
                with torch.no_grad():  # real extra compute, outside autograd
                    h = x
                    for _ in range(self.extra_matmuls):
                        h = torch.tanh(h @ self.burn)
            return nn.functional.cross_entropy(self.net(x), y)

    width = args.hidden
    model = DemoModel(width, 0)
    ddp = DistributedDataParallel(model)
    # Calibrate the injection to this machine: time a few real DDP steps (forward,
    # backward and its all-reduce) first. They are not training steps, so TraceML
    # does not record them.
    probe_x = torch.randn(args.batch_size, width)
    probe_y = torch.randint(0, 10, (args.batch_size,))
    recording = traceml.is_initialized()
    if recording:
        traceml.set_recording(False)
    try:
        for _ in range(3):
            ddp(probe_x, probe_y).backward()
        start = time.perf_counter()
        for _ in range(5):
            ddp(probe_x, probe_y).backward()
        step_ms = (time.perf_counter() - start) / 5 * 1000.0
        ddp.zero_grad(set_to_none=True)
        start = time.perf_counter()
        h = probe_x
        with torch.no_grad():
            for _ in range(10):
                h = torch.tanh(h @ model.burn)
        per_matmul_ms = max((time.perf_counter() - start) / 10 * 1000.0, 1e-3)
    finally:
        if recording:
            traceml.set_recording(True)

    target_ms = max(8.0, 1.5 * step_ms)  # the injected slowdown: about 1.5 plain steps
    delay_ms = args.delay_ms if args.delay_ms is not None else target_ms
    extra = args.extra_matmuls if args.extra_matmuls is not None else int(target_ms / per_matmul_ms) + 1

    slow_input = (args.scenario == "input-bound"
                  or (args.scenario == "input-straggler" and rank == straggler))
    if args.scenario == "compute-straggler" and rank == straggler:
        model.extra_matmuls = extra
    # The calibration is per rank; share rank 0's figures so every rank injects the same amount.
    agreed = torch.tensor([delay_ms, float(extra)])
    dist.broadcast(agreed, src=0)
    delay_s = float(agreed[0]) / 1000.0
    if model.extra_matmuls:
        model.extra_matmuls = int(agreed[1])

    def collate(batch):
        if slow_input:
            time.sleep(delay_s)  # a slow input pipeline: decoding, augmentation, remote storage
        return default_collate(batch)

    n = args.steps * args.batch_size
    generator = torch.Generator().manual_seed(args.seed + rank)
    dataset = TensorDataset(torch.randn(n, width, generator=generator),
                            torch.randint(0, 10, (n,), generator=generator))
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=False, collate_fn=collate)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)

    if rank == 0:
        injected = {
            "balanced": "nothing injected",
            "input-bound": f"every rank's loader sleeps {delay_s * 1000:.1f} ms per batch",
            "input-straggler": f"rank {straggler}'s loader sleeps {delay_s * 1000:.1f} ms per batch",
            "compute-straggler": f"rank {straggler} runs {int(agreed[1])} extra matmuls per forward",
        }[args.scenario]
        print(f"demo: {args.scenario} on {world} ranks, {args.steps} steps: {injected} "
              f"(a plain step takes ~{step_ms:.1f} ms here)", flush=True)
    for x, y in loader:
        with traceml.trace_step(ddp):
            loss = ddp(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(f"demo: finished {args.steps} steps, last loss {loss.item():.3f}", flush=True)


if __name__ == "__main__":
    main()
    import traceml

    traceml.shutdown()  # flush this rank's telemetry now (the bootstrap would do it after us)
    # torch 2.13 DDP on gloo can abort ("terminate called without an active exception") in interpreter
    # teardown on a loaded CPU, with or without TraceML; all output is flushed, so leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
