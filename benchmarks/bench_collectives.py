"""Collective-wait timing cost: per collective, per DDP bucket, and on a 2-rank DDP gloo job.

Three figures, each against a baseline measured in the same run, rounds alternating:

1. `per_collective_us`: the training thread's added time per blocking `all_reduce`
   (a one-element tensor on a one-rank gloo group, inside an open step): the patched
   `torch.distributed.all_reduce` against the original function.
2. `per_bucket_us`: the added time of one DDP backward divided by its buckets: a DDP
   module whose first forward ran after `traceml.init()` (TraceML's wrapping comm hook)
   against an identical one set up before it (DDP's builtin C++ all-reduce), both
   with TraceML recording (so backward's own patch is in both).
3. `ddp_throughput_ratio`: a real 2-rank gloo DDP job (two processes): steps per
   second of the hooked model divided by the builtin one's, alternating rounds, each
   step with an explicit `all_reduce` of the loss (timed for the hooked model, the
   original function for the other).

    flock /tmp/traceml-bench.lock python -m benchmarks.bench_collectives [--quick] [--json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import traceml_checkout  # noqa: F401  (imports the checkout when not installed)
from benchmarks.json_output import add_json_flag, print_json, table_output  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _models(torch, layers: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)])


def _ddp(torch, layers: int):
    # bucket_cap_mb tiny: every parameter after the first bucket is its own bucket.
    return torch.nn.parallel.DistributedDataParallel(_models(torch, layers), bucket_cap_mb=0.001)


def in_process_costs(rounds: int, calls: int, layers: int) -> dict:
    import torch
    import torch.distributed as dist

    import traceml

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    x = torch.randn(8, 64)
    builtin = _ddp(torch, layers)
    builtin(x).sum().backward()  # lazy init before traceml.init(): no TraceML hook
    original = dist.all_reduce
    traceml.init(mode="auto")
    hooked = _ddp(torch, layers)
    hooked(x).sum().backward()
    timed = dist.all_reduce
    assert timed is not original and hooked.__dict__.get("_traceml_comm_hook") is not None
    hook = hooked.__dict__["_traceml_comm_hook"]
    inner, seen = hook.hook, []
    hook.hook = lambda state, bucket: (seen.append(1), inner(state, bucket))[1]
    hooked(x).sum().backward()
    hook.hook = inner
    buckets = len(seen)
    t = torch.ones(1)

    def collectives(fn) -> float:
        with traceml.trace_step():
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn(t)
            return (time.perf_counter_ns() - t0) / calls / 1e3

    def backwards(model) -> float:
        n = max(4, calls // 20)
        with traceml.trace_step():
            t0 = time.perf_counter_ns()
            for _ in range(n):
                model(x).sum().backward()
            return (time.perf_counter_ns() - t0) / n / 1e3

    per_call, per_bucket = [], []
    for i in range(rounds):
        pair = (timed, original) if i % 2 == 0 else (original, timed)
        a = {fn: collectives(fn) for fn in pair}
        per_call.append(a[timed] - a[original])
        pair = (hooked, builtin) if i % 2 == 0 else (builtin, hooked)
        b = {id(m): backwards(m) for m in pair}
        per_bucket.append((b[id(hooked)] - b[id(builtin)]) / buckets)
    base_call = collectives(original)
    traceml.shutdown()
    dist.destroy_process_group()
    return {"per_collective_us": statistics.median(per_call), "all_reduce_baseline_us": base_call,
            "per_bucket_us": statistics.median(per_bucket), "buckets": buckets}


def rank_main(out: str, rounds: int, steps: int, layers: int) -> None:
    """One rank of the 2-rank job (run as a subprocess)."""
    import torch
    import torch.distributed as dist

    import traceml

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    x = torch.randn(16, 64)
    builtin = _ddp(torch, layers)
    builtin(x).sum().backward()
    original = dist.all_reduce
    traceml.init(mode="auto")
    hooked = _ddp(torch, layers)
    timed = dist.all_reduce
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-4) for m in (builtin, hooked)}

    def run(model, reduce) -> float:
        opt = opts[id(model)]
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            reduce(loss.detach())
        return time.perf_counter() - t0

    run(hooked, timed), run(builtin, original)  # warm-up (bucket rebuild, first steps)
    ratios = []
    for i in range(rounds):
        if i % 2 == 0:
            with_t, without_t = run(hooked, timed), run(builtin, original)
        else:
            without_t, with_t = run(builtin, original), run(hooked, timed)
        ratios.append(without_t / with_t)  # throughput with / throughput without
    traceml.shutdown()
    dist.barrier()
    if rank == 0:
        Path(out).write_text(repr(statistics.median(ratios)))
    os._exit(0)  # gloo teardown can abort on a loaded CPU (tests/instrumentation/test_multiprocess_gloo.py)


def ddp_throughput(rounds: int, steps: int, layers: int) -> float:
    from tests.harness import free_port

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
        return float(Path(out).read_text())


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
    job_rounds, job_steps = (4, 20) if args.quick else (20, 60)
    with table_output(args.json):
        figures = in_process_costs(rounds, calls, args.layers)
        figures["ddp_throughput_ratio"] = ddp_throughput(job_rounds, job_steps, args.layers)
        print(f"per collective (blocking all_reduce, 1-rank gloo): +{figures['per_collective_us']:.2f} us "
              f"(the call itself {figures['all_reduce_baseline_us']:.1f} us)")
        print(f"per DDP bucket ({figures['buckets']} buckets per backward): +{figures['per_bucket_us']:.2f} us")
        print(f"2-rank DDP gloo job throughput, with / without collective timing: "
              f"{figures['ddp_throughput_ratio']:.4f}")
    if args.json:
        print_json("bench_collectives", args, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
