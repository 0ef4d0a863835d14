"""Collective-wait timing cost: per collective, per DDP backward and bucket, and on a 2-rank DDP job.

Three figures, each against a baseline measured in the same run, rounds alternating:

1. `per_collective_us`: the training thread's added time per blocking `all_reduce`
   (a one-element tensor on a one-rank gloo group, inside an open step): the patched
   `torch.distributed.all_reduce` against the original function.
2. `per_ddp_backward_us` and `per_bucket_us`: the added time of one DDP forward and
   backward with DDP's wait timed (`ddp_comm`'s `_pre_forward` wrapper in place)
   against the same module with the original `_pre_forward` (TraceML recording in both,
   so backward's own patch is in both); per bucket = per backward / buckets (the seam
   does nothing per bucket, so this only spreads the per-backward cost).
3. `ddp_throughput_ratio`: a real 2-rank gloo DDP job (two processes): steps per
   second with collective timing (both seams, and an explicit `all_reduce` of the loss
   per step) divided by steps per second without (the original functions), rounds
   alternating in each process.

    flock /tmp/traceml-bench.lock python -m benchmarks.bench_collectives [--quick] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib import checkout  # noqa: F401  (imports the checkout when not installed)
from benchmarks.lib.json_output import add_json_flag, print_json, table_output  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _models(torch, layers: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)])


def _ddp(torch, layers: int):
    # bucket_cap_mb tiny: every parameter after the first bucket is its own bucket.
    return torch.nn.parallel.DistributedDataParallel(_models(torch, layers), bucket_cap_mb=0.001)


class _Seams:
    """Switches the collective timing on and off between rounds (the class and module attributes)."""

    def __init__(self) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.dist, self.ddp = dist, DDP
        self.timed = (dist.all_reduce, DDP.__dict__["_pre_forward"])
        self.original = (dist.all_reduce.__wrapped__, DDP.__dict__["_pre_forward"].__wrapped__)

    def set(self, on: bool) -> None:
        reduce, pre_forward = self.timed if on else self.original
        self.dist.all_reduce = reduce
        self.ddp._pre_forward = pre_forward


def in_process_costs(rounds: int, calls: int, layers: int) -> dict:
    import torch
    import torch.distributed as dist

    import traceml

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    x = torch.randn(8, 64)
    traceml.init(mode="auto")
    seams = _Seams()
    model = _ddp(torch, layers)
    seen = []
    model.register_comm_hook(None, lambda state, bucket: (seen.append(1), _allreduce(state, bucket))[1])
    model(x).sum().backward()
    seen.clear()
    model(x).sum().backward()
    buckets = len(seen)
    model = _ddp(torch, layers)  # DDP's builtin all-reduce, as in a job without hooks
    model(x).sum().backward()
    t = torch.ones(1)

    def collectives() -> float:
        reduce = dist.all_reduce
        with traceml.trace_step():
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                reduce(t)
            return (time.perf_counter_ns() - t0) / calls / 1e3

    def backwards() -> float:
        n = max(4, calls // 20)
        with traceml.trace_step():
            t0 = time.perf_counter_ns()
            for _ in range(n):
                model(x).sum().backward()
            return (time.perf_counter_ns() - t0) / n / 1e3

    per_call, per_backward = [], []
    for i in range(rounds):
        got = {}
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            seams.set(on)
            got[on] = (collectives(), backwards())
        per_call.append(got[True][0] - got[False][0])
        per_backward.append(got[True][1] - got[False][1])
    seams.set(False)
    base_call, base_backward = collectives(), backwards()
    seams.set(True)
    traceml.shutdown()
    dist.destroy_process_group()
    backward_us = statistics.median(per_backward)
    return {"per_collective_us": statistics.median(per_call), "all_reduce_baseline_us": base_call,
            "per_ddp_backward_us": backward_us, "ddp_backward_baseline_us": base_backward,
            "per_bucket_us": backward_us / buckets, "buckets": buckets}


def _allreduce(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.allreduce_hook(state, bucket)


def rank_main(out: str, rounds: int, steps: int, layers: int) -> None:
    """One rank of the 2-rank job (run as a subprocess)."""
    import torch
    import torch.distributed as dist

    import traceml

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    x = torch.randn(16, 64)
    traceml.init(mode="auto")
    seams = _Seams()
    model = _ddp(torch, layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def run(on: bool) -> float:
        seams.set(on)
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            dist.all_reduce(loss.detach())
        return time.perf_counter() - t0

    run(True), run(False)  # warm-up (bucket rebuild, first steps)
    ratios = []
    for i in range(rounds):
        if i % 2 == 0:
            with_t, without_t = run(True), run(False)
        else:
            without_t, with_t = run(False), run(True)
        ratios.append(without_t / with_t)  # throughput with / throughput without
    seams.set(True)
    traceml.shutdown()
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(ratios))
    os._exit(0)  # gloo teardown can abort on a loaded CPU (tests/instrumentation/test_multiprocess_gloo.py)


def ddp_throughput(rounds: int, steps: int, layers: int) -> list[float]:
    """Per round: throughput with collective timing / throughput without (rank 0's clock)."""
    from harness import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ratio")
        procs = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
            env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
            env.pop("TRACEML_DISABLE", None)
            procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.bench_collectives", "--rank-worker", out,
                                           str(rounds), str(steps), str(layers)], env=env, cwd=ROOT))
        for p in procs:
            p.wait(timeout=900)
            if p.returncode != 0:
                raise SystemExit(f"a rank failed with {p.returncode}")
        return json.loads(Path(out).read_text())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rank-worker":
        rank_main(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--layers", type=int, default=8, help="Linear(64, 64) layers (buckets ~ 2 per layer)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    rounds, calls = (6, 400) if args.quick else (40, 2000)
    job_rounds, job_steps = (4, 20) if args.quick else (40, 100)
    with table_output(args.json):
        figures = in_process_costs(rounds, calls, args.layers)
        ratios = ddp_throughput(job_rounds, job_steps, args.layers)
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        figures.update(ddp_throughput_ratio=statistics.median(ratios), ddp_throughput_q1_ratio=q1,
                       ddp_throughput_q3_ratio=q3, ddp_rounds=len(ratios))
        print(f"per collective (blocking all_reduce, 1-rank gloo): +{figures['per_collective_us']:.2f} us "
              f"(the call itself {figures['all_reduce_baseline_us']:.1f} us)")
        print(f"per DDP forward+backward: +{figures['per_ddp_backward_us']:.2f} us "
              f"(the step itself {figures['ddp_backward_baseline_us']:.0f} us); per bucket "
              f"({figures['buckets']} buckets): +{figures['per_bucket_us']:.2f} us")
        print(f"2-rank DDP gloo job throughput, with / without collective timing: "
              f"{figures['ddp_throughput_ratio']:.4f} (median of {len(ratios)} rounds; quartiles "
              f"{q1:.4f} .. {q3:.4f})")
    if args.json:
        print_json("bench_collectives", args, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
