"""One rank of a job run under the ORIGINAL TraceML (traceopt-ai/traceml), as its OTLP log
export sends it: a real process, the official OpenTelemetry SDK's logs API and OTLP exporter.

No released `traceml-ai` emits OTLP (0.5.0, the newest on PyPI, has no OpenTelemetry code;
its OTLP log export is traceopt-ai/traceml issues #394-#396, with the rank-local step
windows of #229/#231). So this reproduces the record shape those issues define, with the
field names of 0.5.0's own contracts (`telemetry/envelope.py` `TelemetryMeta`,
`samplers/schema/step_time_schema.py`); docs/wire-format.md "Log records received" lists
it field by field and says which spellings are ours where the issues leave them open.
The names are spelled here on their own, not imported from the processor's mapping, so a
test that sends them checks the mapping against the documented shape.

Per rank: one LoggerProvider whose Resource holds the rank process's stable facts (#396
item 3), one LogRecord per step_timing record (#396 item 2: structured, no preformatted
text), plus one runtime_context and one step_memory record (#394's other kinds). The
timings are the records' values, not measured here: a run's SLOW_RANK, `--slow-phase` and
`--slow-ms` make one rank slow in one phase the way synchronous data-parallel training
records it (the slow rank's own phase grows; every other rank waits that long inside
backward's gradient all-reduce), so a run's verdict does not depend on this machine's load.

    python -m harness.original_traceml_logs --rank 1 --world-size 4 \
        --run SESSION PROTOCOL ENDPOINT WINDOW_STEPS SLOW_RANK [--run ...]

Each `--run` is one session (run) with a Resource of its own, sent over `grpc` (ENDPOINT
host:port) or `http` (ENDPOINT http://host:port) in windows of WINDOW_STEPS steps, with
SLOW_RANK (or `-`) slowed by `--slow-ms` in `--slow-phase`. The timings are seeded by rank,
window size and slow rank only, so the same run sent twice (directly and through a relay)
carries the same values.
"""
from __future__ import annotations

import argparse
import os
import random
import socket
import time

# Per-step base timings (ms) of every rank before any slowing.
BASE_MS = {"data_wait_ms": 4.0, "h2d_ms": 2.0, "forward_ms": 30.0, "backward_ms": 45.0, "optimizer_ms": 10.0}


def step_means(rank: int, slow_rank: int | None, slow_phase: str, slow_ms: float,
               rng: random.Random) -> dict[str, float]:
    """One step's timings on `rank` (ms), with +-2 % seeded jitter."""
    values = {key: ms * rng.uniform(0.98, 1.02) for key, ms in BASE_MS.items()}
    if slow_rank is not None:
        if rank == slow_rank:
            values[slow_phase] += slow_ms
        else:
            values["backward_ms"] += slow_ms  # waiting in the all-reduce for the slow rank
    values["step_wall_ms"] = sum(v for k, v in values.items() if k != "data_wait_ms")
    return values


def window_body(steps: list[dict[str, float]], start_step: int, start_s: float, end_s: float,
                flush_reason: str) -> dict:
    """A step_timing record's body: per-step means over the window (#231: never totals), the window."""
    n = len(steps)
    means = {key: sum(s[key] for s in steps) / n for key in steps[0]}
    slowest = max(range(n), key=lambda i: steps[i]["step_wall_ms"])
    body = {"step": start_step + n - 1, "timestamp": end_s, **means}
    body["window"] = {
        "start_step": start_step, "end_step": start_step + n - 1, "step_count": n,
        "start_timestamp": start_s, "end_timestamp": end_s, "flush_reason": flush_reason,
        "slowest_step": start_step + slowest, "slowest_step_wall_ms": steps[slowest]["step_wall_ms"],
    }
    return body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--run", nargs=5, action="append", required=True,
                        metavar=("SESSION", "PROTOCOL", "ENDPOINT", "WINDOW_STEPS", "SLOW_RANK"))
    parser.add_argument("--windows", type=int, default=24)
    parser.add_argument("--slow-phase", default="data_wait_ms", choices=sorted(BASE_MS))
    parser.add_argument("--slow-ms", type=float, default=40.0)
    parser.add_argument("--header", action="append", default=[], help="KEY=VALUE on every export request")
    args = parser.parse_args(argv)

    from opentelemetry._logs import SeverityNumber
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as GrpcLogExporter
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as HttpLogExporter

    headers = dict(item.split("=", 1) for item in args.header)

    def make_exporter(protocol: str, endpoint: str):
        if protocol == "grpc":
            return GrpcLogExporter(endpoint=endpoint, insecure=True, timeout=20, headers=headers)
        if protocol == "http":
            return HttpLogExporter(endpoint=f"{endpoint}/v1/logs", timeout=20, headers=headers)
        raise SystemExit(f"unknown protocol {protocol!r}")

    host, pid = socket.gethostname(), os.getpid()
    sent = 0
    for session, protocol, endpoint, window_text, slow_text in args.run:
        window_steps, slow_rank = int(window_text), (None if slow_text == "-" else int(slow_text))
        resource = Resource({
            "service.name": os.environ.get("OTEL_SERVICE_NAME", "traceml"),
            "host.name": host, "process.pid": pid,
            "traceml.session_id": session, "traceml.global_rank": args.rank, "traceml.local_rank": args.rank,
            "traceml.world_size": args.world_size, "traceml.local_world_size": args.world_size,
            "traceml.node_rank": 0,
        })
        provider = LoggerProvider(resource=resource)
        provider.add_log_record_processor(BatchLogRecordProcessor(make_exporter(protocol, endpoint),
                                                                  max_queue_size=4096))
        logger = provider.get_logger("traceml_ai")
        rng = random.Random(f"{args.rank}/{window_steps}/{slow_rank}")
        common = {"traceml.schema_version": 1, "traceml.sampler": "step_time"}
        start = time.time() - args.windows * window_steps * 0.2
        now = start
        logger.emit(timestamp=int(now * 1e9), severity_number=SeverityNumber.INFO, severity_text="INFO",
                    event_name="traceml.runtime_context",
                    attributes={**common, "traceml.record_kind": "runtime_context",
                                "traceml.sampler": "runtime_environment"},
                    body={"distributed_backend": "gloo", "training_strategy": "ddp"})
        for window in range(args.windows):
            first = window * window_steps
            steps = [step_means(args.rank, slow_rank, args.slow_phase, args.slow_ms, rng)
                     for _ in range(window_steps)]
            window_start = now
            now += sum(s["step_wall_ms"] + s["data_wait_ms"] for s in steps) / 1000.0
            reason = "shutdown" if window == args.windows - 1 else "steps"
            body = window_body(steps, first, window_start, now, reason)
            logger.emit(timestamp=int(now * 1e9), severity_number=SeverityNumber.INFO, severity_text="INFO",
                        event_name="traceml.step_timing",
                        attributes={**common, "traceml.record_kind": "step_timing", "traceml.step": body["step"]},
                        body=body)
            sent += 1
        logger.emit(timestamp=int(now * 1e9), severity_number=SeverityNumber.INFO, severity_text="INFO",
                    event_name="traceml.step_memory",
                    attributes={**common, "traceml.record_kind": "step_memory", "traceml.sampler": "step_memory",
                                "traceml.step": args.windows * window_steps - 1},
                    body={"step": args.windows * window_steps - 1, "device": "cpu"})  # CPU: no peaks
        provider.force_flush(20_000)
        provider.shutdown()
    print(f"rank {args.rank}: {sent} step_timing records sent", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
