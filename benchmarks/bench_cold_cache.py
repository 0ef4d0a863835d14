"""Cold-cache cost of TraceML's training-thread instrumentation, isolated from the step's work.

Inside a real ~10 ms step the instrumentation runs with cold caches: the step's
working set evicts its code and data between two regions, and the same code costs
several times its hot-loop figure. `bench_overhead.py` sees that cost only through
the +-4 % per-round noise of whole steps. Here every sample first touches 48 MB
(evicting every cache level; outside the timed window), then times only the piece
being measured, with no work inside the regions, so the cold cost itself comes out
with a spread of about +-10 %.

- The unit: a C-level `with` (`threading.Lock`) four times, the floor of four
  regions. The machine's speed drifts by tens of percent between minutes, so each
  figure is also given relative to this unit, measured alongside it.
- Manual pieces, all samples interleaved in a seeded random order: four empty
  `with traceml.timed_*()` regions, `trace_step` alone, one empty step of
  bench_overhead.py (an input-wait region, then `trace_step` around four regions),
  a tiny module's call plain, through `wrap_forward`'s class-wide wrapper and
  through its module-hook fallback (what every module got before the wrapper), and a
  tiny optimizer's step with and without `wrap_optimizer`'s hooks.
- Automatic pieces, one call at a time with the patches installed or not (in
  chunks: installing them invalidates attribute caches): DataLoader `next()`,
  `Tensor.backward`, the optimizer step (global hooks) and `Tensor.to` (patched only
  where CUDA is available).

    .venv/bin/python -m benchmarks.bench_cold_cache [--samples N] [--json]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import traceml_checkout  # noqa: E402,F401  (imports the checkout when not installed)
from benchmarks.json_output import add_json_flag, print_json, table_output  # noqa: E402
import traceml  # noqa: E402
from benchmarks.bench_overhead import _CPU_MODULE, _drain_samplers, _empty_block, _rounds  # noqa: E402
from traceml import patches, step_events  # noqa: E402

torch.set_num_threads(1)

_SWEEP = np.zeros(48 * 1024 * 1024, dtype=np.uint8)
_perf_ns = time.perf_counter_ns


def _evict() -> None:
    """Touch one byte per cache line of 48 MB: more than any cache level of this machine."""
    _SWEEP[::64] += 1


def _tiny_model():
    return torch.nn.Linear(4, 4)


class _PlainLinear(torch.nn.Linear):
    """Separate classes: `wrap_forward` wraps its module's class, which must not slow the others."""


class _TimedLinear(torch.nn.Linear):
    pass


class _HookedLinear(torch.nn.Linear):
    """Holds a module of its own class (never called), so `wrap_forward` takes its hook fallback."""

    def __init__(self, nested: bool = True) -> None:
        super().__init__(4, 4)
        if nested:
            self.inner = _HookedLinear(nested=False)


class _Manual:
    """The manual-mode pieces; each method times one piece and returns nanoseconds.

    Each timed body is written out in full (as in bench_overhead's loops): a helper
    called inside the timed window would add a Python frame, 1-2 us with cold caches,
    to the figure. The empty step is bench_overhead's own, timed inside its loop.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # The empty step's model: trace_step keeps the tracker of the last model only, and
        # alternating two models re-selects it on every step (about 75 us with cold caches).
        self.model = _CPU_MODULE
        self.x = torch.randn(2, 4)
        self.plain_module = _PlainLinear(4, 4)
        self.timed_module = traceml.wrap_forward(_TimedLinear(4, 4))
        self.hooked_module = traceml.wrap_forward(_HookedLinear())
        assert self.hooked_module._forward_pre_hooks and not self.timed_module._forward_pre_hooks
        self.plain_opt = torch.optim.SGD(_tiny_model().parameters(), lr=0.0)
        self.hooked_opt = traceml.wrap_optimizer(torch.optim.SGD(_tiny_model().parameters(), lr=0.0))

    def unit(self) -> int:
        lock = self.lock
        t0 = _perf_ns()
        with lock:
            pass
        with lock:
            pass
        with lock:
            pass
        with lock:
            pass
        return _perf_ns() - t0

    def four_regions(self) -> int:
        t0 = _perf_ns()
        with traceml.timed_h2d():
            pass
        with traceml.timed_forward():
            pass
        with traceml.timed_backward():
            pass
        with traceml.timed_optimizer_step():
            pass
        return _perf_ns() - t0

    def trace_step(self) -> int:
        model = self.model
        t0 = _perf_ns()
        with traceml.trace_step(model):
            pass
        return _perf_ns() - t0

    @staticmethod
    def empty_step() -> int:
        out: list = []
        _empty_block(1, _perf_ns, out, True)
        return out[0]

    def _call(self, module) -> int:
        x = self.x
        t0 = _perf_ns()
        module(x)
        return _perf_ns() - t0

    def forward_plain(self) -> int:
        return self._call(self.plain_module)

    def forward_timed(self) -> int:
        return self._call(self.timed_module)

    def forward_module_hooks(self) -> int:
        return self._call(self.hooked_module)

    @staticmethod
    def _step(opt) -> int:
        t0 = _perf_ns()
        opt.step()
        return _perf_ns() - t0

    def optimizer_plain(self) -> int:
        return self._step(self.plain_opt)

    def optimizer_hooked(self) -> int:
        return self._step(self.hooked_opt)


def _interleaved(pieces: dict, samples: int, after_round) -> dict[str, list[int]]:
    """Every piece once per round, in a seeded random order (bench_overhead's rounds),
    each after an eviction."""
    def evicted(piece):
        def run(steps, clock, out, warmup):
            _evict()
            out.append(piece())
        return run

    rounds = _rounds(samples, 1, None, {name: evicted(piece) for name, piece in pieces.items()},
                     after_round=after_round)
    return {name: [taken[0] for taken in per] for name, per in rounds.items()}


class _Auto:
    """One call through each automatically patched entry point, on a tiny model."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.0)
        data = torch.utils.data.TensorDataset(torch.randn(4096, 8))
        self.loader = torch.utils.data.DataLoader(data, batch_size=4)
        self.batches = iter(self.loader)
        self.x = torch.randn(4, 8)

    def next_batch(self) -> int:
        _evict()
        t0 = _perf_ns()
        try:
            next(self.batches)
        except StopIteration:
            self.batches = iter(self.loader)
            return self.next_batch()
        return _perf_ns() - t0

    def backward(self) -> int:
        loss = self.model(self.x).sum()
        _evict()
        t0 = _perf_ns()
        loss.backward()
        return _perf_ns() - t0

    def optimizer_step(self) -> int:
        self.model(self.x).sum().backward()
        _evict()
        t0 = _perf_ns()
        self.opt.step()
        elapsed = _perf_ns() - t0
        self.opt.zero_grad(set_to_none=True)
        return elapsed

    def to(self) -> int:
        x = self.x
        _evict()
        t0 = _perf_ns()
        x.to("cpu")
        return _perf_ns() - t0


def _auto_samples(samples: int, chunk: int = 10) -> dict[tuple[str, str], list[int]]:
    """Per (piece, "off"/"auto"): samples taken in chunks with the patches out or in."""
    auto = _Auto()
    pieces = {"next_batch": auto.next_batch, "backward": auto.backward,
              "optimizer_step": auto.optimizer_step, "to": auto.to}
    out: dict[tuple[str, str], list[int]] = {(p, m): [] for p in pieces for m in ("off", "auto")}
    order = random.Random(1)
    modes = ["off", "auto"]
    for _ in range(max(1, samples // chunk)):
        order.shuffle(modes)
        for mode in modes:
            if mode == "auto":
                patches.install()
            try:
                for name, piece in pieces.items():
                    piece()
                    piece()  # settle after (un)installing: attribute caches were invalidated
                    out[(name, mode)].extend(piece() for _ in range(chunk))
            finally:
                if mode == "auto":
                    patches.uninstall()
            _close_step()
    return out


def _close_step() -> None:
    """Publish what the samples recorded (untimed), so the pending capture stays small."""
    step_events.complete_step_capture()
    _drain_samplers()


def measure(samples: int) -> dict:
    med = statistics.median
    traceml.init(mode="manual")
    manual = _Manual()
    pieces = {name: getattr(manual, name) for name in (
        "unit", "four_regions", "trace_step", "empty_step", "forward_plain", "forward_timed",
        "forward_module_hooks", "optimizer_plain", "optimizer_hooked")}
    for piece in pieces.values():
        piece()
    found = _interleaved(pieces, samples, _close_step)
    results: dict = {"samples": samples, "cpu_count": os.cpu_count(), "torch": torch.__version__,
                     "cuda_available": torch.cuda.is_available(),
                     "load_avg_start": round(os.getloadavg()[0], 2)}
    unit = med(found["unit"]) / 1e3
    results["unit_us"] = unit
    for name in ("four_regions", "trace_step", "empty_step"):
        value = med(found[name]) / 1e3
        results[f"{name}_us"] = value
        results[f"{name}_units"] = value / unit
    for name, variants in (("forward", ("timed", "module_hooks")), ("optimizer", ("hooked",))):
        plain = med(found[f"{name}_plain"]) / 1e3
        results[f"{name}_plain_us"] = plain
        for variant in variants:
            results[f"{name}_{variant}_added_us"] = med(found[f"{name}_{variant}"]) / 1e3 - plain
    auto = _auto_samples(2 * samples)  # noisier: the calls themselves vary more than the pieces
    for name in ("next_batch", "backward", "optimizer_step", "to"):
        off, on = med(auto[(name, "off")]) / 1e3, med(auto[(name, "auto")]) / 1e3
        results[f"auto_{name}_off_us"] = off
        results[f"auto_{name}_added_us"] = on - off
    traceml.shutdown()
    results["load_avg_end"] = round(os.getloadavg()[0], 2)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=600, help="samples per piece (default 600)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    with table_output(args.json):
        r = measure(args.samples)
        _print_table(r)
    if args.json:
        print_json("bench_cold_cache", args, r)
    return 0


def _print_table(r: dict) -> None:
    print(f"TraceML instrumentation with cold caches (48 MB evicted before each sample; torch {r['torch']}, "
          f"{r['cpu_count']} cores, load avg {r['load_avg_start']} -> {r['load_avg_end']}, "
          f"{r['samples']} samples each, medians)")
    print(f"  unit: four C-level `with` blocks (threading.Lock) : {r['unit_us']:6.2f} us")
    for name, label in (("four_regions", "four `with traceml.timed_*()` regions"),
                        ("trace_step", "`with traceml.trace_step(model)`"),
                        ("empty_step", "empty step: input-wait region + trace_step + 4 regions")):
        print(f"  {label:52s}: {r[f'{name}_us']:6.2f} us ({r[f'{name}_units']:.2f} units)")
    print(f"  module call (plain call {r['forward_plain_us']:.1f} us), added by")
    print(f"    wrap_forward (the class-wide call wrapper)        : {r['forward_timed_added_us']:+6.2f} us")
    print(f"    wrap_forward's fallback, PyTorch module hooks     : {r['forward_module_hooks_added_us']:+6.2f} us")
    print(f"  optimizer step (plain {r['optimizer_plain_us']:.1f} us), added by wrap_optimizer's hooks  "
          f": {r['optimizer_hooked_added_us']:+6.2f} us")
    print("  automatic patches, added per call (plain call in brackets):")
    for name, label in (("next_batch", "DataLoader next()"), ("backward", "Tensor.backward"),
                        ("optimizer_step", "optimizer.step (global hooks)"),
                        ("to", "Tensor.to (patched only with CUDA: "
                               + ("patched" if r["cuda_available"] else "not patched here") + ")")):
        print(f"    {label:50s}: {r[f'auto_{name}_added_us']:+6.2f} us ({r[f'auto_{name}_off_us']:.1f})")


if __name__ == "__main__":
    sys.exit(main())
