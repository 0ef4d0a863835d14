"""OTLP/HTTP over a kept-alive `http.client` connection where no proxy is in the way, and through
`requests` (which follows HTTP_PROXY / NO_PROXY, as the OpenTelemetry SDK's exporter does) where one
is: the same requests arrive either way, and a proxied endpoint really goes through the proxy."""
from __future__ import annotations

import http.client
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from harness.otlp_receiver import OtlpTestReceiver
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from traceml.exporter import resolve_settings
from traceml.exporter.transport import HttpTransport, KeptAliveConnection, direct_http
from traceml.schema import vocabulary as v

_PROXY_VARIABLES = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy",
                    "ALL_PROXY", "all_proxy")


@pytest.fixture
def no_proxy_variables(monkeypatch):
    for name in _PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_only_plain_http_that_no_proxy_variable_covers_is_sent_directly(no_proxy_variables):
    assert direct_http("http://collector.example:4318/v1/traces")
    assert not direct_http("https://127.0.0.1:4318/v1/traces")  # TLS: requests' trust store, as before
    assert not direct_http("http://127.0.0.1:4318/v1/traces?tenant=a")  # requests keeps the query
    no_proxy_variables.setenv("HTTP_PROXY", "http://proxy.example:3128")
    assert not direct_http("http://collector.example:4318/v1/traces")
    # This machine's loopback: no proxy can reach it for us (traceml run's processor is there).
    for loopback in ("127.0.0.1", "127.0.1.1", "[::1]", "localhost"):
        assert direct_http(f"http://{loopback}:4318/v1/traces"), loopback
    no_proxy_variables.setenv("NO_PROXY", "collector.example")
    assert direct_http("http://collector.example:4318/v1/traces")


def _request_with_one_span() -> trace_service_pb2.ExportTraceServiceRequest:
    request = trace_service_pb2.ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.name, span.trace_id, span.span_id = "traceml.step", b"\x01" * 16, b"\x02" * 8
    return request


def _export(base_url: str) -> bool:
    """One traces request to `base_url` (OTLP's generic endpoint: the transport posts to /v1/traces)."""
    transport = HttpTransport(resolve_settings(base_url, "http/protobuf", environ={}).traces, threading.Event())
    try:
        return transport.export(v.SIGNAL_TRACES, _request_with_one_span(), time.monotonic() + 5).delivered
    finally:
        transport.close()


class _ForwardProxy(ThreadingHTTPServer):
    """A plain HTTP forward proxy in front of one server: relays each absolute-URI request, whatever
    its host (a collector's name that resolves nowhere here), to `target` and records its URI."""

    def __init__(self, target: str):
        self.relayed: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                outer.relayed.append(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                headers = {k: val for k, val in self.headers.items() if k.lower() not in ("host", "proxy-connection")}
                path = "/" + self.path.split("://", 1)[-1].split("/", 1)[-1]
                forwarded = urllib.request.Request(target + path, data=body, headers=headers, method="POST")
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # straight to the target
                with opener.open(forwarded, timeout=5) as answer:
                    data = answer.read()
                    self.send_response(answer.status)
                    self.send_header("Content-Type", answer.headers.get("Content-Type", "application/x-protobuf"))
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_a_proxied_endpoint_goes_through_the_proxy_and_a_direct_one_does_not(no_proxy_variables):
    with OtlpTestReceiver() as receiver:
        proxy = _ForwardProxy(receiver.http_endpoint)
        try:
            no_proxy_variables.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.server_address[1]}")
            assert _export(receiver.http_endpoint) and proxy.relayed == []  # loopback: direct
            remote = "http://collector.invalid:4318"  # a collector elsewhere: only the proxy reaches it
            assert not direct_http(remote) and _export(remote)
            assert proxy.relayed == [f"{remote}/v1/traces"]
            assert receiver.wait_for(lambda: len(receiver.spans()) == 2, timeout_s=5)
        finally:
            proxy.shutdown()
            proxy.server_close()


class _ClosesSilently(ThreadingHTTPServer):
    """Answers each request with a keep-alive response, then closes the connection without saying
    so: what a server's idle timeout does to a kept-alive connection between two exports."""

    def __init__(self):
        self.calls = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                outer.calls += 1
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                self.close_connection = True  # closed after the answer, which promised keep-alive

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_a_kept_alive_connection_the_server_closed_is_replaced_without_a_failure():
    server = _ClosesSilently()
    try:
        conn = KeptAliveConnection(f"http://127.0.0.1:{server.server_address[1]}")
        for _ in range(3):
            status, _, _ = conn.request("POST", "/v1/traces", {}, 2.0, b"x")
            assert status == 200
            time.sleep(0.05)  # the server has closed its end by now
        assert server.calls == 3
        conn.close()
    finally:
        server.shutdown()
        server.server_close()


def test_a_refused_connection_is_an_error_the_caller_sees():
    with OtlpTestReceiver() as receiver:
        port = receiver.http_port
    conn = KeptAliveConnection(f"http://127.0.0.1:{port}")  # nothing listens there any more
    with pytest.raises((OSError, http.client.HTTPException)):
        conn.request("POST", "/v1/traces", {}, 1.0, b"x")


@pytest.mark.slow
def test_the_direct_connection_delivers_to_a_collector_we_did_not_write(no_proxy_variables, tmp_path):
    """rotel-agent's OTLP/HTTP receiver (a Rust agent, hyper's HTTP/1.1) takes our kept-alive
    connection's requests, one after another on the same connection and again after a pause, and
    relays every span to a gRPC receiver."""
    from harness.rotel_relay import RotelRelay

    with OtlpTestReceiver() as receiver, RotelRelay(tmp_path / "rotel", receiver.grpc_endpoint, "grpc",
                                                    ["--disable-batching"]) as relay:
        settings = resolve_settings(f"http://127.0.0.1:{relay.http_port}", "http/protobuf", environ={}).traces
        transport = HttpTransport(settings, threading.Event())
        try:
            assert transport._direct is not None  # loopback: the kept-alive http.client connection
            for pause_s in (0.0, 0.0, 1.5):
                time.sleep(pause_s)
                outcome = transport.export(v.SIGNAL_TRACES, _request_with_one_span(), time.monotonic() + 5)
                assert outcome.delivered and outcome.retries == 0, outcome
        finally:
            transport.close()
        assert receiver.wait_for(lambda: len(receiver.spans()) == 3, timeout_s=10), relay.log_text()[-2000:]
