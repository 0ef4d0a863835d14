"""A rank-like sender process: sends step batches, records what was acknowledged.

    python -m harness.reliability.sender --grpc PORT --http PORT --transport grpc --run RUN --ranks 0,1 \
        --ack-log FILE --stop-file FILE [--batch 5] [--replay-to STEP]

Each request holds `--batch` consecutive steps of one rank, built
deterministically, so a retry (or a later replay) sends the same bytes. A
request that is not acknowledged (processor down, UNAVAILABLE, 503, timeout) is
retried until it is; only then is "rank first last" appended to the ack log.
When the stop file appears the sender finishes the request in hand and exits.
`--replay-to N` instead sends every batch up to step N once more, and exits.
"""
from __future__ import annotations

import argparse
import http.client
import sys
import time
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from harness.reliability import reliability_helpers as h


def _send_grpc(stub, body: bytes) -> bool:
    try:
        stub(body, timeout=5)
        return True
    except grpc.RpcError:
        return False


class _Http:
    def __init__(self, port: int):
        self.port = port
        self.conn = None

    def send(self, body: bytes) -> bool:
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            self.conn.request("POST", "/v1/traces", body=body, headers={"Content-Type": "application/x-protobuf"})
            response = self.conn.getresponse()
            response.read()
            if response.status == 200:
                return True
        except (OSError, http.client.HTTPException):
            pass
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        return False


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--grpc", type=int, required=True)
    p.add_argument("--http", type=int, required=True)
    p.add_argument("--transport", choices=("grpc", "http"), default="grpc")
    p.add_argument("--run", required=True)
    p.add_argument("--ranks", required=True)
    p.add_argument("--world-size", type=int, default=None)
    p.add_argument("--batch", type=int, default=5)
    p.add_argument("--ack-log", type=Path)
    p.add_argument("--stop-file", type=Path)
    p.add_argument("--replay-to", type=int, default=None)
    args = p.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    channel = grpc.insecure_channel(f"127.0.0.1:{args.grpc}")
    stub = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                               response_deserializer=trace_service_pb2.ExportTraceServiceResponse.FromString)
    assert trace_service_pb2_grpc  # the generated module names the method used above
    http_client = _Http(args.http)
    send = (lambda body: _send_grpc(stub, body)) if args.transport == "grpc" else http_client.send
    log = open(args.ack_log, "a", buffering=1) if args.ack_log else None
    retries = 0
    first = 1
    while True:
        if args.replay_to is not None and first > args.replay_to:
            break
        if args.replay_to is None and args.stop_file.exists():
            break
        steps = range(first, first + args.batch)
        for rank in ranks:
            body = h.steps_request(args.run, rank, steps, world_size=args.world_size).SerializeToString()
            while not send(body):  # retry the same bytes until acknowledged
                retries += 1
                time.sleep(0.05)
            if log:
                log.write(f"{rank} {steps[0]} {steps[-1]}\n")
        first += args.batch
    print(f"sender ranks={args.ranks} last_step={first - 1} retries={retries}", flush=True)
    channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
