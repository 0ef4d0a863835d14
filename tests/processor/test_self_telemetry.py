"""Self-observability: every refusal class is counted once, by reason, and is on /metrics.

Real receivers on loopback (the official gRPC stubs and raw HTTP), a real SQLite
file held by a second connection to stall the writer, and the public /metrics
text read back with names from the vocabulary, so any renderer passes.
"""
from __future__ import annotations

import gzip
import http.client
import sqlite3
import threading
import urllib.request

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from harness import wait_until
from harness.processor_service import make_service
from harness.otlp_payloads import memory_request, steps_request
from harness.reliability.reliability_helpers import prometheus_samples
from traceml.processor.security import BearerAuth
from traceml.processor.self_telemetry import KEYS, SelfTelemetry
from traceml.schema import vocabulary as v

TOKEN = "telemetry-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
SPECS = {s.name: s for s in v.PROCESSOR_METRICS}
REQUESTS = SPECS[v.METRIC_PROCESSOR_REQUESTS].prometheus_name
RECORDS = SPECS[v.METRIC_PROCESSOR_RECORDS].prometheus_name
CONNECTIONS = SPECS[v.METRIC_PROCESSOR_HTTP_CONNECTION_EVENTS].prometheus_name
OUTCOME, SIGNAL, REASON, EVENT = (v.prometheus_label(k) for k in (v.ATTR_OUTCOME, v.ATTR_SIGNAL, v.ATTR_REASON,
                                                                  v.ATTR_CONNECTION_EVENT))


def _scrape(port: int) -> dict[tuple, float]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=dict(AUTH))  # the token guards it
    with urllib.request.urlopen(request, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name in (REQUESTS, RECORDS):
        for labels, value in prometheus_samples(text, name):
            out[(name, labels.get(OUTCOME), labels.get(SIGNAL), labels.get(REASON) or None)] = value
    for labels, value in prometheus_samples(text, CONNECTIONS):
        out[(CONNECTIONS, None, None, labels.get(EVENT))] = value
    return out


class Counters:
    """The /metrics request and record counters, and what changed since the last look."""

    def __init__(self, port: int):
        self.port = port
        self.last = _scrape(port)

    def delta(self) -> dict[tuple, float]:
        now = _scrape(self.port)
        changed = {key: now[key] - self.last.get(key, 0.0) for key in now if now[key] != self.last.get(key, 0.0)}
        self.last = now
        return changed


def refused(reason: str, signal: str) -> dict[tuple, float]:
    return {(REQUESTS, v.REQUEST_REFUSED, signal, reason): 1.0}


def _post(port: int, path: str, body: bytes, headers: dict) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


PROTOBUF = {"Content-Type": "application/x-protobuf", "Authorization": f"Bearer {TOKEN}"}


def _grpc_code(call, *args, **kwargs):
    try:
        call(*args, **kwargs)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


@pytest.fixture
def service(tmp_path):
    svc = make_service(tmp_path, auth=BearerAuth(TOKEN), max_concurrent_requests=2, max_pending_records=10)
    yield svc
    svc.stop()


def test_every_series_is_on_metrics_from_the_start(service):
    """A closed set of series, zeros included, so `increase()` sees the first refusal of a kind."""
    seen = _scrape(service.prometheus_port)
    assert len(seen) == len(KEYS)
    assert {key[3] for key in seen if key[1] == v.REQUEST_REFUSED} == set(v.REFUSAL_REASONS)
    assert {key[3] for key in seen if key[0] == CONNECTIONS} == set(v.HTTP_CONNECTION_EVENTS)
    assert set(seen.values()) == {0.0}


def test_the_http_fronts_connection_events_reach_metrics(service):
    """A framing error and a hang-up below the request level: one count each, on /metrics."""
    import socket

    counters = Counters(service.prometheus_port)
    head = (f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            f"Authorization: Bearer {TOKEN}\r\n").encode()
    with socket.create_connection(("127.0.0.1", service.http_port), timeout=10) as sock:
        sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 400")
    with socket.create_connection(("127.0.0.1", service.http_port), timeout=10) as sock:
        sock.sendall(head + b"Content-Length: 1000\r\n\r\n0123456789")
    hung_up = (CONNECTIONS, None, None, "hung_up")
    assert wait_until(lambda: _scrape(service.prometheus_port)[hung_up] >= 1.0, 10)
    # The framing error is also the request's refusal (400, undecodable); the hang-up ended no request.
    assert counters.delta() == {(CONNECTIONS, None, None, "framing_error"): 1.0, hung_up: 1.0,
                                **refused(v.REFUSED_UNDECODABLE, v.SIGNAL_TRACES)}


@pytest.mark.slow
def test_each_refusal_class_is_counted_once_over_grpc_and_http(service):
    counters = Counters(service.prometheus_port)
    channel = grpc.insecure_channel(f"127.0.0.1:{service.grpc_port}")
    traces = trace_service_pb2_grpc.TraceServiceStub(channel)
    raw_traces = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
    http_port = service.http_port
    body = steps_request("st", 0, range(3)).SerializeToString()
    try:
        # Accepted: one request, its records.
        assert _grpc_code(traces.Export, steps_request("st", 0, range(3)), timeout=10, metadata=AUTH) \
            == grpc.StatusCode.OK
        assert counters.delta() == {(REQUESTS, v.REQUEST_ACCEPTED, v.SIGNAL_TRACES, None): 1.0,
                                    (RECORDS, v.RECORD_ACCEPTED, v.SIGNAL_TRACES, None): 3.0}
        # Unauthenticated, on both receivers.
        assert _grpc_code(traces.Export, steps_request("st", 1, range(3)), timeout=10,
                          metadata=(("authorization", "Bearer wrong"),)) == grpc.StatusCode.UNAUTHENTICATED
        assert counters.delta() == refused(v.REFUSED_UNAUTHENTICATED, v.SIGNAL_TRACES)
        assert _post(http_port, "/v1/metrics", memory_request("st", 0, [1]).SerializeToString(),
                     {"Content-Type": "application/x-protobuf"}) == 401
        assert counters.delta() == refused(v.REFUSED_UNAUTHENTICATED, v.SIGNAL_METRICS)
        # Undecodable.
        assert _grpc_code(raw_traces, b"\xff\xff\xff\xff", timeout=10, metadata=AUTH) \
            == grpc.StatusCode.INVALID_ARGUMENT
        assert counters.delta() == refused(v.REFUSED_UNDECODABLE, v.SIGNAL_TRACES)
        assert _post(http_port, "/v1/metrics", b"\xff\xff\xff\xff", PROTOBUF) == 400
        assert counters.delta() == refused(v.REFUSED_UNDECODABLE, v.SIGNAL_METRICS)
        # Unsupported media: content type, content encoding.
        assert _post(http_port, "/v1/traces", body, {**PROTOBUF, "Content-Type": "text/plain"}) == 415
        assert counters.delta() == refused(v.REFUSED_UNSUPPORTED, v.SIGNAL_TRACES)
        assert _post(http_port, "/v1/traces", body, {**PROTOBUF, "Content-Encoding": "br"}) == 415
        assert counters.delta() == refused(v.REFUSED_UNSUPPORTED, v.SIGNAL_TRACES)
        # Too large: a small gzip body that inflates past the cap.
        bomb = gzip.compress(b"\x00" * (21 * 1024 * 1024))
        assert _post(http_port, "/v1/traces", bomb, {**PROTOBUF, "Content-Encoding": "gzip"}) == 413
        assert counters.delta() == refused(v.REFUSED_TOO_LARGE, v.SIGNAL_TRACES)

        # Over the limit and back-pressure: a second connection holds the SQLite write
        # lock, so the writer stalls with the first batch in flight.
        blocker = sqlite3.connect(service.config.db)
        blocker.execute("BEGIN EXCLUSIVE")
        answers = {}

        def send(name, rank):
            answers[name] = _grpc_code(traces.Export, steps_request("st", rank, range(10, 16)), timeout=30,
                                       metadata=AUTH)

        first = threading.Thread(target=send, args=("first", 2))
        first.start()
        assert wait_until(lambda: service.ingest.in_flight_records == 6, 10)
        second = threading.Thread(target=send, args=("second", 3))
        second.start()
        assert wait_until(lambda: service.ingest.pending_records() == 6, 10)
        # Two gRPC calls admitted (the limit): a third is refused at once.
        assert _grpc_code(traces.Export, steps_request("st", 4, range(3)), timeout=10, metadata=AUTH) \
            == grpc.StatusCode.UNAVAILABLE
        assert counters.delta() == refused(v.REFUSED_OVER_LIMIT, v.SIGNAL_TRACES)
        # HTTP has room, the queue does not: back-pressure, counted by the queue.
        assert _post(http_port, "/v1/traces", steps_request("st", 5, range(6)).SerializeToString(), PROTOBUF) == 429
        assert counters.delta() == refused(v.REFUSED_BACKPRESSURE, v.SIGNAL_TRACES)
        blocker.rollback()
        blocker.close()
        first.join(30)
        second.join(30)
        assert answers == {"first": grpc.StatusCode.OK, "second": grpc.StatusCode.OK}
        assert counters.delta() == {(REQUESTS, v.REQUEST_ACCEPTED, v.SIGNAL_TRACES, None): 2.0,
                                    (RECORDS, v.RECORD_ACCEPTED, v.SIGNAL_TRACES, None): 12.0}

        # Unavailable: the queue no longer commits (as during shutdown).
        service.ingest.stop()
        assert _grpc_code(traces.Export, steps_request("st", 6, range(3)), timeout=10, metadata=AUTH) \
            == grpc.StatusCode.UNAVAILABLE
        assert counters.delta() == refused(v.REFUSED_UNAVAILABLE, v.SIGNAL_TRACES)
        assert _post(http_port, "/v1/traces", body, PROTOBUF) == 503
        assert counters.delta() == refused(v.REFUSED_UNAVAILABLE, v.SIGNAL_TRACES)
    finally:
        channel.close()


def test_values_outside_the_vocabulary_raise():
    stats = SelfTelemetry()
    with pytest.raises(ValueError):
        stats.refused(v.SIGNAL_TRACES, "because")
    with pytest.raises(ValueError):
        stats.records("lost", v.SIGNAL_TRACES, 1)
    assert set(stats.counts().values()) == {0}
