"""Ingest of a mapped stream (Megatron-LM's spans) beside TraceML's own, against a real processor.

    .venv/bin/python -m benchmarks.bench_ingest_mapped            # 2 rounds x 6 s each, alternating
    .venv/bin/python -m benchmarks.bench_ingest_mapped --json

The processor is the real CLI in its own process (`benchmarks.lib.ingest_load.Processor`); senders are
threads sending pre-serialised OTLP/gRPC requests (`ingest_load.sustained`), so client-side
encoding does not count. Each request holds `--batch` consecutive steps of one rank:

- **ours**: one `traceml.step` span per step (the span alone is the row);
- **megatron**: the nine spans Megatron-LM sends per step with `--otel-span-groups all`
  (iteration, forward-backward, 2 microbatch forwards, 2 backwards, grad sync start and
  finish, optimizer), children before their step span as its SDK exports them, every one
  read by the mapping layer (`processor/mapping`) into the same one row.

Reported per stream: stored rows (steps) per second and spans per second, wall and per
processor CPU-second; the rows in SQLite must equal the steps acknowledged. The two
streams alternate in the same run, so machine load hits both alike.
"""
from __future__ import annotations

import argparse
import os
import struct
import tempfile
import time
from pathlib import Path

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2 as span_data

from benchmarks.lib.ingest_load import Processor, build_requests, grpc_sender, sustained
from benchmarks.lib.json_output import add_json_flag, print_json, table_output
from harness.otlp_payloads import kv

MEGATRON_SPANS_PER_STEP = 9
MS = 1_000_000


def megatron_requests(run_id: str, ranks: int, batch: int, total_steps: int, world: int = 1000) -> list[bytes]:
    """Pre-serialised requests of Megatron-LM's per-step spans: `batch` steps of one rank each."""
    requests, rank, sent, ids = [], 0, 0, [0]
    step_of = [0] * ranks
    base = time.time_ns()

    def new_id() -> bytes:
        ids[0] += 1
        return struct.pack(">Q", ids[0])

    def span(name, trace, parent, start, end, **attrs):
        return span_data.Span(trace_id=trace, span_id=new_id(), parent_span_id=parent, name=name,
                              start_time_unix_nano=start, end_time_unix_nano=end,
                              attributes=[kv(k, v) for k, v in attrs.items()])

    while sent < total_steps:
        trace = struct.pack(">QQ", 7, rank)
        spans = []
        for i in range(batch):
            step = step_of[rank] + i
            t0 = base + step * 100 * MS
            step_id, fb_id = new_id(), new_id()
            t = t0
            for _m in range(2):
                spans.append(span("megatron.microbatch.forward", trace, fb_id, t, t + 20 * MS))
                spans.append(span("megatron.microbatch.backward", trace, fb_id, t + 20 * MS, t + 50 * MS))
                t += 50 * MS
            spans.append(span("megatron.grad_sync.start", trace, fb_id, t, t))
            spans.append(span("megatron.grad_sync.finish", trace, fb_id, t, t + 5 * MS))
            spans.append(span_data.Span(trace_id=trace, span_id=fb_id, parent_span_id=step_id,
                                        name="megatron.train.iteration.forward_backward", start_time_unix_nano=t0,
                                        end_time_unix_nano=t + 5 * MS, attributes=[kv("num_microbatches", 2)]))
            spans.append(span("megatron.train.iteration.optimizer", trace, step_id, t + 5 * MS, t + 15 * MS))
            spans.append(span_data.Span(trace_id=trace, span_id=step_id, parent_span_id=b"\x00" * 7 + b"\x01",
                                        name="megatron.train.iteration", start_time_unix_nano=t0,
                                        end_time_unix_nano=t + 15 * MS, attributes=[kv("megatron.iteration", step)]))
        resource = resource_pb2.Resource(attributes=[kv("service.name", "megatron"), kv("nemo.run.id", run_id),
                                                     kv("dl.rank", rank), kv("dl.world_size", world)])
        requests.append(trace_pb2.ExportTraceServiceRequest(resource_spans=[span_data.ResourceSpans(
            resource=resource, scope_spans=[span_data.ScopeSpans(spans=spans)])]).SerializeToString())
        step_of[rank] += batch
        sent += batch
        rank = (rank + 1) % ranks
    return requests


def measure(args) -> dict:
    print(f"bench_ingest_mapped: {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} at start")
    total = int(args.seconds * 40_000)
    streams = {"ours": (build_requests("ours", args.ranks, args.batch, total), 1),
               "megatron": (megatron_requests("megatron", args.ranks, args.batch, total // 4),
                            MEGATRON_SPANS_PER_STEP)}
    results: dict = {name: [] for name in streams}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, (requests, spans_per_step) in streams.items():
                proc = Processor(Path(tmp) / f"{name}-{round_}")
                try:
                    cpu_before = proc.cpu_s()
                    rate, steps = sustained(grpc_sender(proc.grpc), requests, args.batch, args.seconds, args.threads)
                    cpu = max(1e-9, proc.cpu_s() - cpu_before)
                    rows = proc.rows()
                    assert rows == steps, f"{name}: {rows} rows stored but {steps} steps acknowledged"
                    figure = {"steps_per_s": round(rate), "spans_per_s": round(rate * spans_per_step),
                              "steps_per_cpu_s": round(steps / cpu),
                              "spans_per_cpu_s": round(steps * spans_per_step / cpu), "steps": steps}
                    results[name].append(figure)
                    print(f"  round {round_ + 1} {name:9s}: {figure['steps_per_s']:7,} steps/s "
                          f"({figure['spans_per_s']:7,} spans/s) wall; {figure['steps_per_cpu_s']:7,} steps "
                          f"({figure['spans_per_cpu_s']:7,} spans) per processor CPU-second; {rows:,} rows",
                          flush=True)
                finally:
                    proc.stop()
    best = {name: max(r["steps_per_cpu_s"] for r in rows) for name, rows in results.items()}
    print(f"megatron / ours, steps per processor CPU-second (best round each): "
          f"{best['megatron'] / best['ours']:.2f}x; load average {os.getloadavg()[0]:.1f} at the end")
    return {"rounds": results, "best_steps_per_cpu_s": best}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--batch", type=int, default=64, help="steps per request")
    add_json_flag(p)
    args = p.parse_args()
    with table_output(args.json):
        figures = measure(args)
    if args.json:
        print_json("bench_ingest_mapped", args, figures)


if __name__ == "__main__":
    main()
