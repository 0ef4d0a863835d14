"""Where the training process's background CPU per step goes (issue 37), on CPU clocks.

    .venv/bin/python -m benchmarks.bench_background [--steps 4000] [--rounds 3] [--protocol P] [--phase-spans on|off|both] [--json]
    .venv/bin/python -m benchmarks.in_tree /tmp/before benchmarks.bench_background   # an older tree
        (copy this file into that tree first; it uses only what older trees have)

The steps are real: each publishes five timed CPU regions (input wait, H2D, forward,
backward, optimizer step) inside the traced step and a memory reading, through the
instrumentation's own queues, as a manual loop at about 40 steps/s does. Then, per
step and on each part's own thread clock:

1. the samplers: `StepTimeSampler.run_once` and `StepMemorySampler.run_once` every 20
   steps (one 0.5 s interval of 40 steps/s): drain, resolve and sum each batch into a
   record, hand it to the exporter's queue (on the calling thread here);
2. the exporter thread, one export every 40 steps (one 1 s export interval) through
   `force_flush` to a real OTLP receiver in another process, over `--protocol` (grpc,
   http/protobuf, or both, one after the other): encode, send and wait for the answer
   (its thread's CPU from /proc/self/task/<tid>/schedstat);
3. the transport's own threads in this process over the same time (gRPC's; none for
   OTLP/HTTP): the process's CPU less the calling thread's and the exporter thread's;
4. encoding alone, the same records written into requests of 40 steps on the calling
   thread (the step span, its peak memory, and its phase children).

Figures are medians over `--rounds` runs of `--steps` steps, each round in a fresh
exporter; CPU clocks, so other load on the machine inflates them less than wall time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.lib.json_output import add_json_flag, print_json, table_output

STEPS_PER_DRAIN = 20  # one 0.5 s sampler interval at 40 steps/s
STEPS_PER_EXPORT = 40  # one 1 s export interval at 40 steps/s
REGIONS = ("_traceml_internal:dataloader_next", "_traceml_internal:h2d", "_traceml_internal:forward",
           "_traceml_internal:backward", "_traceml_internal:optimizer_step")


def _thread_cpu_ns(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[0])


def _process_cpu_ns() -> int:
    t = os.times()
    return int((t.user + t.system) * 1e9)


def _publish(steps: int) -> None:
    import traceml
    from traceml import step_events

    region = traceml.timed_region
    for _ in range(steps):
        with region("_traceml_internal:step_time", device="cpu"):
            for name in REGIONS:
                with region(name, device="cpu"):
                    pass
        step_events.current_capture().record(step_events.MemoryReading("cpu", None, None, time.perf_counter_ns()))
        step_events.complete_step_capture()


class _Keep:
    """A second sink that keeps the records, for the encode-alone part."""

    def __init__(self):
        self.steps, self.memory = [], []

    def on_step_time(self, record) -> None:
        self.steps.append(record)

    def on_step_memory(self, record) -> None:
        self.memory.append(record)


def _encode_alone(encoder, records: list) -> float:
    """us per step: `records` written into requests of STEPS_PER_EXPORT steps, serialised."""
    started = time.thread_time_ns()
    for i in range(0, len(records), STEPS_PER_EXPORT):
        chunk = records[i:i + STEPS_PER_EXPORT]
        if hasattr(encoder, "encode_step_spans"):
            spans: list = []
            for record in chunk:
                encoder.encode_step_spans(spans, record, None)
            encoder.trace_request_bytes(spans)
        else:  # an older tree: messages, then their bytes
            request, spans = encoder.new_trace_request()
            for record in chunk:
                encoder.add_step_spans(spans, record, None)
            request.SerializeToString()
    return (time.thread_time_ns() - started) / max(1, len(records)) / 1e3


def one_round(endpoint: str, protocol: str, steps: int, phase_spans: bool = True) -> dict:
    from harness.exporter_records import identity
    from traceml import step_events
    from traceml.exporter import OtlpStepExporter, resolve_settings
    from traceml.exporter.encoding import OtlpEncoder
    from traceml.samplers import StepMemorySampler, StepTimeSampler

    settings = resolve_settings(endpoint, protocol, phase_spans=phase_spans, environ={})
    exporter = OtlpStepExporter(identity("bench-background"), settings, instrumentation_drops=lambda: {})
    keep = _Keep()
    timing, memory = StepTimeSampler(sinks=(exporter, keep)), StepMemorySampler(sinks=(exporter, keep))
    worker = exporter._thread.native_id
    assert exporter.force_flush(30.0)  # connected, first counters out: the rounds below are steady state
    step_events.set_recording(True)
    step_events.claim_recording_thread()
    sampler_ns = 0
    try:
        exporter_before, process_before, main_before = _thread_cpu_ns(worker), _process_cpu_ns(), time.thread_time_ns()
        main_other = 0  # the calling thread's time outside the samplers (publishing steps, waiting)
        for done in range(0, steps, STEPS_PER_DRAIN):
            t0 = time.thread_time_ns()
            _publish(STEPS_PER_DRAIN)
            t1 = time.thread_time_ns()
            timing.run_once()
            memory.run_once()
            t2 = time.thread_time_ns()
            sampler_ns += t2 - t1
            main_other += t1 - t0
            if (done + STEPS_PER_DRAIN) % STEPS_PER_EXPORT == 0:
                t3 = time.thread_time_ns()
                assert exporter.force_flush(30.0)
                main_other += time.thread_time_ns() - t3
        exporter_ns = _thread_cpu_ns(worker) - exporter_before
        process_ns = _process_cpu_ns() - process_before
        main_ns = time.thread_time_ns() - main_before
        stats = exporter.stats()
    finally:
        step_events.set_recording(False)
        exporter.shutdown(10.0)
    assert stats.steps_exported == steps == len(keep.steps), (stats, len(keep.steps))
    encode_us = _encode_alone(OtlpEncoder(identity("bench-encode"), settings), keep.steps)
    per = 1e3 * steps
    return {"samplers_us": sampler_ns / per, "exporter_thread_us": exporter_ns / per,
            "grpc_threads_us": max(0, process_ns - main_ns - exporter_ns) / per, "encode_alone_us": encode_us,
            "spans_per_step": stats.spans_exported / steps}


def measure(steps: int, rounds: int, protocol: str = "grpc", phase_spans: bool = True) -> dict:
    from benchmarks.lib.receiver_process import ReceiverProcess

    receiver = ReceiverProcess()
    endpoint = receiver.grpc if protocol == "grpc" else receiver.http
    try:
        results = [one_round(endpoint, protocol, steps, phase_spans) for _ in range(rounds)]
    finally:
        receiver.close()
    figures = {key: statistics.median(r[key] for r in results) for key in results[0]}
    figures["rounds"] = [{k: round(x, 2) for k, x in r.items()} for r in results]
    figures["total_us"] = figures["samplers_us"] + figures["exporter_thread_us"] + figures["grpc_threads_us"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--protocol", choices=("grpc", "http/protobuf", "both"), default="grpc",
                        help="the exporter's transport (both: one after the other, in one run)")
    parser.add_argument("--phase-spans", choices=("on", "off", "both"), default="on",
                        help="the step's phase child spans (off: as `traceml run` sends to its own processor)")
    add_json_flag(parser)
    args = parser.parse_args()
    with table_output(args.json):
        print(f"bench_background: {args.rounds} rounds of {args.steps} steps; load average "
              f"{os.getloadavg()[0]:.1f}")
        protocols = ("grpc", "http/protobuf") if args.protocol == "both" else (args.protocol,)
        phases = ("on", "off") if args.phase_spans == "both" else (args.phase_spans,)
        figures = {}
        for protocol, phase in ((p, ph) for p in protocols for ph in phases):
            label = f"{protocol}, phase spans {phase}"
            f = figures[label] = measure(args.steps, args.rounds, protocol, phase == "on")
            print(f"{label}: per step, CPU: samplers (drain, resolve, hand over) {f['samplers_us']:.1f} us; "
                  f"exporter thread (encode, send, answer) {f['exporter_thread_us']:.1f} us; the transport's "
                  f"threads {f['grpc_threads_us']:.1f} us; total {f['total_us']:.1f} us "
                  f"({f['spans_per_step']:.0f} spans per step)")
            print(f"{label}: encoding alone (requests of {STEPS_PER_EXPORT} steps, serialised): "
                  f"{f['encode_alone_us']:.1f} us per step")
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        print_json("bench_background", args, figures if len(figures) > 1 else next(iter(figures.values())))


if __name__ == "__main__":
    main()
