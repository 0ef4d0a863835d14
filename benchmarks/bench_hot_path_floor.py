"""What any Python `with`-based instrumentation costs inside a real ~10 ms CPU step: the floor.

Issue 23 asked for a throughput ratio of at least 0.995 on bench_overhead's ~10 ms CPU
step (about 50 us per step, the samplers' work included). This benchmark asks how
much of what TraceML costs there is its own design and how much any implementation
of the same API pays. It runs bench_cold_cache's stamped ~10 ms step (the same
model, loader and optimizer as bench_overhead; every boundary of the step's own work
stamped, so the glue between two stamps is the loop's statements plus the
instrumentation, as cold as the real step leaves it) in manual mode under three
implementations of the manual API, interleaved round by round with the plain loop:

- `bare`: each region two `perf_counter_ns()` reads and one list append, the step's
  list moved into a deque at its end; no checks of any kind. Nothing simpler can
  still time five regions and a step with `with` blocks.
- `core`: the contract's core on top of that: only the training thread records
  (thread check), events go to the capture that was active when the region opened
  and a region spanning a step boundary is discarded, regions keep a state (entered
  twice, exited without entry), steps are numbered and published into two bounded
  queues that count what they drop (timing, and the step's memory reading). No
  holds, no GPU policy, no model/device cache, no join of the job's OpenTelemetry
  span, no warnings.
- `traceml`: this checkout, with its samplers' work per traced step (drained on this
  thread, as bench_overhead charges it).

Per implementation: the glue added per step against the plain loop of the same round
(median of per-round sums), per stretch, and the throughput ratio it implies,
plain step / (plain step + glue + sampler work).

    .venv/bin/python -m benchmarks.bench_hot_path_floor [--rounds N] [--json]
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import threading
import time
import types

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from benchmarks import traceml_checkout  # noqa: E402,F401  (imports the checkout when not installed)
from benchmarks.bench_cold_cache import MARKED_PARTS, _MarkedSteps, _steps_interleaved  # noqa: E402
from benchmarks.json_output import add_json_flag, print_json, table_output  # noqa: E402
import traceml  # noqa: E402
from traceml.schema import vocabulary as v  # noqa: E402
from traceml.step_events import MAX_EVENTS_PER_CAPTURE, QUEUE_CAPACITY  # noqa: E402  (the core keeps what ours keeps)

torch.set_num_threads(1)

_perf_ns = time.perf_counter_ns
_get_ident = threading.get_ident
REGIONS = (("timed_h2d", v.RAW_H2D), ("timed_forward", v.RAW_FORWARD),
           ("timed_backward", v.RAW_BACKWARD), ("timed_optimizer_step", v.RAW_OPTIMIZER_STEP))


class _Clearer:
    """Stands in for a sampler: the benchmark drains (here: empties) the queues between rounds."""

    def __init__(self, *queues) -> None:
        self._queues = queues

    def run_once(self) -> int:
        for queue in self._queues:
            queue.clear()
        return 0

    def stop(self) -> None:
        self.run_once()


class _Iterator:
    """A loader's iterator; each reference implementation's subclass times its `__next__`."""

    __slots__ = ("_next",)

    def __init__(self, it) -> None:
        self._next = it.__next__

    def __iter__(self):
        return self


class _Loader:
    """`wrap_dataloader(iterable)` of a reference implementation: its iterators time each batch."""

    def __init__(self, iterable, iterator: type) -> None:
        self._iterable = iterable
        self._iterator = iterator

    def __iter__(self):
        return self._iterator(iter(self._iterable))


def bare_api() -> types.SimpleNamespace:
    """Two clock reads and one append per region; the step's list moved into a deque."""
    state = types.SimpleNamespace(events=[])
    published: collections.deque = collections.deque()

    def region(raw_event: str) -> type:
        class Region:
            __slots__ = ("_t0",)
            name = raw_event

            def __enter__(self):
                self._t0 = _perf_ns()
                return self

            def __exit__(self, *exc):
                state.events.append((self.name, self._t0, _perf_ns()))
                return False
        return Region

    class trace_step:
        __slots__ = ("_model", "_t0")

        def __init__(self, model=None) -> None:
            self._model = model

        def __enter__(self):
            self._t0 = _perf_ns()
            return self

        def __exit__(self, *exc):
            events = state.events
            events.append((v.RAW_STEP_TIME, self._t0, _perf_ns()))
            published.append(events)
            state.events = []
            return False

    class Iterator(_Iterator):
        __slots__ = ()

        def __next__(self):
            t0 = _perf_ns()
            item = self._next()
            state.events.append((v.RAW_DATALOADER_NEXT, t0, _perf_ns()))
            return item

    api = types.SimpleNamespace(trace_step=trace_step, wrap_dataloader=functools.partial(_Loader, iterator=Iterator),
                                _time_sampler=_Clearer(published), _memory_sampler=None)
    for attr, raw_event in REGIONS:
        setattr(api, attr, region(raw_event))
    return api


class _Capture:
    __slots__ = ("events", "detached")


class _Queue:
    """Bounded, drop-new-when-full, counting what it drops."""

    __slots__ = ("items", "dropped")

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self.dropped = 0

    def clear(self) -> None:
        self.items.clear()


def core_api() -> types.SimpleNamespace:
    """`bare` plus the contract's core: thread ownership, the capture lifecycle, region
    state, step numbers and two bounded, counting queues."""
    rec = types.SimpleNamespace(owner=_get_ident(), active=None, next_step=0)
    timing, memory = _Queue(), _Queue()

    def current_capture() -> _Capture:
        capture = rec.active
        if capture is None:
            capture = object.__new__(_Capture)
            capture.events = []
            capture.detached = False
            rec.active = capture
        return capture

    def record(capture, event) -> None:
        if capture is rec.active and len(capture.events) < MAX_EVENTS_PER_CAPTURE:
            capture.events.append(event)

    def region(raw_event: str) -> type:
        class Region:
            __slots__ = ("_t0", "_capture", "_state")
            name = raw_event

            def __init__(self) -> None:
                self._state = 0

            def __enter__(self):
                if self._state == 0 and _get_ident() == rec.owner:
                    self._capture = current_capture()
                    self._state = 1
                    self._t0 = _perf_ns()
                return self

            def __exit__(self, *exc):
                t1 = _perf_ns()
                if self._state == 1:
                    self._state = 2
                    record(self._capture, (self.name, self._t0, t1, None, None))
                return False
        return Region

    def publish(queue: _Queue, item) -> None:
        items = queue.items
        if len(items) < QUEUE_CAPACITY:
            items.append(item)
        else:
            queue.dropped += 1

    class trace_step:
        __slots__ = ("_model", "_t0", "_capture")

        def __init__(self, model=None) -> None:
            self._model = model

        def __enter__(self):
            self._capture = current_capture() if _get_ident() == rec.owner else None
            self._t0 = _perf_ns()
            return self

        def __exit__(self, *exc):
            t1 = _perf_ns()
            capture = self._capture
            if capture is None or capture is not rec.active:
                return False
            rec.active = None
            capture.detached = True
            capture.events.append((v.RAW_STEP_TIME, self._t0, t1, None, None))
            step = rec.next_step
            rec.next_step = step + 1
            publish(timing, (step, capture.events))
            publish(memory, (step, "cpu", t1))
            return False

    class Iterator(_Iterator):
        __slots__ = ()

        def __next__(self):
            if _get_ident() != rec.owner:
                return self._next()
            capture = current_capture()
            t0 = _perf_ns()
            item = self._next()
            record(capture, (v.RAW_DATALOADER_NEXT, t0, _perf_ns(), None, None))
            return item

    api = types.SimpleNamespace(trace_step=trace_step, wrap_dataloader=functools.partial(_Loader, iterator=Iterator),
                                _time_sampler=_Clearer(timing, memory), _memory_sampler=None)
    for attr, raw_event in REGIONS:
        setattr(api, attr, region(raw_event))
    return api


IMPLEMENTATIONS = ("bare", "core", "traceml")
GLUE_PARTS = [part[0] for part in MARKED_PARTS if part[2]]


def measure(rounds: int) -> dict:
    results: dict = {"cpu_count": os.cpu_count(), "torch": torch.__version__, "rounds": rounds,
                     "load_avg_start": round(os.getloadavg()[0], 2)}
    traceml.init(mode="manual")
    try:
        found = _steps_interleaved(_MarkedSteps, {"bare": bare_api(), "core": core_api(), "traceml": traceml},
                                   ("manual",), rounds)
    finally:
        traceml.shutdown()
    for name in IMPLEMENTATIONS:
        row = found[name]
        plain_us = sum(row["plain_us"].values())
        sampler_us = row["sampler_us_per_traced_step"] if name == "traceml" else 0.0
        glue_us = row["manual"]["glue"]
        results[f"{name}_plain_step_us"] = plain_us
        results[f"{name}_glue_us"] = glue_us
        results[f"{name}_glue_parts_us"] = {part: row["manual"][part] for part in GLUE_PARTS}
        results[f"{name}_sampler_us"] = sampler_us
        results[f"{name}_implied_ratio"] = plain_us / (plain_us + glue_us + sampler_us)
    results["load_avg_end"] = round(os.getloadavg()[0], 2)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1500,
                        help="rounds, one stamped step per implementation and its plain loop each (default 1500)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    with table_output(args.json):
        r = measure(args.rounds)
        _print_table(r)
    if args.json:
        print_json("bench_hot_path_floor", args, r)
    return 0


def _print_table(r: dict) -> None:
    labels = dict((part[0], part[1].split(":")[0]) for part in MARKED_PARTS)
    print(f"Glue added per real ~10 ms CPU step, manual mode (torch {r['torch']}, {r['cpu_count']} cores, "
          f"load avg {r['load_avg_start']} -> {r['load_avg_end']}, {r['rounds']} rounds; medians of per-round "
          "pairs with the plain loop)")
    print(f"  {'stretch':58s}" + "".join(f"{name:>10s}" for name in IMPLEMENTATIONS))
    for part in GLUE_PARTS:
        print(f"  {labels[part]:58s}" + "".join(f"{r[f'{name}_glue_parts_us'][part]:+10.2f}"
                                                for name in IMPLEMENTATIONS))
    print(f"  {'glue per step (median of per-round sums)':58s}"
          + "".join(f"{r[f'{name}_glue_us']:+10.2f}" for name in IMPLEMENTATIONS))
    print(f"  {'samplers per traced step (ours only)':58s}"
          + "".join(f"{r[f'{name}_sampler_us']:10.2f}" for name in IMPLEMENTATIONS))
    print(f"  {'plain step (us)':58s}" + "".join(f"{r[f'{name}_plain_step_us']:10.0f}" for name in IMPLEMENTATIONS))
    print(f"  {'implied throughput ratio':58s}"
          + "".join(f"{r[f'{name}_implied_ratio']:10.4f}" for name in IMPLEMENTATIONS))


if __name__ == "__main__":
    sys.exit(main())
