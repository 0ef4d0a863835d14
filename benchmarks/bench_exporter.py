"""Exporter cost and capacity, each figure against a baseline measured in the same run.

    .venv/bin/python -m benchmarks.bench_exporter [--quick] [--capacity-only] [--json]

1. Background CPU per exported step: CPU time of the exporter's own thread (from
   /proc/self/task/<tid>/schedstat) divided by the steps it exported, with a real
   OTLP receiver in a separate process (so its decoding is not counted). A step is
   one `traceml.step` span (with its peak memory) + 6 phase children, encoded and sent.
   Also: encoding alone on the calling thread.
2. Training-thread cost: a small CPU training loop with the real instrumentation,
   without an endpoint and with the exporter live, in the same process (median
   wall time and training-thread CPU per step), plus an uninstrumented loop, and the
   live exporter again inside a span of the job's own OpenTelemetry SDK (each step
   then reads the job's current span context: the added cost of joining its trace).
3. Capacity: records fed like the samplers feed them (a burst every 100 ms) at a
   fixed steps/s for a few seconds with default settings; drops counted per rate.
   Every fed step has its own step number and memory snapshot, as a job's do: the
   exporter joins the two by step number, so a step number fed twice would count its
   second snapshot as dropped (its step span has left) and leave its second step
   without one. `--capacity-only` runs this section alone (no torch).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.lib.json_output import add_json_flag, print_json, table_output
from benchmarks.lib.receiver_process import ReceiverProcess
from harness.exporter_records import identity, memory_record, step_record
from traceml.exporter import OtlpStepExporter, resolve_settings
from traceml.exporter.encoding import OtlpEncoder


def thread_cpu_ns(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[0])


def background_cpu(receiver: ReceiverProcess, protocol: str, steps: int, phase_spans: bool = True) -> float:
    endpoint = receiver.grpc if protocol == "grpc" else receiver.http
    settings = resolve_settings(endpoint, protocol, phase_spans=phase_spans, environ={})
    exporter = OtlpStepExporter(identity("bench-cpu"), settings, instrumentation_drops=lambda: {})
    records = [(step_record(s), memory_record(s)) for s in range(steps)]
    worker = exporter._thread.native_id
    before = thread_cpu_ns(worker)
    for rec, mem in records:
        exporter.on_step_time(rec)
        exporter.on_step_memory(mem)
    assert exporter.force_flush(120.0)
    used = thread_cpu_ns(worker) - before
    stats = exporter.stats()
    exporter.shutdown(10.0)
    assert stats.steps_exported == steps and stats.memory_exported == steps, stats
    return used / steps / 1e3


def encode_only(steps: int) -> float:
    settings = resolve_settings("http://127.0.0.1:1", "grpc", environ={})
    enc = OtlpEncoder(identity("bench-enc"), settings)
    records = [(step_record(s), memory_record(s)) for s in range(steps)]
    t0 = time.thread_time_ns()
    for i in range(0, steps, 512):
        chunk = records[i:i + 512]
        spans: list[bytes] = []  # as the exporter encodes: the spans written as bytes
        for rec, mem in chunk:
            enc.encode_step_spans(spans, rec, mem)
        enc.trace_request_bytes(spans)
    return (time.thread_time_ns() - t0) / steps / 1e3


def training_loop(steps: int, traced: bool) -> tuple[float, float]:
    """(median wall us per step, training-thread CPU us per step)."""
    import torch
    from harness.tiny_training import plain_step, traced_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(32, 128), torch.randn(32, 1)) for _ in range(16)]
    step = traced_step if traced else plain_step
    walls = []
    cpu0 = time.thread_time_ns()
    for i in range(steps):
        t0 = time.perf_counter_ns()
        x, y = data[i % len(data)]
        step(model, opt, x, y)
        walls.append(time.perf_counter_ns() - t0)
    return statistics.median(walls) / 1e3, (time.thread_time_ns() - cpu0) / steps / 1e3


def training_thread_cost(receiver: ReceiverProcess, steps: int) -> dict:
    import torch

    import traceml
    torch.set_num_threads(1)
    out = {}
    training_loop(200, traced=False)  # warm-up
    out["uninstrumented"] = training_loop(steps, traced=False)
    os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    traceml.init("manual")
    out["instrumented, no exporter"] = training_loop(steps, traced=True)
    traceml.shutdown()
    traceml.init("manual", endpoint=receiver.grpc, protocol="grpc", run_id="bench-train")
    sink = traceml._exporter_sink
    out["instrumented, exporter live (gRPC)"] = training_loop(steps, traced=True)
    traceml.shutdown()
    out["_exported"] = sink.stats().steps_exported if sink is not None else 0
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("bench-job")
    traceml.init("manual", endpoint=receiver.grpc, protocol="grpc", run_id="bench-train-otel")
    with tracer.start_as_current_span("train_epoch"):
        out["instrumented, exporter live, job's span active"] = training_loop(steps, traced=True)
    traceml.shutdown()
    return out


def empty_step_cost(steps: int) -> dict:
    """CPU us per empty `trace_step` (no exporter): the job without OpenTelemetry, with it
    imported but no span current, and with its span current (the context read at step begin)."""
    import sys

    import traceml
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("bench-job")
    os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    traceml.init("manual")

    def run() -> float:
        for _ in range(500):  # warm-up
            with traceml.trace_step():
                pass
        best = None
        for _ in range(5):
            t0 = time.thread_time_ns()
            for _ in range(steps):
                with traceml.trace_step():
                    pass
            used = (time.thread_time_ns() - t0) / steps / 1e3
            best = used if best is None else min(best, used)
        return best

    out = {}
    otel = sys.modules.pop("opentelemetry.trace")
    try:
        out["job without OpenTelemetry"] = run()
    finally:
        sys.modules["opentelemetry.trace"] = otel
    out["OpenTelemetry imported, no span current"] = run()
    with tracer.start_as_current_span("train_epoch"):
        out["job's span current"] = run()
    traceml.shutdown()
    return out


def capacity(receiver: ReceiverProcess, rate: int, seconds: float) -> tuple[int, int, int, int, int]:
    """Feed `rate` steps/s in 100 ms bursts for `seconds`;
    (fed, dropped steps, dropped memory, exported steps, exported memory snapshots)."""
    settings = resolve_settings(receiver.grpc, "grpc", environ={})
    exporter = OtlpStepExporter(identity(f"bench-rate-{rate}"), settings, instrumentation_drops=lambda: {})
    burst = max(1, int(rate * 0.1))
    templates = [step_record(s) for s in range(burst)]
    fed = 0
    start = time.monotonic()
    tick = 0
    while time.monotonic() - start < seconds:
        # New step numbers each burst (the templates renumbered: about 1 us a step on this thread).
        for i, template in enumerate(templates):
            step = fed + i
            exporter.on_step_time(template._replace(step=step))
            exporter.on_step_memory(memory_record(step))
        fed += burst
        tick += 1
        delay = start + tick * 0.1 - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    exporter.shutdown(30.0)
    stats = exporter.stats()
    assert stats.steps_received + stats.dropped["spans"] == fed, (fed, stats)
    return fed, stats.dropped["spans"], stats.dropped["metrics"], stats.steps_exported, stats.memory_exported


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rates")
    parser.add_argument("--capacity-only", action="store_true", help="only the capacity section (no torch)")
    add_json_flag(parser)
    args = parser.parse_args()
    with table_output(args.json):
        figures = measure(args.quick, args.capacity_only)
    if args.json:
        print_json("bench_exporter", args, figures)


def measure(quick: bool, capacity_only: bool = False) -> dict:
    figures: dict = {"cpu_count": os.cpu_count()}
    print(f"cores: {os.cpu_count()} (shared; figures measured under contention from other work)")
    receiver = ReceiverProcess()
    try:
        if not capacity_only:
            cost_sections(receiver, quick, figures)
        capacity_section(receiver, quick, figures)
        print(f"receiver totals: spans, points = {receiver.counts()}")
    finally:
        receiver.close()
    return figures


def cost_sections(receiver: ReceiverProcess, quick: bool, figures: dict) -> None:
    n = 2000 if quick else 6000
    print("\n## Background CPU per exported step (1 step span with its peak memory + 6 phase children)")
    figures["encode_only_us_per_step"] = encode = encode_only(n)
    print(f"encode only (calling thread):          {encode:7.1f} us/step")
    for protocol in ("grpc", "http/protobuf"):
        background_cpu(receiver, protocol, 300)  # warm-up (channel, caches)
        cpu = background_cpu(receiver, protocol, n)
        figures[f"exporter_thread_{protocol.replace('/', '_')}_us_per_step"] = cpu
        print(f"exporter thread, {protocol:<14} phases on : {cpu:7.1f} us/step")
    cpu = background_cpu(receiver, 'grpc', n, False)
    figures["exporter_thread_grpc_phases_off_us_per_step"] = cpu
    print(f"exporter thread, grpc           phases off: {cpu:7.1f} us/step")

    print("\n## Training-thread cost (same process, same run)")
    cost = training_thread_cost(receiver, 1000 if quick else 3000)
    exported = cost.pop("_exported")
    base_wall, base_cpu = cost["instrumented, no exporter"]
    figures["training_thread"] = [{"variant": name, "wall_us_per_step": wall, "cpu_us_per_step": cpu}
                                  for name, (wall, cpu) in cost.items()]
    figures["training_steps_exported"] = exported
    live_wall, live_cpu = cost["instrumented, exporter live (gRPC)"]
    otel_wall, otel_cpu = cost["instrumented, exporter live, job's span active"]
    figures["job_span_added_wall_us_per_step"] = otel_wall - live_wall
    figures["job_span_added_cpu_us_per_step"] = otel_cpu - live_cpu
    for name, (wall, cpu) in cost.items():
        print(f"{name:<38} median {wall:8.1f} us/step  thread CPU {cpu:8.1f} us/step  "
              f"(x{wall / base_wall:.3f} wall, x{cpu / base_cpu:.3f} CPU vs no exporter)")
    print(f"(steps exported during the live run: {exported})")
    print(f"added by the job's span (read at each step begin): {otel_wall - live_wall:+.1f} us/step wall, "
          f"{otel_cpu - live_cpu:+.1f} us/step training-thread CPU")

    print("\n## Step begin beside the job's own OpenTelemetry (empty trace_step, best of 5, CPU)")
    begin = empty_step_cost(5000 if quick else 20000)
    figures["empty_step_cpu_us"] = begin
    base = begin["job without OpenTelemetry"]
    for name, cpu in begin.items():
        print(f"{name:<42} {cpu:6.2f} us/step ({cpu - base:+.2f} us)")


def capacity_section(receiver: ReceiverProcess, quick: bool, figures: dict) -> None:
    print("\n## Capacity with default settings (queue 8192, batch 512), 100 ms bursts")
    rates = [200, 1000, 4000, 8000] if quick else [200, 500, 1000, 2000, 4000, 6000, 8000, 16000, 32000]
    seconds = 3.0 if quick else 5.0
    first_drop = None
    figures["capacity"] = []
    for rate in rates:
        fed, dropped, dropped_memory, exported, memory = capacity(receiver, rate, seconds)
        figures["capacity"].append({"steps_per_s": rate, "seconds": seconds, "fed": fed, "dropped": dropped,
                                    "dropped_memory": dropped_memory, "exported": exported,
                                    "memory_exported": memory})
        print(f"{rate:6d} steps/s for {seconds:.0f} s: fed {fed:6d} steps, dropped {dropped:6d} steps "
              f"+ {dropped_memory:6d} memory snapshots, exported {exported:6d} steps "
              f"with {memory:6d} snapshots")
        if (dropped or dropped_memory) and first_drop is None:
            first_drop = rate
    figures["first_drop_steps_per_s"] = first_drop
    print(f"drops begin at: {first_drop or f'> {rates[-1]}'} steps/s (sustained {seconds:.0f} s)")


if __name__ == "__main__":
    main()
