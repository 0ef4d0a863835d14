"""Reference point: what PyTorch's own profiler costs per step, beside TraceML, in one run.

    .venv/bin/python benchmarks/bench_profiler_reference.py [--rounds 6] [--steps 150]

The same real CPU training step (MLP forward/backward/SGD, one thread) runs in
alternating blocks: uninstrumented, TraceML manual mode (trace_step + four timed
regions, samplers running, no exporter), and `torch.profiler.profile` with CPU
activities recording every step (the usual always-on way to use it to see per-op
time; `record_shapes`, memory and stacks off, i.e. its cheapest useful setting).
Two step sizes: a small step and a ~10 ms step. Reported: median wall time per
step, the added time per step against the uninstrumented median, and the
throughput ratio (uninstrumented / variant). Block order rotates every round.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import traceml_checkout  # noqa: E402,F401

import traceml  # noqa: E402

torch.set_num_threads(1)


def make(width: int, depth: int, batch: int):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = [(torch.randn(batch, width), torch.randn(batch, 1)) for _ in range(4)]
    return model, opt, data


def step_plain(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def step_traceml(model, opt, x, y):
    with traceml.trace_step(model):
        with traceml.timed_forward():
            loss = torch.nn.functional.mse_loss(model(x), y)
        with traceml.timed_backward():
            loss.backward()
        with traceml.timed_optimizer_step():
            opt.step()
        opt.zero_grad()


def block(variant: str, job, steps: int) -> list[float]:
    model, opt, data = job
    times = []
    if variant == "torch.profiler":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(steps):
                t0 = time.perf_counter()
                step_plain(model, opt, *data[i % len(data)])
                prof.step()
                times.append(time.perf_counter() - t0)
        return times
    fn = step_traceml if variant == "TraceML (manual)" else step_plain
    for i in range(steps):
        t0 = time.perf_counter()
        fn(model, opt, *data[i % len(data)])
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=150)
    args = p.parse_args()
    traceml.init("manual")
    variants = ["uninstrumented", "TraceML (manual)", "torch.profiler"]
    shapes = {"small step": (64, 2, 16), "~10 ms step": (384, 5, 128)}
    print("shared 2-core machine, contended (other engineers' jobs): compare the rows of one run")
    for label, shape in shapes.items():
        job = make(*shape)
        block("uninstrumented", job, 20)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.rounds):
            order = variants[r % 3:] + variants[:r % 3]
            for name in order:
                times[name] += block(name, job, args.steps)
        base = statistics.median(times["uninstrumented"])
        print(f"\n{label} (width {shape[0]}, depth {shape[1]}, batch {shape[2]}; "
              f"{args.rounds} x {args.steps} steps per variant)")
        print(f"{'variant':20s} {'median step':>12s} {'added':>10s} {'ratio':>6s}")
        for name in variants:
            med = statistics.median(times[name])
            print(f"{name:20s} {med * 1e3:9.3f} ms {(med - base) * 1e6:7.0f} us {base / med:6.3f}")
    traceml.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
