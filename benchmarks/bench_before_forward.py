"""What measuring the time before forward costs an inferred step (issue 30 item 2).

An unmarked loop under auto mode gets one step per optimizer update
(`traceml.step_boundary`). When no DataLoader `next()` was timed in the step, the
timing sampler reads its input wait from stamps the step already holds: the step's
start (the previous update's end) to the first phase after it
(`step_boundary.before_forward_wait`). Nothing more runs on the training thread, so
the cost is the sampler's: resolving one published step batch (`samplers.resolve_batch`).

Method: the same inferred step's events (forward, backward, optimizer, the inferred
interval; one timed DataLoader `next()` in the "with DataLoader" variant, which is
the path before this measurement existed) resolved many times, the two variants
interleaved in rounds so that drift on a shared machine hits both alike, timed as
the thread's CPU time (what the sampler takes from the training thread under the GIL);
the figure is the median per-step time of each and their difference, with the spread of the
per-round differences (interquartile range).

    .venv/bin/python -m benchmarks.bench_before_forward [--rounds N] [--per-round K] [--json]
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.lib import checkout  # noqa: F401  (imports the checkout when not installed)
from benchmarks.lib.json_output import add_json_flag, print_json, table_output
from traceml.samplers import resolve_batch
from traceml.schema.vocabulary import RAW_BACKWARD, RAW_DATALOADER_NEXT, RAW_FORWARD, RAW_OPTIMIZER_STEP
from traceml.step_boundary import INFERRED_STEP
from traceml.step_events import StepTimeBatch


def _events(with_dataloader: bool) -> list:
    """One ~10 ms inferred step's events (ns stamps), as the training thread records them."""
    t = 1_000_000_000
    events = []
    if with_dataloader:
        events.append((RAW_DATALOADER_NEXT, t + 10_000, t + 2_000_000, None, None))
    events += [
        (RAW_FORWARD, t + 2_100_000, t + 5_000_000, None, None),
        (RAW_BACKWARD, t + 5_100_000, t + 9_000_000, None, None),
        (RAW_OPTIMIZER_STEP, t + 9_100_000, t + 9_900_000, None, None),
        (INFERRED_STEP, t, t + 10_000_000, None, None),
    ]
    return events


def _time(with_dataloader: bool, count: int) -> float:
    """CPU seconds of this thread per resolve of `count` fresh batches of one variant."""
    batches = [StepTimeBatch(i, _events(with_dataloader)) for i in range(count)]
    start = time.thread_time()  # the sampler thread's CPU (it holds the GIL), not a descheduled wait
    for batch in batches:
        resolve_batch(batch, 0)
    return (time.thread_time() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--per-round", type=int, default=500)
    add_json_flag(parser)
    args = parser.parse_args()
    before_forward, dataloader, diffs = [], [], []
    for i in range(args.rounds):
        pair = (_time(True, args.per_round), _time(False, args.per_round)) if i % 2 else \
            tuple(reversed((_time(False, args.per_round), _time(True, args.per_round))))
        dataloader.append(pair[0])
        before_forward.append(pair[1])
        diffs.append(pair[1] - pair[0])
    q = statistics.quantiles(diffs, n=4)
    us = 1e6
    figures = {"dataloader_us": statistics.median(dataloader) * us,
               "before_forward_us": statistics.median(before_forward) * us,
               "added_us": statistics.median(diffs) * us, "added_q1_us": q[0] * us, "added_q3_us": q[2] * us}
    with table_output(args.json):
        print(f"resolve one inferred step, with a DataLoader next(): {figures['dataloader_us']:.2f} us")
        print(f"resolve one inferred step, input wait measured before forward: {figures['before_forward_us']:.2f} us")
        print(f"added per step: {figures['added_us']:+.2f} us (IQR {figures['added_q1_us']:+.2f} .. "
              f"{figures['added_q3_us']:+.2f})")
    if args.json:
        print_json("bench_before_forward", args, figures)

if __name__ == "__main__":
    main()
