"""Reference point: what PyTorch's own profiler costs per step, beside TraceML, in one run.

    .venv/bin/python -m benchmarks.bench_profiler_reference [--rounds 100] [--steps 30] [--json]

The same real CPU training step (MLP forward/backward/SGD, one thread) runs in
alternating blocks: uninstrumented, TraceML manual mode (trace_step + four timed
regions, samplers running, no exporter), and `torch.profiler.profile` with CPU
activities recording every step (the usual always-on way to use it to see per-op
time; `record_shapes`, memory and stacks off, i.e. its cheapest useful setting).
Two step sizes: a small step and a ~10 ms step. Reported: median wall time per
step; the added time per step, as the median over rounds of the per-round
difference between the variant's and the uninstrumented blocks' median steps (the
same paired estimator as bench_overhead.py: this shared VM's speed drifts between
rounds); and the throughput ratio that implies (uninstrumented / (uninstrumented +
added)). Block order is shuffled every round (seeded).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from benchmarks import traceml_checkout  # noqa: E402,F401  (imports the checkout when not installed)
from benchmarks.json_output import add_json_flag, print_json, table_output  # noqa: E402
import traceml  # noqa: E402
from benchmarks.bench_overhead import _paired_added, _rounds  # noqa: E402
from tests.tiny_training import plain_step, traced_step  # noqa: E402

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


def block(variant: str, job, steps: int) -> list[float]:
    model, opt, data = job
    times = []
    if variant == "torch.profiler":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(steps):
                t0 = time.perf_counter()
                plain_step(model, opt, *data[i % len(data)])
                prof.step()
                times.append(time.perf_counter() - t0)
        return times
    fn = traced_step if variant == "TraceML (manual)" else plain_step
    for i in range(steps):
        t0 = time.perf_counter()
        fn(model, opt, *data[i % len(data)])
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--steps", type=int, default=30)
    add_json_flag(p)
    args = p.parse_args()
    with table_output(args.json):
        figures = measure(args)
    if args.json:
        print_json("bench_profiler_reference", args, figures)
    return 0


def measure(args) -> dict:
    figures: dict = {"cpu_count": os.cpu_count(), "load_avg_start": round(os.getloadavg()[0], 2), "steps": []}
    traceml.init("manual")
    variants = ["uninstrumented", "TraceML (manual)", "torch.profiler"]
    shapes = {"small step": (64, 2, 16), "~10 ms step": (384, 5, 128)}
    print(f"{os.cpu_count()} cores, load avg {os.getloadavg()[0]:.2f}: compare the rows of one run")
    for label, shape in shapes.items():
        job = make(*shape)
        block("uninstrumented", job, 20)  # warm-up
        runners = {name: (lambda steps, clock, out, warmup, name=name: out.extend(block(name, job, steps)))
                   for name in variants}
        times = _rounds(args.rounds, args.steps, None, runners)
        base = statistics.median(t for per_round in times["uninstrumented"] for t in per_round)
        print(f"\n{label} (width {shape[0]}, depth {shape[1]}, batch {shape[2]}; "
              f"{args.rounds} x {args.steps} steps per variant)")
        print(f"{'variant':20s} {'median step':>12s} {'added (IQR)':>24s} {'ratio':>6s}")
        for name in variants:
            med = statistics.median(t for per_round in times[name] for t in per_round)
            added, q1, q3 = _paired_added(times, name, "uninstrumented") if name != "uninstrumented" else (0, 0, 0)
            ratio = base / (base + added / 1e6)
            figures["steps"].append({"step": label, "variant": name, "median_step_ms": med * 1e3,
                                     "added_us": added, "added_us_iqr": [q1, q3], "throughput_ratio": ratio})
            print(f"{name:20s} {med * 1e3:9.3f} ms {added:7.0f} us ({q1:6.0f} to {q3:6.0f}) "
                  f"{ratio:6.3f}")
    traceml.shutdown()
    return figures


if __name__ == "__main__":
    sys.exit(main())
