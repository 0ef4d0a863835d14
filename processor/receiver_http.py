"""OTLP/HTTP receiver: POST /v1/traces and /v1/metrics, plus /healthz and /readyz.

Bodies are OTLP protobuf (`application/x-protobuf`) or OTLP/JSON
(`application/json`); the answer uses the request's content type. Gzip is
honoured here (HTTP compression is not transparent as it is in gRPC) and the
body is capped at 20 MiB after decompression (413). Empty requests answer 200;
undecodable bodies 400; more requests at once than the concurrent-request limit
and a full ingest queue 429, an uncommitted batch 503, each with `Retry-After`,
which OTLP clients retry.
"""
from __future__ import annotations

import logging
import socket
import threading
import zlib
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from google.protobuf.message import DecodeError
from google.rpc import status_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb2

from traceml.processor.decode import otlp_json_response, parse_otlp_json
from traceml.processor.ingest import DEFAULT_MAX_CONCURRENT_REQUESTS, RETRY_AFTER_S, Backpressure, IngestUnavailable
from traceml.processor.otlp_intake import OtlpIntake
from traceml.processor.security import BearerAuth, TlsConfig
from traceml.processor.serving import ServerThread
from traceml.schema.vocabulary import SIGNAL_METRICS, SIGNAL_TRACES

LOG = logging.getLogger(__name__)

MAX_BODY_BYTES = 20 * 1024 * 1024
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_RETRY_LATER = {"Retry-After": str(RETRY_AFTER_S)}

_ROUTES = {
    "/v1/traces": (trace_pb2.ExportTraceServiceRequest, SIGNAL_TRACES),
    "/v1/metrics": (metrics_pb2.ExportMetricsServiceRequest, SIGNAL_METRICS),
}


class BodyTooLarge(Exception):
    pass


def gunzip_capped(data: bytes, cap: int = MAX_BODY_BYTES) -> bytes:
    """Decompress gzip, refusing anything that inflates past `cap` (zip bombs included)."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(data, cap + 1)
    except zlib.error as exc:
        raise ValueError(f"bad gzip body: {exc}") from exc
    if len(out) > cap or inflater.unconsumed_tail:
        raise BodyTooLarge(f"body exceeds {cap} bytes after decompression")
    if not inflater.eof:
        raise ValueError("truncated gzip body")
    return out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "traceml-processor"
    # Headers and body go out as two writes; with Nagle on, the body waits for the
    # client's (delayed, ~40 ms) ACK of the headers. TCP_NODELAY sends both at once.
    disable_nagle_algorithm = True
    server: "_Server"

    def log_message(self, fmt, *args):  # route http.server chatter to logging at debug
        LOG.debug("%s " + fmt, self.address_string(), *args)

    # --- helpers ---------------------------------------------------------------------

    def _send(self, code: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:  # tell the client, rather than just hanging up after the answer
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_status(self, code: int, message: str, content_type: str, headers: dict | None = None) -> None:
        self._send(*self._status_reply(code, message, content_type, headers))

    @staticmethod
    def _status_reply(code: int, message: str, content_type: str, headers: dict | None = None) -> tuple:
        """An error answer as `_send`'s arguments: a `google.rpc.Status` in the request's encoding."""
        status = status_pb2.Status(code=_grpc_code(code), message=message)
        if content_type == JSON:
            body = otlp_json_response(status)
        else:
            body, content_type = status.SerializeToString(), PROTOBUF
        return code, body, content_type, headers

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks, total = [], 0
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                total += size
                if total > MAX_BODY_BYTES:
                    self.close_connection = True
                    raise BodyTooLarge(f"body exceeds {MAX_BODY_BYTES} bytes")
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        if length < 0:
            raise ValueError("negative Content-Length")
        if length > MAX_BODY_BYTES:
            self._discard(length)
            raise BodyTooLarge(f"body of {length} bytes exceeds {MAX_BODY_BYTES}")
        return self.rfile.read(length) if length else b""

    def _drain_unread_body(self) -> None:
        """Keep a keep-alive connection in step when refusing before the body is read.

        A Content-Length body within the cap is read and dropped; anything else
        (chunked, oversized, unparsable length) ends the connection instead, and
        `_send` then says `Connection: close`.
        """
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self.close_connection = True
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True
            return
        self._discard(length)

    def _discard(self, length: int) -> None:
        """Read and drop an oversized body (bounded), so the client sees the 413 answer."""
        if length > 4 * MAX_BODY_BYTES:
            self.close_connection = True
            return
        while length > 0:
            chunk = self.rfile.read(min(length, 1 << 20))
            if not chunk:
                break
            length -= len(chunk)

    # --- routes ----------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self._send(200, b"ok\n", "text/plain; charset=utf-8")
        elif path == "/readyz":
            ready, detail = self.server.readiness()
            self._send(200 if ready else 503, (detail + "\n").encode(), "text/plain; charset=utf-8")
        else:
            self._send(404, b"not found\n", "text/plain; charset=utf-8")

    do_HEAD = do_GET

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        route = _ROUTES.get(path)
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        answer_type = JSON if content_type == JSON else PROTOBUF
        if route is None:
            self._drain_unread_body()
            self._send_status(404, f"no OTLP route {path}", answer_type)
            return
        if not self.server.auth.allows(self.headers.get("Authorization")):
            self._drain_unread_body()
            self._send_status(401, "missing or wrong bearer token", answer_type,
                              {"WWW-Authenticate": "Bearer"})
            return
        if content_type not in (JSON, PROTOBUF):
            self._drain_unread_body()
            self._send_status(415, f"unsupported content type {content_type!r}; "
                                   f"use {PROTOBUF} or {JSON}", PROTOBUF)
            return
        # Refused before the body is read, so requests over the limit hold no body in memory.
        if not self.server.admission.acquire(blocking=False):
            self._drain_unread_body()
            self._send_status(429, f"over the limit of {self.server.max_concurrent_requests} concurrent requests",
                              answer_type, _RETRY_LATER)
            return
        try:
            reply = self._export(route, content_type, answer_type)
        finally:
            # Released before the answer is written: a client that has its answer
            # finds the slot free, and a slow reader holds no admission.
            self.server.admission.release()
        self._send(*reply)

    def _export(self, route, content_type: str, answer_type: str) -> tuple:
        message_cls, signal = route
        try:
            body = self._read_body()
            encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
            if encoding == "gzip":
                body = gunzip_capped(body) if body else body
            elif encoding not in ("identity", ""):
                return self._status_reply(415, f"unsupported Content-Encoding {encoding!r}", answer_type)
            request = message_cls()
            if body:
                if content_type == JSON:
                    parse_otlp_json(body, request)
                else:
                    request.ParseFromString(body)
        except BodyTooLarge as exc:
            return self._status_reply(413, str(exc), answer_type)
        except (ValueError, DecodeError) as exc:
            self.server.stats.add("undecodable", signal, 1)
            return self._status_reply(400, f"undecodable {signal} request: {exc}", answer_type)
        try:
            handle = self.server.handler.traces if signal == SIGNAL_TRACES else self.server.handler.metrics
            response = handle(request)
        except Backpressure as exc:
            return self._status_reply(429, f"back-pressure: {exc}", answer_type, _RETRY_LATER)
        except IngestUnavailable as exc:
            return self._status_reply(503, str(exc), answer_type, _RETRY_LATER)
        if answer_type == JSON:
            return 200, otlp_json_response(response), JSON
        return 200, response.SerializeToString(), PROTOBUF


def _grpc_code(http_code: int) -> int:
    return {400: 3, 401: 16, 404: 5, 413: 8, 415: 3, 429: 8, 503: 14}.get(http_code, 2)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address, handler: OtlpIntake, auth: BearerAuth,
                 readiness: Callable[[], tuple[bool, str]], stats, reuse_port: bool = False,
                 max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS):
        if max_concurrent_requests < 1:
            raise ValueError("the concurrent-request limit must be at least 1")
        self.allow_reuse_port = reuse_port  # ingest workers share the port (SO_REUSEPORT)
        super().__init__(address, _Handler)
        self.handler = handler
        self.auth = auth
        self.readiness = readiness
        self.stats = stats
        # One thread per connection (ThreadingHTTPServer): the limit is on requests being handled.
        self.max_concurrent_requests = max_concurrent_requests
        self.admission = threading.BoundedSemaphore(max_concurrent_requests)


class _Server6(_Server):
    address_family = socket.AF_INET6


class HttpReceiver(ServerThread):
    """Owns one threaded HTTP server; `port` is the bound port (useful with port 0)."""

    def __init__(self, handler: OtlpIntake, host: str, port: int, *,
                 auth: BearerAuth = BearerAuth(), tls: TlsConfig = TlsConfig(),
                 readiness: Callable[[], tuple[bool, str]] = lambda: (True, "ready"),
                 reuse_port: bool = False, max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS):
        server_cls = _Server6 if ":" in host else _Server
        server = server_cls((host, port), handler, auth, readiness, handler.stats, reuse_port,
                            max_concurrent_requests)
        if tls.enabled:
            # The handshake runs on the handler thread, never on the accept loop.
            server.socket = tls.server_context().wrap_socket(
                server.socket, server_side=True, do_handshake_on_connect=False)
        super().__init__(server, host, "traceml-otlp-http")
