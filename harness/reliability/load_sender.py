"""Simulated ranks at a steady step rate, each exporting once per interval over OTLP/gRPC.

    python -m harness.reliability.load_sender --grpc PORT --run RUN --ranks 0-127 --steps-per-s 2 \
        --duration 20 [--straggler 37] [--interval 1]

Like the real exporter, each rank sends one request per interval holding the
steps it finished since the last one, with real end times (so the processor's
lag is meaningful). The straggler's input pipeline is 40 ms slower and it waits
40 ms less in the all-reduce (backward): the diagnosis must name it an input
straggler. Unacknowledged requests are retried. Prints one JSON line of counts.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import grpc

from harness.reliability import reliability_helpers as h
from traceml.schema import vocabulary as v

STRAGGLER_EVENTS = {**h.EVENTS_MS, v.RAW_DATALOADER_NEXT: h.EVENTS_MS[v.RAW_DATALOADER_NEXT] + 40.0,
                    v.RAW_BACKWARD: h.EVENTS_MS[v.RAW_BACKWARD] - 40.0}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--grpc", type=int, required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--ranks", required=True, help="first-last")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--steps-per-s", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--straggler", type=int, default=-1)
    args = p.parse_args()
    first, last = (int(x) for x in args.ranks.split("-"))
    ranks = range(first, last + 1)
    channel = grpc.insecure_channel(f"127.0.0.1:{args.grpc}")
    export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
    next_step = {rank: 1 for rank in ranks}
    owed = 0.0
    requests = spans = retries = late_ticks = 0
    began = time.monotonic()
    tick = began
    while time.monotonic() - began < args.duration:
        owed += args.steps_per_s * args.interval
        n, owed = int(owed), owed - int(owed)
        now = time.time()
        for rank in ranks:
            steps = range(next_step[rank], next_step[rank] + n)
            next_step[rank] += n
            if not steps:
                continue
            events = STRAGGLER_EVENTS if rank == args.straggler else None
            spacing = args.interval / max(1, n)
            request = h.steps_request(args.run, rank, steps, events, world_size=args.world_size,
                                      end_s_of=lambda s, top=steps[-1]: now - (top - s) * spacing)
            body = request.SerializeToString()
            while True:
                try:
                    export(body, timeout=10)
                    break
                except grpc.RpcError:
                    retries += 1
                    time.sleep(0.1)
            requests += 1
            spans += n
        tick += args.interval
        delay = tick - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            late_ticks += 1
    channel.close()
    print(json.dumps({"ranks": len(ranks), "requests": requests, "spans": spans, "retries": retries,
                      "late_ticks": late_ticks, "last_step": {str(r): next_step[r] - 1 for r in (first, last)},
                      "seconds": round(time.monotonic() - began, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
