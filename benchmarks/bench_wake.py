"""What the training thread pays for waking a parked sampler (issue 37).

    .venv/bin/python -m benchmarks.bench_wake [--rounds 400] [--json]

The step samplers park when a drain finds nothing, and the next step published wakes
them: `complete_step_capture` then calls the queue's wake-up (one `Event.set` on a
waiting thread). Every other step pays what it always paid, the queue's one size
comparison. This times, on the training thread's CPU clock, `complete_step_capture`
of a one-region step in alternating rounds: (a) with no sampler parked (the wake-up
is not called: every step of a job stepping faster than the samplers' interval), and
(b) with the timing and memory samplers parked (the first step after a pause, or every
step of a job whose steps are longer than the interval). Medians with their interquartile
ranges over the rounds.
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.lib.json_output import add_json_flag, print_json, table_output


def measure(rounds: int) -> dict:
    import traceml
    from traceml import step_events
    from traceml.samplers import StepMemorySampler, StepTimeSampler

    class Sink:
        def on_step_time(self, record) -> None:
            pass

        def on_step_memory(self, record) -> None:
            pass

    step_events.set_recording(True)
    step_events.claim_recording_thread()
    samplers = [StepTimeSampler(sinks=(Sink(),)), StepMemorySampler(sinks=(Sink(),))]
    region = traceml.timed_region
    clock = time.thread_time_ns

    def one_step() -> int:
        with region("_traceml_internal:step_time", device="cpu"):
            pass
        step_events.current_capture().record(step_events.MemoryReading("cpu", None, None, time.perf_counter_ns()))
        t0 = clock()
        step_events.complete_step_capture()
        return clock() - t0

    for s in samplers:
        s.interval_s = 0.02  # park soon after each round's steps (the interval does not enter the step)
        s.start()
    awake, parked = [], []
    try:
        for _ in range(rounds):
            # Parked again since the previous round's steps: a drain found nothing after them.
            seen = [s.parks for s in samplers]
            deadline = time.monotonic() + 5
            while (not all(s.parked and s.parks > n for s, n in zip(samplers, seen))
                   and time.monotonic() < deadline):
                time.sleep(0.002)
            parked.append(one_step())  # wakes both
            awake.append(one_step())  # the samplers are awake (or about to drain): no wake-up call
            awake.append(one_step())
    finally:
        for s in samplers:
            s.stop()
        step_events.set_recording(False)

    def summary(ns: list) -> dict:
        q = statistics.quantiles(ns, n=4)
        return {"median_us": statistics.median(ns) / 1e3, "q1_us": q[0] / 1e3, "q3_us": q[2] / 1e3, "n": len(ns)}
    return {"no_wake": summary(awake), "wakes_parked_samplers": summary(parked)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400)
    add_json_flag(parser)
    args = parser.parse_args()
    with table_output(args.json):
        figures = measure(args.rounds)
        for name, label in (("no_wake", "no sampler parked (the size comparison only)"),
                            ("wakes_parked_samplers", "both samplers parked (two Event.set)")):
            f = figures[name]
            print(f"complete_step_capture, training-thread CPU, {label}: median {f['median_us']:.1f} us "
                  f"(IQR {f['q1_us']:.1f}-{f['q3_us']:.1f}, {f['n']} steps)")
        delta = figures["wakes_parked_samplers"]["median_us"] - figures["no_wake"]["median_us"]
        figures["wake_added_us"] = delta
        print(f"added by waking the parked samplers: {delta:+.1f} us, once per pause")
    if args.json:
        print_json("bench_wake", args, figures)


if __name__ == "__main__":
    main()
