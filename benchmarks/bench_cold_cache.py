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
- Whole steps, per mode, evicted inside every phase (`--phase-rounds`, 0 skips it):
  one eviction before a piece times it as one visit, where the code is cold only
  once, but inside a real ~10 ms step the work between two instrumentation calls
  evicts them again. Here every phase's work (the batch fetch, a batch copy,
  forward, backward, the optimizer step, zero_grad) is the forward of
  bench_overhead's ~10 ms model (960 wide, batch 128, no grad), so each stretch of
  instrumentation between two phases runs as cold as in that step. Only the time
  outside the evictions counts, per stretch, against the same loop uninstrumented
  (paired per round, medians); the stretches name the components: the loader's
  entry and exit, step begin with the copy's region entry, the copy's exit with
  forward's entry, forward's exit with backward's entry, backward's exit with the
  optimizer's entry, the optimizer's exit, and step end with the publication of the
  step's records. The samplers' work per traced step is timed as bench_overhead
  charges it (both drained on this thread every 8 rounds).
- Real ~10 ms steps stamped at every boundary of their own work (`--marked-rounds`):
  bench_overhead's step itself (the same model, loader and optimizer), whose model,
  autograd graph, optimizer and loader stamp when each phase's work starts and ends.
  Between two stamps lies either work or glue (the loop's statements and the
  instrumentation around that work, as cold as the real step leaves them): the glue
  against the plain loop's is the instrumentation's own cost per component in the
  step this benchmark is about; the work against the plain loop's is what it costs
  the work (what its own memory traffic evicted), far noisier.
- Modes in both step sections as bench_overhead's: manual (`with` blocks and the
  wrapped loader), manual_hooks (`wrap_forward`'s class wrapper, `wrap_optimizer`'s
  hooks) and auto (the patches), each installed for its turn and settled by one
  untimed step, as in a job; `auto_first_step` times the step right after
  installing the patches (what bench_overhead's one-step turns charged every
  automatic step before issue 23). `control` is the plain loop against itself.
- `--against TREE` runs another checkout's training side in the same process,
  loaded under another name, interleaved round by round with this one in both step
  sections: before/after figures without the machine's drift between two runs
  (this VM's speed moved by 40 % between minutes on 2026-12-01).

    .venv/bin/python -m benchmarks.bench_cold_cache [--samples N] [--phase-rounds N] [--marked-rounds N]
        [--against TREE] [--json]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.lib import checkout  # noqa: E402,F401  (imports the checkout when not installed)
from benchmarks.lib.checkout import package_roots  # noqa: E402
from benchmarks.lib.estimators import run_rounds  # noqa: E402
from benchmarks.lib.json_output import add_json_flag, print_json, table_output  # noqa: E402
from benchmarks.lib.traced_steps import CPU_MODULE, block_traced, drain_samplers, empty_block  # noqa: E402
from benchmarks.lib.workload import Batches, block_plain  # noqa: E402
import traceml  # noqa: E402
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
        self.model = CPU_MODULE
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
        empty_block(1, _perf_ns, out, True)
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

    rounds = run_rounds(samples, 1, None, {name: evicted(piece) for name, piece in pieces.items()},
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
    drain_samplers()


STRETCHES = (
    ("loader_enter", "DataLoader next(): entry"),
    ("loader_exit", "DataLoader next(): exit"),
    ("step_begin", "step begin + h2d region entry"),
    ("h2d_exit_forward_enter", "h2d region exit + forward entry"),
    ("forward_exit_backward_enter", "forward exit + backward entry"),
    ("backward_exit_optimizer_enter", "backward exit + optimizer step entry"),
    ("optimizer_exit", "optimizer step exit"),
    ("step_end", "step end + record publication"),
)
PHASE_MODES = ("manual", "manual_hooks", "auto", "auto_first_step", "control")

MARKED_PARTS = (
    ("loader_enter", "before the batch fetch: DataLoader next() entry", True),
    ("fetch", "(the batch fetch)", False),
    ("step_begin", "fetch -> forward: next() exit, step begin, h2d region, forward entry", True),
    ("forward", "(forward)", False),
    ("forward_exit_backward_enter", "forward -> backward: forward exit, loss, backward entry", True),
    ("backward", "(backward)", False),
    ("backward_exit_optimizer_enter", "backward -> optimizer: backward exit, optimizer entry", True),
    ("optimizer", "(the optimizer's update)", False),
    ("step_end", "optimizer -> end: optimizer exit, zero_grad, step end + publication", True),
)
"""(key, label, glue): the stretches of a real step between its marks; `glue` ones hold
the loop's statements and the instrumentation, the others the step's own work."""
MARKED_MODES = ("manual", "manual_hooks", "auto", "control")


def _identity_calling_in_backward(callback) -> type:
    """An identity autograd node whose backward calls `callback`: where backward reaches it."""
    class CallInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            callback()
            return grad
    return CallInBackward


class _Turns:
    """What both step kinds share: the modes' set-up and a settled, timed turn."""

    tm = traceml

    def turn(self, mode: str) -> list:
        """One timed step of `mode`, after one untimed step of it (its set-up included),
        as in a job: installing the patches or the class wrapper modifies torch's
        classes and the first step after pays for it (`auto_first_step` shows it)."""
        tm = self.tm
        run = {"plain": self.plain, "control": self.plain, "manual": self.manual,
               "manual_hooks": lambda: self.hooked(self.timed_batches, True),
               "auto": lambda: self.hooked(self.plain_batches, False),
               "auto_first_step": lambda: self.hooked(self.plain_batches, False)}[mode]
        if mode == "manual_hooks":
            tm.wrap_forward(self.model)
            tm.wrap_optimizer(self.opt)
        elif mode.startswith("auto"):
            tm.patches.install()
            tm.patches.instrument_model(self.model)
        try:
            if mode != "auto_first_step":
                run()
            return run()
        finally:
            if mode == "manual_hooks":
                tm.forward.remove_forward_instrumentation(self.model)
                tm.hooks.remove_optimizer_instrumentation(self.opt)
            elif mode.startswith("auto"):
                tm.patches.uninstall()


class _PhaseSteps(_Turns):
    """Steps whose every phase evicts the caches with real work; times what lies between.

    `evict()` is called inside each phase (the dataset's `__getitem__`, after the copy,
    the module's forward, an autograd node's backward, the optimizer's step, after
    zero_grad): it closes the current stretch, runs the ~10 ms model's forward
    (untimed) and opens the next one. The model, optimizer and loader are tiny apart
    from that, so a stretch holds the loop's own statements and, instrumented, the
    instrumentation between two phases. `tm` is the traceml package to measure.
    """

    parts = STRETCHES

    def __init__(self, tm=traceml) -> None:
        self.tm = tm
        torch.manual_seed(0)
        self._work = torch.nn.Sequential(torch.nn.Linear(32, 960), torch.nn.ReLU(), torch.nn.Linear(960, 960),
                                         torch.nn.ReLU(), torch.nn.Linear(960, 1))
        self._work_x = torch.randn(128, 32)
        self.spent = [0] * (len(STRETCHES) + 1)
        self._at = 0
        self._since = 0
        steps = self

        class Data(torch.utils.data.Dataset):
            def __len__(self):
                return 1 << 30

            def __getitem__(self, index):
                steps.evict()
                return torch.ones(2)

        EvictInBackward = _identity_calling_in_backward(self.evict)

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = torch.nn.Parameter(torch.ones(2))

            def forward(self, x):
                steps.evict()
                return EvictInBackward.apply(x * self.w)

        class SGD(torch.optim.SGD):
            def step(self, closure=None):
                steps.evict()
                return super().step(closure)

        self.model = Model()
        self.opt = SGD(self.model.parameters(), lr=0.0)
        self.loader = torch.utils.data.DataLoader(Data(), batch_size=None, sampler=range(1 << 30))
        self.plain_batches = iter(self.loader)
        self.timed_batches = iter(tm.wrap_dataloader(self.loader))

    def evict(self) -> None:
        now = _perf_ns()
        at = self._at
        self.spent[at] += now - self._since
        self._at = at + 1
        with torch.no_grad():
            self._work(self._work_x)
        self._since = _perf_ns()

    def _begin(self) -> None:
        self.spent = [0] * (len(STRETCHES) + 1)
        self._at = 0
        self._since = _perf_ns()

    def _end(self) -> list:
        self.spent[self._at] += _perf_ns() - self._since
        return self.spent[:len(STRETCHES)]

    def plain(self) -> list:
        model, opt, batches, evict = self.model, self.opt, self.plain_batches, self.evict
        self._begin()
        x = next(batches)
        evict()
        x = x.to("cpu")
        evict()
        out = model(x)
        loss = out.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        evict()
        return self._end()

    def manual(self) -> list:
        model, opt, batches, evict, tm = self.model, self.opt, self.timed_batches, self.evict, self.tm
        self._begin()
        x = next(batches)
        evict()
        with tm.trace_step(model):
            with tm.timed_h2d():
                x = x.to("cpu")
                evict()
            with tm.timed_forward():
                out = model(x)
            loss = out.sum()
            with tm.timed_backward():
                loss.backward()
            with tm.timed_optimizer_step():
                opt.step()
            opt.zero_grad(set_to_none=True)
            evict()
        return self._end()

    def hooked(self, batches, timed_backward: bool) -> list:
        """manual_hooks (the timed loader, `timed_backward`) and auto (patches do both)."""
        model, opt, evict, tm = self.model, self.opt, self.evict, self.tm
        self._begin()
        x = next(batches)
        evict()
        with tm.trace_step(model):
            with tm.timed_h2d():
                x = x.to("cpu")
                evict()
            out = model(x)
            loss = out.sum()
            if timed_backward:
                with tm.timed_backward():
                    loss.backward()
            else:
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            evict()
        return self._end()


class _MarkedSteps(_Turns):
    """bench_overhead's ~10 ms step itself, stamped at every boundary of its own work.

    The model stamps when its forward starts and ends and (through two identity
    autograd nodes) when backward starts and nearly ends (before the first layer's
    weight gradient); the optimizer when its update starts and ends; the loader's
    sampler when the batch fetch starts and its collate when it ends. Between two
    stamps lies either the step's own work or glue: the loop's statements and, when
    instrumented, the instrumentation, run as cold as a real step leaves it. The glue
    against the plain loop's is the instrumentation's own cost in a real step; the
    work against the plain loop's is what it costs the work around it (evicting what
    the work would have found in the caches), which is far noisier.
    """

    parts = MARKED_PARTS

    def __init__(self, tm=traceml, hidden: int = 960, batch: int = 128, batches: int = 32) -> None:
        self.tm = tm
        stamps = self.stamps = []

        def stamp() -> int:
            now = _perf_ns()
            stamps.append(now)
            return now

        self._stamp = stamp
        Stamp = _identity_calling_in_backward(stamp)

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.ReLU(),
                                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                               torch.nn.Linear(hidden, 1))

            def forward(self, x):
                stamp()
                net = self.net
                h = Stamp.apply(net[0](x))  # its backward runs last: backward (nearly) ends
                out = Stamp.apply(net[4](net[3](net[2](net[1](h)))))  # its backward runs first
                stamp()
                return out

        class SGD(torch.optim.SGD):
            def step(self, closure=None):
                stamp()
                result = super().step(closure)
                stamp()
                return result

        class Sampler(torch.utils.data.Sampler):
            def __init__(self, n: int) -> None:
                self.n = n

            def __iter__(self):
                for index in range(self.n):
                    if index % batch == 0:
                        stamp()  # the batch fetch starts
                    yield index

            def __len__(self) -> int:
                return self.n

        def collate(items):
            out = torch.utils.data.default_collate(items)
            stamp()  # the batch fetch ends
            return out

        torch.manual_seed(0)
        self.model = Model()
        self.opt = SGD(self.model.parameters(), lr=1e-5)
        data = torch.utils.data.TensorDataset(torch.randn(batch * batches, 32), torch.randn(batch * batches, 1))
        loader = torch.utils.data.DataLoader(data, batch_size=batch, sampler=Sampler(batch * batches),
                                             collate_fn=collate)
        self.plain_batches = Batches(loader)
        self.timed_batches = Batches(tm.wrap_dataloader(loader))

    def _one(self, block, *args) -> list:
        """One step of bench_overhead's `block`, its clock the stamp at its start and end."""
        marks = self.stamps
        del marks[:]
        block(self, 1, self._stamp, [], *args)
        parts = [b - a for a, b in zip(marks, marks[1:])]
        del marks[:]
        if len(parts) != len(MARKED_PARTS):
            raise RuntimeError(f"a marked step has {len(parts)} parts, not {len(MARKED_PARTS)}")
        return parts

    def plain(self) -> list:
        return self._one(block_plain)

    def manual(self) -> list:
        return self._one(block_traced, "manual", self.tm)

    def hooked(self, batches, timed_backward: bool) -> list:
        """manual_hooks (the timed loader, `timed_backward`) and auto (the plain one, patched);
        bench_overhead's block picks that loader by mode, so `batches` (which `_Turns.turn`
        passes both step kinds) is not read here."""
        return self._one(block_traced, "manual_hooks" if timed_backward else "auto", self.tm)


def load_checkout(tree: str):
    """Another checkout's training side as the package `traceml_against`, beside this one.

    Its own modules import each other relatively; what it imports absolutely
    (`traceml.schema`, ...) is this checkout's, so compare trees whose schema
    vocabulary agrees. Both are initialised in manual mode; each has its own state,
    queues and samplers.
    """
    folder = Path(tree).resolve() / package_roots(Path(tree).resolve() / "setup.py")["traceml"]
    spec = importlib.util.spec_from_file_location("traceml_against", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["traceml_against"] = module
    spec.loader.exec_module(module)
    return module


def _steps_interleaved(kind, versions: dict, modes: tuple, rounds: int, drain_every: int = 8) -> dict:
    """Per version and mode, the median added time per part and per step (paired with that
    version's plain loop in the same round), the plain loop's parts, and the samplers' work
    per traced step. Every (version, mode) turn once per round, in a seeded random order."""
    steps = {name: kind(tm) for name, tm in versions.items()}
    for tm in versions.values():  # their work is timed here, as bench_overhead charges it
        for sampler in (tm._time_sampler, tm._memory_sampler):
            if sampler is not None:
                sampler.stop()
    names = [(version, mode) for version in versions for mode in ("plain", *modes)]
    for version, mode in names:
        steps[version].turn(mode)
    for tm in versions.values():
        _drain(tm)
    order = random.Random(2)
    taken: dict = {name: [] for name in names}
    drain_ns = dict.fromkeys(versions, 0)
    traced_per_round = sum(1 if mode == "auto_first_step" else 2 for mode in modes if mode != "control")
    for index in range(rounds):
        order.shuffle(names)
        for version, mode in names:
            taken[(version, mode)].append(steps[version].turn(mode))
        if index % drain_every == drain_every - 1 or index == rounds - 1:
            for version, tm in versions.items():
                t0 = _perf_ns()
                _drain(tm)
                drain_ns[version] += _perf_ns() - t0
    med = statistics.median
    keys = [part[0] for part in kind.parts]
    out: dict = {}
    for version in versions:
        plain = taken[(version, "plain")]
        row: dict = {"sampler_us_per_traced_step": drain_ns[version] / (rounds * traced_per_round) / 1e3,
                     "plain_us": {key: med(t[i] for t in plain) / 1e3 for i, key in enumerate(keys)}}
        for mode in modes:
            pairs = list(zip(taken[(version, mode)], plain))
            row[mode] = {key: med(a[i] - b[i] for a, b in pairs) / 1e3 for i, key in enumerate(keys)}
            row[mode]["step"] = med(sum(a) - sum(b) for a, b in pairs) / 1e3
            glue = [i for i, part in enumerate(kind.parts) if len(part) < 3 or part[2]]
            row[mode]["glue"] = med(sum(a[i] - b[i] for i in glue) for a, b in pairs) / 1e3
        out[version] = row
    return out


def _drain(tm) -> None:
    for sampler in (tm._time_sampler, tm._memory_sampler):
        if sampler is not None:
            sampler.run_once()


def measure(samples: int, phase_rounds: int = 300, marked_rounds: int = 300, against: str | None = None) -> dict:
    results: dict = {"samples": samples, "cpu_count": os.cpu_count(), "torch": torch.__version__,
                     "cuda_available": torch.cuda.is_available(),
                     "load_avg_start": round(os.getloadavg()[0], 2)}
    traceml.init(mode="manual")
    if samples:
        results.update(_pieces(samples))
    versions = {"this": traceml}
    if against:
        results["against"] = against
        other = load_checkout(against)
        other.init(mode="manual")
        versions = {"against": other, "this": traceml}
    if phase_rounds:
        results["phase_rounds"] = phase_rounds
        results["phase_steps"] = _steps_interleaved(_PhaseSteps, versions, PHASE_MODES, phase_rounds)
    if marked_rounds:
        results["marked_rounds"] = marked_rounds
        results["marked_steps"] = _steps_interleaved(_MarkedSteps, versions, MARKED_MODES, marked_rounds)
    for tm in versions.values():
        tm.shutdown()
    results["load_avg_end"] = round(os.getloadavg()[0], 2)
    return results


def _pieces(samples: int) -> dict:
    """The single pieces, each after one eviction (this checkout only)."""
    med = statistics.median
    manual = _Manual()
    pieces = {name: getattr(manual, name) for name in (
        "unit", "four_regions", "trace_step", "empty_step", "forward_plain", "forward_timed",
        "forward_module_hooks", "optimizer_plain", "optimizer_hooked")}
    for piece in pieces.values():
        piece()
    found = _interleaved(pieces, samples, _close_step)
    results: dict = {}
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
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=600, help="samples per piece (default 600; 0: skip the pieces)")
    parser.add_argument("--phase-rounds", type=int, default=300,
                        help="rounds of whole steps evicted inside every phase (default 300; 0: skip)")
    parser.add_argument("--marked-rounds", type=int, default=300,
                        help="rounds of real ~10 ms steps stamped at every phase boundary (default 300; 0: skip)")
    parser.add_argument("--against", metavar="TREE",
                        help="another checkout (e.g. `git worktree add --detach /tmp/before REV`): its "
                             "training side runs beside this one, interleaved round by round, in both "
                             "step sections (the pieces above are this checkout's only)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    with table_output(args.json):
        r = measure(args.samples, args.phase_rounds, args.marked_rounds, args.against)
        _print_table(r)
    if args.json:
        print_json("bench_cold_cache", args, r)
    return 0


def _print_table(r: dict) -> None:
    print(f"TraceML instrumentation with cold caches (torch {r['torch']}, {r['cpu_count']} cores, load avg "
          f"{r['load_avg_start']} -> {r['load_avg_end']})")
    if r["samples"]:
        _print_pieces(r)
    _print_steps(r)


def _print_pieces(r: dict) -> None:
    print(f"  single pieces, 48 MB evicted before each sample, {r['samples']} samples each, medians:")
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


def _print_steps(r: dict) -> None:
    for section, label, parts, modes in (
            ("phase_steps", "whole steps evicted inside every phase", STRETCHES, PHASE_MODES),
            ("marked_steps", "real ~10 ms steps stamped at every phase boundary", MARKED_PARTS, MARKED_MODES)):
        if section not in r:
            continue
        rounds = r[section.split("_")[0] + "_rounds"]
        versions = r[section]
        print(f"  {label} ({rounds} rounds; added per stretch against the plain loop of the same round, "
              "medians; the plain loop's own in brackets):")
        for version, row in versions.items():
            if len(versions) > 1:
                print(f"    {version} checkout" + (f" ({r['against']})" if version == "against" else "") + ":")
            print(f"    {'':62s}" + "".join(f"{mode:>16s}" for mode in modes))
            for part in parts:
                key, text = part[0], part[1]
                print(f"    {text[:52]:52s} ({row['plain_us'][key]:7.1f})"
                      + "".join(f"{row[mode][key]:+16.2f}" for mode in modes))
            if section == "marked_steps":
                print(f"    {'glue parts together (median of per-round sums)':62s}"
                      + "".join(f"{row[mode]['glue']:+16.2f}" for mode in modes))
            print(f"    {'whole step (median of per-round sums)':62s}"
                  + "".join(f"{row[mode]['step']:+16.2f}" for mode in modes))
        print("    samplers, drained on this thread every 8 rounds, per traced step: "
              + ", ".join(f"{v} {versions[v]['sampler_us_per_traced_step']:.2f} us" for v in versions))


if __name__ == "__main__":
    sys.exit(main())
