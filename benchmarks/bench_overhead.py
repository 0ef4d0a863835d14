"""Training-thread cost of TraceML instrumentation on CPU, against the same loop uninstrumented.

Method: one process, one model/optimizer/DataLoader per step size, run uninstrumented,
in manual mode and in automatic mode in alternating blocks (the order rotates every
round). The same model and optimizer serve all three variants: separate but identical
model instances differ by several microseconds per small step and by up to 1 % per
~10 ms step on this machine (memory placement), which is as large as the figures being
measured. TraceML is initialised once (its sampler threads run throughout, idle
during uninstrumented blocks, as they would be in a real job between steps); what
touches the step is added before a block and removed after it, outside the timed
steps: manual blocks add and remove the forward/optimizer timing and use the wrapped
loader, automatic blocks install and uninstall the patches. Uninstrumented blocks
run with no patch, hook or wrapper.

- Per-step cost inside a real small step (tiny MLP forward/backward/SGD over a
  DataLoader): CPU time of the training thread (`thread_time`) per step; per round,
  the difference between the variant's and the uninstrumented variant's median step
  (preemption lands in the tails), and the figure is the median of those paired
  differences over the rounds (the machine's speed drifts between rounds); a second
  uninstrumented variant shows what the estimator reads when nothing is added.
  Real steps, not only a hot empty loop: caches shared with real work make the
  same code several times slower than in a hot loop (the empty-step figure).
- Throughput of a ~10 ms step: each block of steps is timed as a whole (so periodic
  costs inside the steps are included) after two untimed steps that let the
  interpreter settle from the block's set-up (every variant alike; installing the
  automatic patches is a one-off cost in a real job), and the figure is the median over rounds
  of (uninstrumented block time / instrumented block time) from the same round; the
  interquartile range of those per-round ratios shows the machine's noise. Reported
  on the wall clock and on the training thread's CPU clock (less sensitive to other
  jobs on the machine). Each instrumented block ends, inside its timed window, with
  a synchronous drain of both samplers: the resolution and delivery its steps
  caused is charged to it (left to the sampler threads, that GIL-holding work would
  land in whichever block runs when they wake, uninstrumented ones included).

All five regions are timed in every instrumented variant: input wait (DataLoader
next), H2D (`timed_h2d()` around the batch copy: on CPU the automatic patch never
sees a real host-to-device copy; where CUDA is unavailable it is not even
installed), forward, backward, optimizer step, inside `trace_step`. Three
variants: "manual" (the explicit wrappers: `wrap_dataloader` and a `with
traceml.timed_*()` block per region), "manual_hooks" (the same, but forward and
optimizer step through `wrap_forward` (the class-wide call wrapper of
`traceml.forward`) and `wrap_optimizer` (optimizer step hooks)) and "auto" (the
automatic patches).

    .venv/bin/python benchmarks/bench_overhead.py [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import traceml_checkout  # noqa: E402,F401  (imports the checkout when not installed)

import traceml  # noqa: E402
from traceml import forward, hooks, patches  # noqa: E402
from traceml.schema.vocabulary import RAW_DATALOADER_NEXT  # noqa: E402

torch.set_num_threads(1)


class _CountingSink:
    def __init__(self) -> None:
        self.steps = 0

    def on_step_time(self, record) -> None:
        self.steps += 1

    def on_step_memory(self, record) -> None:
        pass


class _Job:
    """One model/optimizer/loader, shared by every variant; each variant has its own iterator."""

    def __init__(self, hidden: int, batch: int, batches: int, features: int = 32) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                         torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                         torch.nn.Linear(hidden, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-5)
        data = torch.utils.data.TensorDataset(torch.randn(batch * batches, features),
                                              torch.randn(batch * batches, 1))
        self.loader = torch.utils.data.DataLoader(data, batch_size=batch)
        self.plain_batches = _Batches(self.loader)
        self.timed_batches = _Batches(traceml.wrap_dataloader(self.loader))


class _Batches:
    """next() over an iterable, restarting it at the end of each epoch (outside any step)."""

    def __init__(self, iterable) -> None:
        self._iterable = iterable
        self._it = iter(iterable)

    def next(self):
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self._iterable)
            return next(self._it)


def _block_plain(job: _Job, steps: int, clock, out: list) -> None:
    model, opt, next_batch = job.model, job.opt, job.plain_batches.next
    for _ in range(steps):
        t0 = clock()
        x, y = next_batch()
        x = x.to("cpu")
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(clock() - t0)


def _block_traced(job: _Job, steps: int, clock, out: list, mode: str) -> None:
    """One block of traced steps; `mode` says who times the five regions.

    - "manual": the explicit wrappers: the timed loader and a `with` block per region;
    - "manual_hooks": the timed loader, `timed_h2d`/`timed_backward`, and the model and
      optimizer instrumented once with `wrap_forward`/`wrap_optimizer`;
    - "auto": the automatic patches (plus `timed_h2d`: on CPU no copy goes to a device).
    """
    model, opt = job.model, job.opt
    next_batch = job.plain_batches.next if mode == "auto" else job.timed_batches.next
    if mode == "manual":
        forward, optimizer_step = traceml.timed_forward, traceml.timed_optimizer_step
        for _ in range(steps):
            t0 = clock()
            x, y = next_batch()
            with traceml.trace_step(model):
                with traceml.timed_h2d():
                    x = x.to("cpu")
                with forward():
                    out_ = model(x)
                loss = torch.nn.functional.mse_loss(out_, y)
                with traceml.timed_backward():
                    loss.backward()
                with optimizer_step():
                    opt.step()
                opt.zero_grad(set_to_none=True)
            out.append(clock() - t0)
        return
    hooked = mode == "manual_hooks"
    for _ in range(steps):
        t0 = clock()
        x, y = next_batch()
        with traceml.trace_step(model):
            with traceml.timed_h2d():
                x = x.to("cpu")
            loss = torch.nn.functional.mse_loss(model(x), y)
            if hooked:
                with traceml.timed_backward():
                    loss.backward()
            else:
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out.append(clock() - t0)


def _variant(job: _Job, mode: str | None):
    """A block runner: uninstrumented (mode None), "manual", "manual_hooks" or "auto".

    TraceML stays initialised for the whole run (its samplers run throughout, as
    in production: they are idle during uninstrumented blocks); only what touches
    the step is added before a block and removed after it: the forward and optimizer
    timing, or the automatic patches. Starting and stopping TraceML around every block made the
    following steps measurably slower, an artefact no real job has.
    """
    def run(steps, clock, out, warmup=0, drains=None):
        if mode is None:
            if warmup:
                _block_plain(job, warmup, clock, [])
            _block_plain(job, steps, clock, out)
            return
        if mode == "manual_hooks":
            traceml.wrap_forward(job.model)
            traceml.wrap_optimizer(job.opt)
        elif mode == "auto":
            patches.install()
            patches.instrument_model(job.model)
        try:
            if warmup:
                _block_traced(job, warmup, clock, [], mode)
            if drains is not None:
                _drain_samplers()  # the warm-up steps' records, untimed
            _block_traced(job, steps, clock, out, mode)
            if drains is not None:  # this block's own sampler work, timed
                t0 = clock()
                _drain_samplers()
                drains.append(clock() - t0)
        finally:
            if mode == "manual_hooks":
                forward.remove_forward_instrumentation(job.model)
                hooks.remove_optimizer_instrumentation(job.opt)
            elif mode == "auto":
                patches.uninstall()
    return run


def _drain_samplers() -> None:
    """Resolve and deliver everything the steps so far published, on this thread, now.

    The throughput blocks end with this, inside their timed window, so each block
    is charged with exactly the sampler work its own steps caused. Left to the
    sampler threads, that work (which holds the GIL) lands in whichever block runs
    when they wake, uninstrumented ones included, flattering the instrumented ratio.
    """
    for sampler in (traceml._time_sampler, traceml._memory_sampler):
        if sampler is not None:
            sampler.run_once()


_CPU_MODULE = torch.nn.Linear(1, 1)  # selects the CPU for trace_step even where CUDA exists


def _empty_block(steps: int, clock, out: list, traced: bool) -> None:
    region = traceml.timed_region
    model = _CPU_MODULE
    for _ in range(steps):
        t0 = clock()
        if traced:
            with region(RAW_DATALOADER_NEXT, device="cpu"):
                pass
            with traceml.trace_step(model):
                with traceml.timed_h2d():
                    pass
                with traceml.timed_forward():
                    pass
                with traceml.timed_backward():
                    pass
                with traceml.timed_optimizer_step():
                    pass
        out.append(clock() - t0)


def _rounds(rounds: int, block: int, clock, variants: dict, warmup: int = 0) -> dict[str, list[list[float]]]:
    """variants: name -> callable(steps, clock, out, warmup). A new random order each round.

    Returns, per variant, one list of step times per round. The order is shuffled
    (seeded) rather than rotated so that no variant always follows the same one:
    removing the automatic patches invalidates `torch.Tensor` attribute caches, and
    a fixed successor would pay for it every round.
    """
    names = list(variants)
    order = random.Random(0)
    out: dict[str, list[list[float]]] = {n: [] for n in names}
    for _ in range(rounds):
        order.shuffle(names)
        for name in names:
            steps: list = []
            variants[name](block, clock, steps, warmup)
            out[name].append(steps)
    return out


def _quartiles(ordered: list) -> tuple:
    """(first, third) quartile of an already sorted list."""
    return ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]


def _paired_added(samples: dict, variant: str, base: str = "off") -> tuple[float, float, float]:
    """Added time per step of `variant` over `base`, paired by round: (median, q1, q3) in us.

    Per round: the difference of the two variants' median step times in that round
    (blocks a few milliseconds apart, so in the same machine state); the figure is
    the median of those differences over all rounds. This machine's speed drifts by
    tens of percent over seconds (a shared VM), which a difference of overall
    medians picks up whenever the two variants' rounds sample the drift unevenly.
    """
    med = statistics.median
    diffs = sorted((med(v) - med(b)) * 1e6 for v, b in zip(samples[variant], samples[base]))
    return (med(diffs), *_quartiles(diffs))


def _wall_and_cpu() -> complex:
    """Wall clock (real part) and training-thread CPU (imaginary part) in one subtractable value."""
    return complex(time.perf_counter(), time.thread_time())


def _timed_blocks(rounds: int, block: int, variants: dict, warmup: int):
    """Per variant and round: the step times (wall + i*training-thread CPU) and the drain time.

    Each block first runs `warmup` untimed steps (every variant alike): installing
    the automatic patches rebinds attributes of `torch.Tensor`, which invalidates the
    interpreter's attribute caches for the next step or two. A real job installs
    them once; timing those steps in every block would charge that one-off cost to
    each block of ten steps. Instrumented blocks end with a synchronous drain of both
    samplers, timed separately (0 for uninstrumented blocks).
    """
    drains: dict[str, list[complex]] = {name: [] for name in variants}

    def with_drain(name, run):
        def go(steps, clock, out, warm):
            timed: list = []
            run(steps, clock, out, warm, timed)
            drains[name].append(timed[0] if timed else 0j)
        return go

    per_round = _rounds(rounds, block, _wall_and_cpu,
                        {name: with_drain(name, run) for name, run in variants.items()}, warmup)
    return per_round, drains


MODES = ("manual", "manual_hooks", "auto")
LABELS = {**{mode: mode for mode in MODES}, "control": "control (plain vs plain)"}


def _variants(job: _Job) -> dict:
    """Block runners: "off", the instrumented modes, and "control", a second
    uninstrumented variant: what each estimator reads when nothing is added (0 us,
    ratio 1.0 on a steady machine)."""
    return {"off": _variant(job, None), **{mode: _variant(job, mode) for mode in MODES},
            "control": _variant(job, None)}


def measure(quick: bool, block: int = 10, block_rounds: int | None = None) -> dict:
    results: dict = {"cpu_count": os.cpu_count(), "torch": torch.__version__,
                     "load_avg_start": round(os.getloadavg()[0], 2)}
    sink = _CountingSink()
    traceml.register_sink(sink)
    cpu = time.thread_time
    med = statistics.median

    rounds = 40 if quick else 200
    traceml.init(mode="manual")  # samplers + recording; automatic blocks add the patches
    empty = _rounds(rounds, 200, cpu, {
        "off": lambda n, c, o, w: _empty_block(n, c, o, False),
        "on": lambda n, c, o, w: _empty_block(n, c, o, True),
    })
    results["empty_step_added_us"] = _paired_added(empty, "on")[0]

    job = _Job(64, 16, 64)
    variants = _variants(job)
    for run in variants.values():
        run(30, cpu, [])
    small = _rounds(rounds, 25, cpu, variants, warmup=2)
    results["small_step_ms"] = med(t for steps in small["off"] for t in steps) * 1e3
    for mode in (*MODES, "control"):
        added, q1, q3 = _paired_added(small, mode)
        results[f"small_step_added_us_{mode}"] = added
        results[f"small_step_added_us_{mode}_iqr"] = (q1, q3)
    results["small_steps_per_variant"] = sum(len(steps) for steps in small["off"])

    job = _Job(896, 128, 32)
    variants = _variants(job)
    for run in variants.values():
        run(3, _wall_and_cpu, [])
    other0 = time.process_time() - time.thread_time()
    if block_rounds is None:
        block_rounds = 10 if quick else 120
    steps, drains = _timed_blocks(block_rounds, block, variants, warmup=2)
    traceml.shutdown(timeout_s=10)  # the samplers' last work is counted too
    other_threads_s = time.process_time() - time.thread_time() - other0
    blocks = {name: [sum(s) + d for s, d in zip(steps[name], drains[name])] for name in variants}
    off_step_cpu = med(t.imag for block_steps in steps["off"] for t in block_steps)
    results["throughput_step_ms"] = med(b.real for b in blocks["off"]) / block * 1e3
    results["throughput_blocks_per_variant"] = len(blocks["off"])
    results["throughput_steps_per_block"] = block
    cpu_steps = {name: [[t.imag for t in s] for s in per_round] for name, per_round in steps.items()}
    for mode in (*MODES, "control"):
        # Direct: the wall-clock ratio of whole blocks (steps + their sampler drain), per round.
        pairs = list(zip(blocks["off"], blocks[mode]))
        ratios = sorted(o.real / m.real for o, m in pairs)
        results[f"throughput_ratio_{mode}"] = med(ratios)
        results[f"throughput_ratio_{mode}_iqr"] = _quartiles(ratios)
        results[f"throughput_ratio_{mode}_pooled"] = sum(o.real for o, _ in pairs) / sum(m.real for _, m in pairs)
        # CPU accounting: what a step adds to the training thread inside a ~10 ms step
        # (paired by round, like the small step) plus the sampler work per step.
        added, q1, q3 = _paired_added(cpu_steps, mode)
        drain = med(d.imag for d in drains[mode]) / block * 1e6
        results[f"big_step_added_us_{mode}"] = added
        results[f"big_step_added_us_{mode}_iqr"] = (q1, q3)
        results[f"sampler_drain_us_per_step_{mode}"] = drain
        results[f"cpu_accounted_ratio_{mode}"] = off_step_cpu / (off_step_cpu + (added + drain) / 1e6)
    results["sampler_cpu_us_per_step"] = other_threads_s / (len(MODES) * len(blocks["off"]) * block) * 1e6
    results["throughput_phase_wall_s"] = sum(sum(v).real for v in blocks.values())
    traceml.unregister_sink(sink)
    results["steps_delivered"] = sink.steps
    results["load_avg_end"] = round(os.getloadavg()[0], 2)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--block", type=int, default=10, help="steps per timed throughput block (default 10)")
    parser.add_argument("--block-rounds", type=int, help="rounds of throughput blocks (default 120, 10 with --quick)")
    args = parser.parse_args(argv)
    r = measure(args.quick, args.block, args.block_rounds)
    print(f"TraceML training-side overhead on CPU (torch {r['torch']}, {r['cpu_count']} cores, "
          f"load avg {r['load_avg_start']} -> {r['load_avg_end']})")
    print(f"  empty step, trace_step + 5 regions : {r['empty_step_added_us']:6.1f} us (thread CPU time)")
    print(f"  real small step ({r['small_step_ms']:.3f} ms CPU), added training-thread CPU per step (median of "
          f"per-round paired differences, IQR; targets: manual <= 30, auto <= 50):")
    for mode in (*MODES, "control"):
        lo, hi = r[f"small_step_added_us_{mode}_iqr"]
        print(f"    {LABELS[mode]:24s} {r[f'small_step_added_us_{mode}']:6.1f} us (IQR {lo:.1f} to {hi:.1f})")
    print(f"  ~10 ms step ({r['throughput_step_ms']:.2f} ms wall), {r['throughput_blocks_per_variant']} rounds of "
          f"{r['throughput_steps_per_block']}-step blocks (target >= 0.99):")
    print("    wall-clock throughput ratio: median of per-round block ratios (IQR; pooled)")
    for mode in (*MODES, "control"):
        lo, hi = r[f"throughput_ratio_{mode}_iqr"]
        print(f"      {LABELS[mode]:24s} {r[f'throughput_ratio_{mode}']:.4f} (IQR {lo:.3f}-{hi:.3f}; "
              f"{r[f'throughput_ratio_{mode}_pooled']:.4f})")
    print("    CPU accounting: training thread added per step (paired, IQR) + sampler work per step "
          "-> ratio")
    for mode in (*MODES, "control"):
        lo, hi = r[f"big_step_added_us_{mode}_iqr"]
        print(f"      {LABELS[mode]:24s} {r[f'big_step_added_us_{mode}']:6.1f} us (IQR {lo:.1f} to {hi:.1f}) + "
              f"{r[f'sampler_drain_us_per_step_{mode}']:5.1f} us -> {r[f'cpu_accounted_ratio_{mode}']:.4f}")
    print(f"  sampler threads' own CPU per instrumented step (wake-ups): {r['sampler_cpu_us_per_step']:.1f} us")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(r, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
