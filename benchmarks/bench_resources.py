"""What the resource sampler costs: training-thread throughput with it on vs off, and its CPU per tick.

Method. One process, one model/optimizer/loader (`benchmarks.lib.workload.Job`, its ~10 ms CPU
step), the plain uninstrumented loop in every variant: the only difference between
"on" and "off" is a `ResourceSampler` thread running beside the steps. Each round runs
one block of steps per variant in a new seeded order (`benchmarks.lib.estimators.run_rounds`):
"off", "on" (a sampler started before the block and stopped after it, both outside
the timed steps) and "control" (plain again: what the estimator reads when nothing is
added). A block lasts a few sampler intervals so each "on" block sees several ticks;
the interval here is 0.5 s by default, ten times the production default of 5 s, so
the cost is visible (at 5 s it is a tenth of what is shown). The throughput figure is
the pooled ratio of the blocks' wall times, off over on, paired by round, with a 95 %
interval (`benchmarks.lib.estimators.ratio_interval`), the same steadying of glibc's allocator
and a frozen GC heap as bench_overhead.

The block ratio is only as precise as the machine is steady over seconds (on this shared
VM, a few percent), far coarser than the sampler's cost. So a second estimate comes
from one long run with the sampler on: its ticks are timed on the sampler thread, and
each step that overlaps a tick is paired with its two neighbours (steps milliseconds
apart, in the same machine state) that overlap none. The mean difference, times the
share of steps a tick lands in, is the added time per step; the ratio follows from it,
with a 95 % interval from the paired differences. The same estimator at as many
seeded positions with no tick is the control (it reads 0 when nothing is added). What
it does not see: a tick's after-effect on later steps (caches it evicted), which the
block ratio would include. (The estimator is `benchmarks.lib.attribution`'s, shared with
bench_overhead's samplers in place, here without the step after.)

The sampler's own cost per tick, two ways: its thread's CPU time over its ticks during
the "on" blocks (`ResourceSampler.tick_cpu_s`, `time.thread_time` around each tick),
and N ticks timed directly on this thread (median wall and CPU per tick), once as the
node's local rank 0 (process and host figures) and once as another local rank (process
only). Where no GPU and no NVML exist (this machine) the ticks read neither; the GPU
check (`checks/gpu.py`) prints the tick cost with NVML. Also the exporter's encoding
of one snapshot (protobuf, off the training thread too).

    .venv/bin/python -m benchmarks.bench_resources [--quick] [--json] [--interval 0.5]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from benchmarks.lib import checkout  # noqa: E402,F401  (imports the checkout when not installed)
from benchmarks.lib.attribution import attributed, overlapping  # noqa: E402
from benchmarks.lib.estimators import ratio_interval, run_rounds, steady_allocator  # noqa: E402
from benchmarks.lib.json_output import add_json_flag, print_json, table_output  # noqa: E402
from benchmarks.lib.workload import Job, block_plain  # noqa: E402
from traceml.resources import ResourceSampler  # noqa: E402
from traceml.schema import environment as env_names  # noqa: E402

torch.set_num_threads(1)  # bench_overhead's workload, on one thread as there


class _CountingSink:
    def __init__(self) -> None:
        self.snapshots = 0

    def on_resources(self, snapshot) -> None:
        self.snapshots += 1


def _per_tick(local_rank: str, ticks: int) -> tuple[float, float]:
    """(median wall us, median CPU us) of one tick timed directly on this thread."""
    sampler = ResourceSampler(sinks=(_CountingSink(),), environ={env_names.LOCAL_RANK: local_rank})
    sampler.baseline()
    wall, cpu = [], []
    for _ in range(ticks):
        w0, c0 = time.perf_counter(), time.thread_time()
        sampler.run_once()
        cpu.append((time.thread_time() - c0) * 1e6)
        wall.append((time.perf_counter() - w0) * 1e6)
    return statistics.median(wall), statistics.median(cpu)


def _encode_us(snapshots: int) -> float:
    """Median time to encode one real snapshot into a metrics request and serialise it."""
    from traceml.exporter.encoding import OtlpEncoder
    from traceml.exporter.identity import resolve_identity
    from traceml.exporter.settings import resolve_settings

    encoder = OtlpEncoder(resolve_identity(run_id="bench-resources", environ={}, use_store=False),
                          resolve_settings("http://127.0.0.1:4317", "grpc", environ={}))
    sampler = ResourceSampler(sinks=(), environ={env_names.LOCAL_RANK: "0"})
    sampler.baseline()
    snapshot = sampler.sample()
    times = []
    for _ in range(snapshots):
        t0 = time.perf_counter()
        batch = encoder.new_metrics_batch()
        encoder.add_resource_points(batch, snapshot, 0)
        batch.request.SerializeToString()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _variants(job, interval_s: float, ticks: dict) -> dict:
    """Block runners: plain steps without a sampler, with one, and plain again (control)."""
    sink = _CountingSink()

    def plain(steps, clock, out, warmup=0):
        block_plain(job, steps, clock, out)

    def with_sampler(steps, clock, out, warmup=0):
        sampler = ResourceSampler(sinks=(sink,), interval_s=interval_s, environ={env_names.LOCAL_RANK: "0"})
        sampler.start()
        try:
            block_plain(job, steps, clock, out)
        finally:
            ticks["block_ticks"] += sampler.ticks  # the thread's own ticks, before stop()'s last one
            ticks["thread_cpu_s"] += sampler.tick_cpu_s
            sampler.stop()

    return {"off": plain, "on": with_sampler, "control": plain}


class _TimedSampler(ResourceSampler):
    """The real sampler; each tick's wall-clock span is kept (two perf_counter calls)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tick_spans: list[tuple[float, float]] = []

    def run_once(self):
        t0 = time.perf_counter()
        try:
            return super().run_once()
        finally:
            self.tick_spans.append((t0, time.perf_counter()))


def _tick_attributed(job, interval_s: float, seconds: float) -> dict:
    """Steps with the real sampler thread running; the cost of the steps its ticks land in."""
    stamps: list[float] = []
    stamp = stamps.append

    def clock():
        now = time.perf_counter()
        stamp(now)
        return now

    sampler = _TimedSampler(sinks=(_CountingSink(),), interval_s=interval_s, environ={env_names.LOCAL_RANK: "0"})
    block_plain(job, 5, time.perf_counter, [])
    gc.collect()
    gc.freeze()
    sampler.start()
    try:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            block_plain(job, 50, clock, [])
    finally:
        loop_ticks, loop_cpu_s = sampler.ticks, sampler.tick_cpu_s  # before stop()'s last sample
        sampler.stop()
        gc.unfreeze()
    spans = [(stamps[i], stamps[i + 1]) for i in range(0, len(stamps) - 1, 2)]
    durations = [end - start for start, end in spans]
    ticks = sampler.tick_spans[:loop_ticks]
    found = attributed(durations, overlapping(spans, ticks))
    step = statistics.fmean(durations)
    per_step, per_step_se = found["per_step"], found["per_step_se"]
    return {
        "tick_steps": len(durations), "tick_count": len(ticks), "tick_step_share": found["share"],
        "tick_mean_step_ms": step * 1e3, "tick_overlapped_added_us": found["per_run"] * 1e6,
        "tick_overlapped_added_us_se": found["per_run_se"] * 1e6, "tick_pairs": found["runs"],
        "tick_added_us_per_step": per_step * 1e6, "tick_added_us_per_step_se": per_step_se * 1e6,
        "tick_throughput_ratio": step / (step + per_step),
        "tick_throughput_ratio_ci95": (step / (step + per_step + 1.96 * per_step_se),
                                       step / (step + per_step - 1.96 * per_step_se)),
        "tick_control_added_us": found["control_per_run"] * 1e6,
        "tick_control_added_us_se": found["control_per_run_se"] * 1e6, "tick_control_pairs": found["control_runs"],
        "tick_thread_cpu_us": loop_cpu_s / max(1, loop_ticks) * 1e6,
    }


def measure(quick: bool, interval_s: float, rounds: int | None, hidden: int,
            tick_seconds: float | None = None) -> dict:
    results: dict = {"cpu_count": os.cpu_count(), "load_avg_start": round(os.getloadavg()[0], 2),
                     "interval_s": interval_s, "steady_allocator": steady_allocator()}
    # A tick's cost, measured directly first (a warm sampler, nothing else running).
    ticks_direct = 50 if quick else 200
    for label, local_rank in (("local_rank0", "0"), ("other_rank", "1")):
        wall, cpu = _per_tick(local_rank, ticks_direct)
        results[f"tick_wall_us_{label}"] = wall
        results[f"tick_cpu_us_{label}"] = cpu
    results["encode_snapshot_us"] = _encode_us(ticks_direct)

    job = Job(hidden, 128, 32)
    calibration: list = []
    block_plain(job, 5, time.perf_counter, calibration)
    step_s = statistics.median(calibration)
    steps_per_block = max(10, round(3 * interval_s / step_s))  # about three intervals per block
    if rounds is None:
        rounds = 12 if quick else 24
    ticks = {"block_ticks": 0, "thread_cpu_s": 0.0}
    variants = _variants(job, interval_s, ticks)
    for run in variants.values():
        run(3, time.perf_counter, [])
    gc.collect()
    gc.freeze()
    try:
        per_round = run_rounds(rounds, steps_per_block, time.perf_counter, variants)
    finally:
        gc.unfreeze()
    blocks = {name: [sum(steps) for steps in per] for name, per in per_round.items()}
    results.update(rounds=rounds, steps_per_block=steps_per_block, step_ms=step_s * 1e3,
                   on_block_ticks=ticks["block_ticks"])
    for name in ("on", "control"):
        ratio, lo, hi = ratio_interval(blocks["off"], blocks[name])
        results[f"throughput_ratio_{name}"] = ratio
        results[f"throughput_ratio_{name}_ci95"] = (lo, hi)
        added = [(b - o) / steps_per_block * 1e6 for b, o in zip(blocks[name], blocks["off"])]
        results[f"added_us_per_step_{name}"] = statistics.fmean(added)
        results[f"added_us_per_step_{name}_se"] = statistics.stdev(added) / len(added) ** 0.5
    if tick_seconds is None:
        tick_seconds = 45.0 if quick else 150.0
    results.update(_tick_attributed(job, interval_s, tick_seconds))
    n_ticks = ticks["block_ticks"]
    results["thread_tick_cpu_us"] = ticks["thread_cpu_s"] / n_ticks * 1e6 if n_ticks else None
    results["expected_share_at_interval"] = (results["thread_tick_cpu_us"] or 0) / 1e6 / interval_s
    results["phase_wall_s"] = sum(sum(b) for b in blocks.values())
    results["load_avg_end"] = round(os.getloadavg()[0], 2)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (under 3 minutes)")
    parser.add_argument("--interval", type=float, default=0.5,
                        help="sampler interval in seconds (default 0.5, ten times the production rate)")
    parser.add_argument("--rounds", type=int, help="rounds of one block per variant (default 24, 12 with --quick)")
    parser.add_argument("--hidden", type=int, default=960, help="hidden width (default 960: a ~10 ms step)")
    parser.add_argument("--tick-seconds", type=float,
                        help="length of the one run with the sampler on (default 150, 45 with --quick)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    with table_output(args.json):
        r = measure(args.quick, args.interval, args.rounds, args.hidden, args.tick_seconds)
        _print_table(r)
    if args.json:
        print_json("bench_resources", args, r)
    return 0


def _print_table(r: dict) -> None:
    print(f"Resource sampler cost on CPU ({r['cpu_count']} cores, load avg {r['load_avg_start']} -> "
          f"{r['load_avg_end']}; no GPU, no NVML here: the ticks read process, host and no device)")
    print(f"  one tick timed directly (median): local rank 0 (process + host) {r['tick_wall_us_local_rank0']:.0f} us "
          f"wall, {r['tick_cpu_us_local_rank0']:.0f} us CPU; another local rank (process only) "
          f"{r['tick_wall_us_other_rank']:.0f} us wall, {r['tick_cpu_us_other_rank']:.0f} us CPU")
    print(f"  exporter: one snapshot encoded and serialised (its own thread): {r['encode_snapshot_us']:.0f} us")
    tick = r["thread_tick_cpu_us"]
    print(f"  ~{r['step_ms']:.1f} ms steps, {r['rounds']} rounds of {r['steps_per_block']}-step blocks per variant, "
          f"sampler every {r['interval_s']} s (production default 5 s): {r['on_block_ticks']} ticks in the 'on' "
          f"blocks, {tick:.0f} us of the sampler thread's CPU each" if tick is not None else "no ticks")
    print("  throughput ratio off/on, wall clock, pooled over rounds (95 % interval); added per step, mean +- SE:")
    for name, label in (("on", "sampler on"), ("control", "control (plain vs plain)")):
        lo, hi = r[f"throughput_ratio_{name}_ci95"]
        print(f"    {label:26s} {r[f'throughput_ratio_{name}']:.4f} ({lo:.4f}-{hi:.4f}); "
              f"{r[f'added_us_per_step_{name}']:+.1f} +- {r[f'added_us_per_step_{name}_se']:.1f} us")
    lo, hi = r["tick_throughput_ratio_ci95"]
    print(f"  one run with the sampler on, {r['tick_steps']} steps of {r['tick_mean_step_ms']:.1f} ms, {r['tick_count']} "
          f"ticks landing in {r['tick_step_share'] * 100:.1f} % of the steps; such a step minus its two neighbours "
          f"({r['tick_pairs']} pairs): {r['tick_overlapped_added_us']:+.0f} +- {r['tick_overlapped_added_us_se']:.0f} us "
          f"(control, no tick: {r['tick_control_added_us']:+.0f} +- {r['tick_control_added_us_se']:.0f} us, "
          f"{r['tick_control_pairs']} pairs)")
    print(f"    added per step {r['tick_added_us_per_step']:+.2f} +- {r['tick_added_us_per_step_se']:.2f} us: "
          f"throughput ratio {r['tick_throughput_ratio']:.5f} ({lo:.5f}-{hi:.5f}); sampler thread "
          f"{r['tick_thread_cpu_us']:.0f} us CPU per tick")
    print(f"  the sampler's CPU over its interval: {r['expected_share_at_interval'] * 100:.3f} % of one core at "
          f"{r['interval_s']} s ({r['expected_share_at_interval'] * r['interval_s'] / 5 * 100:.4f} % at 5 s)")


if __name__ == "__main__":
    sys.exit(main())
