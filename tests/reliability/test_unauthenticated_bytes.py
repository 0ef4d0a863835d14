"""Unauthenticated bytes: with a token configured, a wrong-token flood costs the processor no memory.

The real `traceml-processor` CLI with `--auth-token-file`; 40 concurrent 50 MiB
OTLP/gRPC calls with a wrong token, over a few shared connections (as a client
multiplexing its calls would), while the processor's peak RSS (VmHWM in
/proc/<pid>/status) is watched. Checked in the handler, after grpcio had read
and held each message, they took the processor from 44 MiB to about 1 GiB; the
token is now checked on the metadata and the body is never read.
"""
from __future__ import annotations

import threading
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from harness import ProcessorProcess
from harness.reliability import reliability_helpers as h
from traceml.schema import vocabulary as v

TOKEN = "the-right-token"
CALLS = 40
BODY_MIB = 50
CONNECTIONS = 4
MAX_GROWTH_MIB = 200
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def _refused_unauthenticated(prometheus_port: int) -> float:
    scrape = urllib.request.Request(f"http://127.0.0.1:{prometheus_port}/metrics",
                                    headers={"Authorization": f"Bearer {TOKEN}"})  # /metrics honours the token
    with urllib.request.urlopen(scrape, timeout=10) as r:
        text = r.read().decode()
    name = next(s for s in v.PROCESSOR_METRICS if s.name == v.METRIC_PROCESSOR_REQUESTS).prometheus_name
    reason, signal = v.prometheus_label(v.ATTR_REASON), v.prometheus_label(v.ATTR_SIGNAL)
    return sum(value for labels, value in h.prometheus_samples(text, name)
               if labels.get(reason) == v.REFUSED_UNAUTHENTICATED and labels.get(signal) == v.SIGNAL_TRACES)


@pytest.mark.slow
def test_wrong_token_flood_is_refused_before_its_bodies_are_read(tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    proc = ProcessorProcess(tmp_path / "p", extra_args=["--auth-token-file", str(tmp_path / "token")]).start()
    channels = [grpc.insecure_channel(f"127.0.0.1:{proc.grpc}", options=[("grpc.max_send_message_length", -1),
                                                                        ("grpc.use_local_subchannel_pool", 1)])
                for _ in range(CONNECTIONS)]
    try:
        pid = proc.proc.pid
        before = _status_mib(pid, "VmHWM")
        body = b"\x0a" + b"\x00" * (BODY_MIB << 20)  # never parsed: its size is all that matters
        codes: list = []
        lock = threading.Lock()

        def call(index: int) -> None:
            export = channels[index % CONNECTIONS].unary_unary(EXPORT)
            try:
                export(body, timeout=60, metadata=(("authorization", "Bearer wrong"),))
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            with lock:
                codes.append(code)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(CALLS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(t.is_alive() for t in threads), "calls did not end"
        growth = _status_mib(pid, "VmHWM") - before
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * CALLS
        assert growth < MAX_GROWTH_MIB, f"peak RSS grew {growth:.0f} MiB for {CALLS} x {BODY_MIB} MiB refused calls"
        assert _refused_unauthenticated(proc.prom) == CALLS

        # The right token still works, on the same connections.
        request = h.steps_request("unauth-bytes", 0, range(3))
        response = trace_service_pb2_grpc.TraceServiceStub(channels[0]).Export(
            request, timeout=30, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert not response.HasField("partial_success")
    finally:
        for channel in channels:
            channel.close()
        proc.stop()
