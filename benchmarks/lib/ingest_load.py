"""A real processor process and the senders that load it: the ingest benchmarks' shared parts.

The processor is the real CLI in its own process; senders are threads sending pre-serialised
OTLP requests (gRPC or HTTP keep-alive), so client-side protobuf encoding does not count
against the processor.
"""
from __future__ import annotations

import http.client
import threading
import time
from pathlib import Path

import grpc
import psutil

from harness import ProcessorProcess
from harness.otlp_payloads import step_span, trace_request
from harness.stored_rows import count_rows

TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class Processor(ProcessorProcess):
    """The shared processor subprocess, started at once, plus the figures this benchmark reads."""

    def __init__(self, folder: Path, refresh_s: float = 0.5, workers: int = 1, code_root: Path | None = None):
        # code_root: another version of the code (see --baseline-ref), found first on PYTHONPATH.
        super().__init__(folder, db=folder / "bench.db", summary_dir=None,
                         env={"PYTHONPATH": str(code_root)} if code_root is not None else None,
                         extra_args=["--refresh-interval", str(refresh_s), "--idle-timeout", "3600",
                                     "--log-level", "WARNING", "--workers", str(workers)])
        started = time.perf_counter()
        self.start(wait_readyz=True)
        self.start_s = time.perf_counter() - started
        self.ps = psutil.Process(self.proc.pid)

    def cpu_s(self) -> float:
        total = 0.0
        for p in [self.ps, *self.ps.children(recursive=True)]:
            try:
                times = p.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
        return total

    def rss_mib(self) -> float:
        return self.ps.memory_info().rss / 2**20

    def rows(self) -> int:
        return count_rows(self.db)

    def scrape(self) -> str:
        return self.metrics_text()


def build_requests(run_id: str, ranks: int, batch: int, total_spans: int, world: int = 1000) -> list[bytes]:
    """Pre-serialised requests: each holds `batch` consecutive steps of one rank."""
    requests, rank, sent = [], 0, 0
    step_of = [0] * ranks
    base = time.time()
    while sent < total_spans:
        first = step_of[rank]
        spans = [step_span(first + i, rank, end_s=base + (first + i) * 0.05) for i in range(batch)]
        requests.append(trace_request(run_id, rank, spans, world_size=world).SerializeToString())
        step_of[rank] += batch
        sent += batch
        rank = (rank + 1) % ranks
    return requests


def sustained(send_one, requests: list[bytes], batch: int, seconds: float, threads: int) -> tuple[float, int]:
    """Send from `threads` senders until `seconds` pass or requests run out; spans acked per second."""
    lock = threading.Lock()
    index = [0]
    acked = [0]
    deadline = time.perf_counter() + seconds

    def worker():
        sender = send_one()
        while time.perf_counter() < deadline:
            with lock:
                i = index[0]
                if i >= len(requests):
                    return
                index[0] += 1
            while not sender(requests[i]):  # back-pressure: retry the same request
                time.sleep(0.05)
            with lock:
                acked[0] += batch

    started = time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - started
    return acked[0] / elapsed, acked[0]


def grpc_sender(port: int):
    def make():
        # Own TCP connection per sender (as separate ranks would have), so SO_REUSEPORT
        # workers each get a share.
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20),
                                                                      ("grpc.use_local_subchannel_pool", 1)])
        call = channel.unary_unary(TRACE_METHOD)  # bytes in, bytes out: no client-side encoding

        def send(body: bytes) -> bool:
            try:
                call(body, timeout=60)
                return True
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    return False
                raise
        return send
    return make


def http_sender(port: int):
    def make():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

        def send(body: bytes) -> bool:
            conn.request("POST", "/v1/traces", body=body, headers={"Content-Type": "application/x-protobuf"})
            response = conn.getresponse()
            response.read()
            if response.status in (429, 503):
                return False
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}")
            return True
        return send
    return make
