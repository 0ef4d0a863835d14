"""Training-thread cost of TraceML instrumentation on CPU, against the same loop uninstrumented.

Method: one process, three variants of the same training step run in alternating
blocks (uninstrumented, manual, automatic; the order rotates every round), every
step timed on its own. A variant's step time is the median over all its steps, so
scheduler preemption on this shared machine lands in the tails, not the figure; the
added cost is the difference of medians.

- Per-step cost is measured as CPU time of the training thread (`thread_time`), so
  the figure is what the training thread itself pays; a real small step (tiny MLP
  forward/backward/SGD over a DataLoader) is used, not only an empty loop, because
  caches shared with real work make the same code slower than in a hot loop.
- Throughput is measured on the wall clock for a ~10 ms step: the ratio of the
  uninstrumented to the instrumented median step time.

All five regions are timed in both modes: input wait (DataLoader next), H2D
(`timed_h2d()` around the batch copy: on CPU the automatic patch never sees a real
host-to-device copy), forward, backward, optimizer step, inside `trace_step`. The
samplers run as in production, as background threads.

Automatic-mode blocks install the patches before the block and remove them after
(outside the timed steps), so the uninstrumented blocks run unpatched code.

    .venv/bin/python benchmarks/bench_overhead.py [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import traceml_checkout  # noqa: E402,F401  (imports the checkout when not installed)

import traceml  # noqa: E402
from traceml import patches  # noqa: E402
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
    """One model/optimizer/loader triple with a persistent (re-created at epoch end) iterator."""

    def __init__(self, hidden: int, batch: int, batches: int, features: int = 32) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                         torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                         torch.nn.Linear(hidden, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-5)
        data = torch.utils.data.TensorDataset(torch.randn(batch * batches, features),
                                              torch.randn(batch * batches, 1))
        self.loader = torch.utils.data.DataLoader(data, batch_size=batch)
        self._it = iter(self.loader)

    def next_batch(self):
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)


def _block_plain(job: _Job, steps: int, clock, out: list) -> None:
    model, opt = job.model, job.opt
    for _ in range(steps):
        t0 = clock()
        x, y = job.next_batch()
        x = x.to("cpu")
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(clock() - t0)


def _block_traced(job: _Job, steps: int, clock, out: list, *, manual: bool) -> None:
    """Manual: wrapped model/optimizer/loader + timed_backward. Auto: patches do those."""
    model, opt = job.model, job.opt
    for _ in range(steps):
        t0 = clock()
        x, y = job.next_batch()
        with traceml.trace_step(model):
            with traceml.timed_h2d():
                x = x.to("cpu")
            loss = torch.nn.functional.mse_loss(model(x), y)
            if manual:
                with traceml.timed_backward():
                    loss.backward()
            else:
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out.append(clock() - t0)


class _ManualJob(_Job):
    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        traceml.wrap_forward(self.model)
        traceml.wrap_optimizer(self.opt)
        self.timed_loader = traceml.wrap_dataloader(self.loader)
        self._it = iter(self.timed_loader)

    def next_batch(self):
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.timed_loader)
            return next(self._it)


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


def _rounds(rounds: int, block: int, clock, variants: dict) -> dict[str, list[float]]:
    """variants: name -> callable(steps, clock, out). Rotating order each round."""
    names = list(variants)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            variants[name](block, clock, out[name])
    return out


def _auto(job: _Job):
    def run(steps, clock, out):
        patches.install()
        patches.instrument_model(job.model)
        try:
            _block_traced(job, steps, clock, out, manual=False)
        finally:
            patches.uninstall()
    return run


def measure(quick: bool) -> dict:
    results: dict = {"cpu_count": os.cpu_count(), "torch": torch.__version__,
                     "load_avg_start": round(os.getloadavg()[0], 2)}
    sink = _CountingSink()
    traceml.register_sink(sink)
    traceml.init(mode="manual")  # samplers + recording; auto blocks add the patches themselves
    cpu = time.thread_time
    med = statistics.median

    rounds = 20 if quick else 60
    empty = _rounds(rounds, 200, cpu, {
        "off": lambda n, c, o: _empty_block(n, c, o, False),
        "on": lambda n, c, o: _empty_block(n, c, o, True),
    })
    results["empty_step_added_us"] = (med(empty["on"]) - med(empty["off"])) * 1e6

    plain, manual, auto = _Job(64, 16, 64), _ManualJob(64, 16, 64), _Job(64, 16, 64)
    for job in (plain, manual, auto):
        _block_plain(job, 30, cpu, [])
    small = _rounds(rounds, 25, cpu, {
        "off": lambda n, c, o: _block_plain(plain, n, c, o),
        "manual": lambda n, c, o: _block_traced(manual, n, c, o, manual=True),
        "auto": _auto(auto),
    })
    results["small_step_ms"] = med(small["off"]) * 1e3
    results["small_step_added_us_manual"] = (med(small["manual"]) - med(small["off"])) * 1e6
    results["small_step_added_us_auto"] = (med(small["auto"]) - med(small["off"])) * 1e6
    results["small_steps_per_variant"] = len(small["off"])

    wall = time.perf_counter
    plain, manual, auto = _Job(896, 128, 32), _ManualJob(896, 128, 32), _Job(896, 128, 32)
    for job in (plain, manual, auto):
        _block_plain(job, 3, wall, [])
    big = _rounds(8 if quick else 40, 5, wall, {
        "off": lambda n, c, o: _block_plain(plain, n, c, o),
        "manual": lambda n, c, o: _block_traced(manual, n, c, o, manual=True),
        "auto": _auto(auto),
    })
    base = med(big["off"])
    results["throughput_step_ms"] = base * 1e3
    results["throughput_steps_per_variant"] = len(big["off"])
    for mode in ("manual", "auto"):
        results[f"throughput_ratio_{mode}"] = base / med(big[mode])
        results[f"throughput_added_us_{mode}"] = (med(big[mode]) - base) * 1e6
    traceml.shutdown(timeout_s=10)
    traceml.unregister_sink(sink)
    results["steps_delivered"] = sink.steps
    results["load_avg_end"] = round(os.getloadavg()[0], 2)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    r = measure(args.quick)
    print(f"TraceML training-side overhead on CPU (torch {r['torch']}, {r['cpu_count']} cores, "
          f"load avg {r['load_avg_start']} -> {r['load_avg_end']})")
    print(f"  empty step, trace_step + 5 regions : {r['empty_step_added_us']:6.1f} us (thread CPU time)")
    print(f"  real small step ({r['small_step_ms']:.3f} ms CPU)  : manual {r['small_step_added_us_manual']:6.1f} us, "
          f"auto {r['small_step_added_us_auto']:6.1f} us added (targets <= 30 / <= 50)")
    print(f"  ~10 ms step ({r['throughput_step_ms']:.2f} ms wall)     : throughput ratio manual "
          f"{r['throughput_ratio_manual']:.4f}, auto {r['throughput_ratio_auto']:.4f} (target >= 0.99)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(r, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
