"""Training-thread cost of TraceML instrumentation on CPU, against the same loop uninstrumented.

Method: one process, one model/optimizer/DataLoader per step size, run uninstrumented,
in manual mode and in automatic mode in alternation (a new seeded random order every
round). The same model and optimizer serve all variants: separate but identical
model instances differ by several microseconds per small step and by up to 1 % per
~10 ms step on this machine (memory placement), which is as large as the figures being
measured. TraceML is initialised once; what touches the step is added before a
variant's turn and removed after it, outside the timed steps: manual turns add and
remove the forward/optimizer timing and use the wrapped loader, automatic turns
install and uninstall the patches. Uninstrumented turns run with no patch, hook or
wrapper. Two settings steady the runtime, every variant alike (`--default-runtime` leaves
both at their defaults):

- glibc's allocator keeps freed memory (no heap trimming, a fixed mmap threshold):
  by default it returns and re-faults megabytes every few steps, which made single
  ~10 ms steps vary by +-8 % (correlated 0.5-0.8 with page faults).
- Before the throughput phase the heap is frozen (`gc.collect(); gc.freeze()`): a
  full collection then skips torch's ~290,000 long-lived objects and takes about a
  millisecond instead of about 100 ms. Unfrozen, a run's occasional full
  collection (one in 4,000 rounds, seen by the GC tally) lands in whichever step
  crosses the threshold and moves that variant's mean by about 30 us, a lottery as
  large as the effect measured. Young
  collections, which the instrumentation's own allocations bring forward, still
  count.

- Per-step cost inside a real small step (tiny MLP forward/backward/SGD over a
  DataLoader): CPU time of the training thread (`thread_time`) per step; per round,
  the difference between the variant's and the uninstrumented variant's median step
  (preemption lands in the tails), and the figure is the median of those paired
  differences over the rounds (the machine's speed drifts between rounds); a second
  uninstrumented variant shows what the estimator reads when nothing is added.
  Real steps, not only a hot empty loop: caches shared with real work make the
  same code several times slower than in a hot loop (the empty-step figure).
- Throughput of a ~10 ms step: every round runs one timed step of each variant,
  timed whole on the wall clock: steps milliseconds apart see the same machine
  state, where ten-step blocks a round apart saw this VM's speed drift (a
  standard error of about 0.25 % after 13 minutes, against 0.05-0.1 % after 3).
  Each turn first runs `--settle-steps` untimed steps of its variant (default 1),
  every variant alike: installing the automatic patches or `wrap_forward`'s class
  wrapper, and removing them, modifies torch's classes, which invalidates the
  interpreter's attribute caches, and the first step after pays for it (20-25 us
  with cold caches for auto, bench_cold_cache's `auto, first step`). A job installs
  them once; with one-step turns that cost was charged to every automatic step
  (and the removal to whichever variant came next). `--settle-steps 0` is the
  method before issue 23. The samplers' work is done as in a job, at their cadence: their polling threads
  are stopped for this phase and the benchmark drains both samplers itself every
  0.5 s of steps, timed, and charges that time to the instrumented steps, per traced
  step (settling steps included: they publish records too). That is conservative: in a job the samplers run on another thread and
  overlap the GIL-free parts of the step. The figure is the pooled ratio (all
  uninstrumented step time over all instrumented step time plus the sampler
  charge, i.e. steps per second relative to uninstrumented) with a 95 % interval
  (delta method over the per-round pairs), and the mean added time per step with
  its standard error. The CPU accounting beside it: the training thread's added
  CPU per step (median of the per-round paired differences) plus the samplers'
  CPU per traced step.
- The samplers in place (`--in-place-seconds`, default 60): the charge above
  assumes their work runs serially with the step, neither overlapping its GIL-free
  parts nor making it wait for the GIL or refill its caches. After the throughput
  phase, manual steps run for that long with both samplers' own threads live at
  their default interval, their drains timed on their threads; each drain's cost is
  read from the step it lands in and the step after, against the two steps around
  them (`benchmarks.lib.attribution`, with its no-drain control), and gives a second
  throughput ratio per mode: the interleaved steps plus that cost per step instead
  of the charge (their work per step is the same in every mode).

All five regions are timed in every instrumented variant: input wait (DataLoader
next), H2D (`timed_h2d()` around the batch copy: on CPU the automatic patch never
sees a real host-to-device copy; where CUDA is unavailable it is not even
installed), forward, backward, optimizer step, inside `trace_step`. Three
variants: "manual" (the explicit wrappers: `wrap_dataloader` and a `with
traceml.timed_*()` block per region), "manual_hooks" (the same, but forward and
optimizer step through `wrap_forward` (the class-wide call wrapper of
`traceml.forward`) and `wrap_optimizer` (optimizer step hooks)), "auto" (the
automatic patches) and "auto_unmarked" (the automatic patches on the same loop
without `trace_step`: its steps are inferred from the optimizer updates,
`traceml.step_boundary`; everything but the step's own region is timed the same).

    .venv/bin/python -m benchmarks.bench_overhead [--quick] [--json]
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from benchmarks.lib import checkout  # noqa: E402,F401  (imports the checkout when not installed)
from benchmarks.lib.attribution import attributed, overlapping  # noqa: E402
from benchmarks.lib.estimators import (  # noqa: E402
    paired_added, quartiles, ratio_interval, run_rounds, steady_allocator, wall_and_cpu)
from benchmarks.lib.json_output import add_json_flag, print_json, table_output  # noqa: E402
from benchmarks.lib.traced_steps import MODES, drain_samplers, empty_block, mode_runner, with_timed_loader  # noqa: E402
from benchmarks.lib.workload import Job  # noqa: E402
import traceml  # noqa: E402
from traceml import samplers  # noqa: E402

torch.set_num_threads(1)


class _CountingSink:
    def __init__(self) -> None:
        self.steps = 0

    def on_step_time(self, record) -> None:
        self.steps += 1

    def on_step_memory(self, record) -> None:
        pass


class _GcTally:
    """Garbage collections by generation and by whose turn it was (set-up included)."""

    def __init__(self) -> None:
        self.turn = "start"
        self.counts: dict = {}
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        key = (self.turn, info["generation"])
        count, seconds = self.counts.get(key, (0, 0.0))
        self.counts[key] = (count + 1, seconds + time.perf_counter() - self._t0)


def _interleaved_steps(rounds: int, variants: dict, drain_every: int, traced_per_round: int,
                       settle: int = 0):
    """Per variant, one step time per round (wall + i*training-thread CPU), each after
    `settle` untimed steps of its turn; the samplers' work per traced step, drained on
    this thread every `drain_every` rounds (and after the last); and the garbage
    collections of the phase."""
    done = 0
    drain_time = 0j
    tally = _GcTally()

    def after_round() -> None:
        nonlocal done, drain_time
        tally.turn = "sampler drain"
        done += 1
        if done % drain_every == 0 or done == rounds:
            t0 = wall_and_cpu()
            drain_samplers()
            drain_time += wall_and_cpu() - t0

    def taking_turn(name, run):
        def go(steps, clock, out, warmup):
            tally.turn = name
            run(steps, clock, out, warmup)
        return go

    gc.callbacks.append(tally)
    try:
        per_round = run_rounds(rounds, 1, wall_and_cpu,
                               {name: taking_turn(name, run) for name, run in variants.items()},
                               warmup=settle, after_round=after_round)
    finally:
        gc.callbacks.remove(tally)
    times = {name: [steps[0] for steps in per] for name, per in per_round.items()}
    return times, drain_time / (rounds * traced_per_round), tally.counts


def _samplers_in_place(run, seconds: float) -> dict:
    """The samplers' own threads live beside one traced variant's steps for `seconds`:
    what their drains cost the steps they land in and the step after each
    (`benchmarks.lib.attribution`), as a job pays it, against the full charge above."""
    step_spans: list = []
    work_spans: list = []
    samplers_ = [s for s in (traceml._time_sampler, traceml._memory_sampler) if s is not None]

    def timed(run_once):
        def run_timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return run_once(*args, **kwargs)
            finally:
                work_spans.append((t0, time.perf_counter()))
        return run_timed

    def clock() -> float:
        now = time.perf_counter()
        step_spans.append(now)
        return now

    for sampler in samplers_:
        sampler.run_once = timed(sampler.run_once)  # the polling loop calls self.run_once()
        sampler.start()
    durations: list = []
    try:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            run(50, clock, durations)
    finally:
        for sampler in samplers_:
            sampler.stop()
            del sampler.run_once
    spans = list(zip(step_spans[0::2], step_spans[1::2]))
    loop_work = sorted(span for span in work_spans if span[0] <= spans[-1][1])
    found = attributed(durations, overlapping(spans, loop_work), after_steps=1)
    found["steps"] = len(durations)
    found["drains"] = len(loop_work)
    return found


def _adjusted_ratio(base: list, variant: list, added: float, added_se: float) -> tuple[float, float, float]:
    """`ratio_interval` of `variant` plus a per-step cost known to +-`added_se`, both
    uncertainties in the interval."""
    ratio, lo, hi = ratio_interval(base, [t + added for t in variant])
    mean_v = statistics.fmean(variant) + added
    se = math.hypot((hi - lo) / (2 * 1.96), ratio * added_se / mean_v)
    return ratio, ratio - 1.96 * se, ratio + 1.96 * se


LABELS = {**{mode: mode for mode in MODES}, "control": "control (plain vs plain)"}


def _variants(job: Job) -> dict:
    """Step runners: "off", the instrumented modes, and "control", a second
    uninstrumented variant: what each estimator reads when nothing is added (0 us,
    ratio 1.0 on a steady machine)."""
    return {"off": mode_runner(job, None), **{mode: mode_runner(job, mode) for mode in MODES},
            "control": mode_runner(job, None)}


IN_PLACE_MODE = "manual"
"""The variant whose steps the samplers' live threads run beside: their work per step is the
same in every mode (the same six events), so its cost applies to each."""


def measure(quick: bool, throughput_rounds: int | None = None, hidden: int = 960,
            steady_runtime: bool = True, settle: int = 1, in_place_s: float | None = None) -> dict:
    results: dict = {"cpu_count": os.cpu_count(), "torch": torch.__version__,
                     "load_avg_start": round(os.getloadavg()[0], 2),
                     "steady_allocator": steady_runtime and steady_allocator(),
                     "gc_frozen": steady_runtime}
    sink = _CountingSink()
    traceml.register_sink(sink)
    cpu = time.thread_time
    med = statistics.median

    rounds = 40 if quick else 200
    traceml.init(mode="manual")  # samplers + recording; automatic blocks add the patches
    empty = run_rounds(rounds, 200, cpu, {
        "off": lambda n, c, o, w: empty_block(n, c, o, False),
        "on": lambda n, c, o, w: empty_block(n, c, o, True),
    })
    results["empty_step_added_us"] = paired_added(empty, "on")[0]

    job = with_timed_loader(Job(64, 16, 64))
    variants = _variants(job)
    for run in variants.values():
        run(30, cpu, [])
    small = run_rounds(rounds, 25, cpu, variants, warmup=2)
    results["small_step_ms"] = med(t for steps in small["off"] for t in steps) * 1e3
    for mode in (*MODES, "control"):
        added, q1, q3 = paired_added(small, mode)
        results[f"small_step_added_us_{mode}"] = added
        results[f"small_step_added_us_{mode}_iqr"] = (q1, q3)
    results["small_steps_per_variant"] = sum(len(steps) for steps in small["off"])

    job = with_timed_loader(Job(hidden, 128, 32))
    variants = _variants(job)
    calibration: list = []
    for run in variants.values():
        run(3, wall_and_cpu, calibration)
    # From here on the benchmark drains the samplers itself (see the module
    # docstring): their threads stop polling (stop() drains what is queued).
    for sampler in (traceml._time_sampler, traceml._memory_sampler):
        sampler.stop()
    if steady_runtime:
        gc.collect()
        gc.freeze()
    step_s = med(t.real for t in calibration)
    drain_every = max(1, round(samplers.DEFAULT_INTERVAL_S / (len(variants) * (1 + settle) * step_s)))
    if throughput_rounds is None:
        throughput_rounds = 200 if quick else 3000
    if in_place_s is None:
        in_place_s = 5.0 if quick else 60.0
    steps, charge, collections = _interleaved_steps(throughput_rounds, variants, drain_every,
                                                    len(MODES) * (1 + settle), settle)
    if in_place_s:
        in_place = _samplers_in_place(variants[IN_PLACE_MODE], in_place_s)
    traceml.shutdown(timeout_s=10)
    gc.unfreeze()
    off = steps["off"]
    off_wall = [t.real for t in off]
    off_step = statistics.fmean(off_wall)
    results["throughput_hidden"] = hidden
    results["throughput_step_ms"] = off_step * 1e3
    results["throughput_rounds"] = throughput_rounds
    results["settle_steps"] = settle
    results["sampler_us_per_step"] = charge.real * 1e6
    results["sampler_cpu_us_per_step"] = charge.imag * 1e6
    results["sampler_drain_every_rounds"] = drain_every
    off_cpu = med(t.imag for t in off)
    for mode in (*MODES, "control"):
        share = charge if mode in MODES else 0j
        wall = [t.real + share.real for t in steps[mode]]
        ratio, lo, hi = ratio_interval(off_wall, wall)
        results[f"throughput_ratio_{mode}"] = ratio
        results[f"throughput_ratio_{mode}_ci95"] = (lo, hi)
        diffs = [v - o for v, o in zip(wall, off_wall)]
        results[f"big_step_added_wall_us_{mode}"] = statistics.fmean(diffs) * 1e6
        results[f"big_step_added_wall_us_{mode}_se"] = statistics.stdev(diffs) / math.sqrt(len(diffs)) * 1e6
        cpu_diffs = sorted(v.imag - o.imag for v, o in zip(steps[mode], off))
        added = med(cpu_diffs) * 1e6
        results[f"big_step_added_us_{mode}"] = added
        results[f"big_step_added_us_{mode}_iqr"] = tuple(q * 1e6 for q in quartiles(cpu_diffs))
        results[f"cpu_accounted_ratio_{mode}"] = off_cpu / (off_cpu + added / 1e6 + share.imag)
        if in_place_s and mode in MODES:
            ratio, lo, hi = _adjusted_ratio(off_wall, [t.real for t in steps[mode]], in_place["per_step"],
                                            in_place["per_step_se"])
            results[f"throughput_ratio_{mode}_in_place"] = ratio
            results[f"throughput_ratio_{mode}_in_place_ci95"] = (lo, hi)
    if in_place_s:
        results["in_place_seconds"] = in_place_s
        results["in_place_mode"] = IN_PLACE_MODE
        results["in_place_steps"] = in_place["steps"]
        results["in_place_drains"] = in_place["drains"]
        results["in_place_runs"] = in_place["runs"]
        results["in_place_us_per_step"] = in_place["per_step"] * 1e6
        results["in_place_us_per_step_se"] = in_place["per_step_se"] * 1e6
        results["in_place_us_per_run"] = in_place["per_run"] * 1e6
        results["in_place_control_us_per_run"] = in_place["control_per_run"] * 1e6
        results["in_place_control_us_per_run_se"] = in_place["control_per_run_se"] * 1e6
    results["throughput_phase_wall_s"] = sum(t.real for per in steps.values() for t in per)
    results["gc_collections"] = {f"{turn}, generation {gen}": {"count": n, "ms": round(s * 1e3, 2)}
                                 for (turn, gen), (n, s) in sorted(collections.items())}
    traceml.unregister_sink(sink)
    results["steps_delivered"] = sink.steps
    results["load_avg_end"] = round(os.getloadavg()[0], 2)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    add_json_flag(parser)
    parser.add_argument("--rounds", type=int,
                        help="throughput rounds, one timed ~10 ms step per variant each (default 3000, 200 "
                             "with --quick)")
    parser.add_argument("--settle-steps", type=int, default=1,
                        help="untimed steps at the start of each throughput turn, every variant alike (default "
                             "1; 0: the first step after installing patches is timed, as before issue 23)")
    parser.add_argument("--in-place-seconds", type=float,
                        help="seconds of manual steps with the samplers' threads live, whose drains are "
                             "attributed to the steps they land in (default 60, 5 with --quick; 0 skips it)")
    parser.add_argument("--hidden", type=int, default=960,
                        help="hidden width of the throughput model (default 960: a ~9-10 ms step here)")
    parser.add_argument("--default-runtime", action="store_true",
                        help="keep glibc's allocator defaults and an unfrozen GC heap (noisier figures)")
    args = parser.parse_args(argv)
    with table_output(args.json):
        r = measure(args.quick, args.rounds, args.hidden, not args.default_runtime, args.settle_steps,
                    args.in_place_seconds)
        _print_table(r)
    if args.json:
        print_json("bench_overhead", args, r)
    return 0


def _print_table(r: dict) -> None:
    print(f"TraceML training-side overhead on CPU (torch {r['torch']}, {r['cpu_count']} cores, "
          f"load avg {r['load_avg_start']} -> {r['load_avg_end']}; "
          + ("steady allocator, frozen GC heap)" if r["gc_frozen"] else "default allocator and GC)"))
    print(f"  empty step, trace_step + 5 regions : {r['empty_step_added_us']:6.1f} us (thread CPU time)")
    print(f"  real small step ({r['small_step_ms']:.3f} ms CPU), added training-thread CPU per step (median of "
          f"per-round paired differences, IQR; targets: manual <= 30, auto <= 50):")
    for mode in (*MODES, "control"):
        lo, hi = r[f"small_step_added_us_{mode}_iqr"]
        print(f"    {LABELS[mode]:24s} {r[f'small_step_added_us_{mode}']:6.1f} us (IQR {lo:.1f} to {hi:.1f})")
    print(f"  ~10 ms step ({r['throughput_step_ms']:.2f} ms wall, hidden {r['throughput_hidden']}), "
          f"{r['throughput_rounds']} rounds of one timed step per variant after {r['settle_steps']} "
          "untimed; samplers drained every "
          f"{r['sampler_drain_every_rounds']} rounds, {r['sampler_us_per_step']:.1f} us per traced step, charged:")
    print("    throughput ratio, wall clock (target >= 0.99): pooled (95 % interval); "
          "added per step, mean +- standard error")
    for mode in (*MODES, "control"):
        lo, hi = r[f"throughput_ratio_{mode}_ci95"]
        print(f"      {LABELS[mode]:24s} {r[f'throughput_ratio_{mode}']:.4f} ({lo:.4f}-{hi:.4f}); "
              f"{r[f'big_step_added_wall_us_{mode}']:+6.1f} +- {r[f'big_step_added_wall_us_{mode}_se']:.1f} us")
    if r.get("in_place_seconds"):
        print(f"    samplers in place ({r['in_place_seconds']:.0f} s of {r['in_place_mode']} steps with their threads live, "
              f"{r['in_place_drains']} drains): {r['in_place_us_per_step']:+.1f} +- {r['in_place_us_per_step_se']:.1f} us "
              f"per step ({r['in_place_us_per_run']:+.0f} us per drain and the step after, {r['in_place_runs']} paired; "
              f"control {r['in_place_control_us_per_run']:+.0f} +- {r['in_place_control_us_per_run_se']:.0f}); "
              "throughput ratio with them in place of the charge (95 % interval):")
        for mode in MODES:
            lo, hi = r[f"throughput_ratio_{mode}_in_place_ci95"]
            print(f"      {LABELS[mode]:24s} {r[f'throughput_ratio_{mode}_in_place']:.4f} ({lo:.4f}-{hi:.4f})")
    print("    CPU accounting: training thread added per step (median of paired differences, IQR) "
          "+ sampler CPU -> ratio")
    for mode in (*MODES, "control"):
        lo, hi = r[f"big_step_added_us_{mode}_iqr"]
        print(f"      {LABELS[mode]:24s} {r[f'big_step_added_us_{mode}']:6.1f} us (IQR {lo:.1f} to {hi:.1f}) "
              f"-> {r[f'cpu_accounted_ratio_{mode}']:.4f}")
    print("    garbage collections in the throughput phase, by whose turn it was (set-up included):")
    for key, c in r["gc_collections"].items():
        print(f"      {key:32s} {c['count']:4d}, {c['ms']:.1f} ms in all")


if __name__ == "__main__":
    sys.exit(main())
