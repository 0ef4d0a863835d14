"""OTLP/HTTP receiver: POST /v1/traces, /v1/metrics and /v1/logs, plus /healthz and /readyz.

The service mounts more on the same port and front: the web view (`/ui`) and the deep-capture
paths (`processor.capture.routes`, whose trace upload reads up to its own cap).

The routes run on the bounded HTTP/1.1 front of `http_front.HttpFront` (h11 on an
asyncio loop: header and body timeouts, a connection cap, framing errors close
the connection); this module decides what each request gets.

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
import zlib
from typing import Callable

from google.protobuf.message import DecodeError
from google.rpc import status_pb2
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as logs_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb2

from traceml.processor.otlp_read import otlp_json_response, parse_otlp_json, read_otlp_protobuf
from traceml.processor.ingest import DEFAULT_MAX_CONCURRENT_REQUESTS, RETRY_AFTER_S, Backpressure, IngestUnavailable
from traceml.processor.otlp_intake import OtlpIntake
from traceml.processor.security import BearerAuth, TlsConfig
from traceml.processor.http_front import Accept, HttpFront, HttpLimits, Reply, RequestHead
from traceml.processor.listener import ServerThread
from traceml.schema import vocabulary as v
from traceml.schema.vocabulary import SIGNAL_LOGS, SIGNAL_METRICS, SIGNAL_TRACES

LOG = logging.getLogger(__name__)

MAX_BODY_BYTES = 20 * 1024 * 1024
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_RETRY_LATER = {"Retry-After": str(RETRY_AFTER_S)}

_ROUTES = {
    "/v1/traces": (trace_pb2.ExportTraceServiceRequest, SIGNAL_TRACES),
    "/v1/metrics": (metrics_pb2.ExportMetricsServiceRequest, SIGNAL_METRICS),
    "/v1/logs": (logs_pb2.ExportLogsServiceRequest, SIGNAL_LOGS),
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


class OtlpHttpApp:
    """The receiver's routes, as the HTTP front calls them: request head -> `Reply` or `Accept`.

    Called on the front's loop, so everything before the body (route, bearer token,
    content type, admission) is decided without reading it; decoding and the
    intake run in the front's pool, one thread per admitted request. GET routes
    live in `get_routes` (path -> callable(head) -> `Reply` or `Accept`), so
    another page can be mounted with `add_get_route`.
    """

    def __init__(self, handler: OtlpIntake, auth: BearerAuth, readiness: Callable[[], tuple[bool, str]], stats,
                 max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS):
        if max_concurrent_requests < 1:
            raise ValueError("the concurrent-request limit must be at least 1")
        self.handler = handler
        self.auth = auth
        self.readiness = readiness
        self.stats = stats
        self.max_concurrent_requests = max_concurrent_requests
        self.in_flight = 0  # admitted export requests; only the loop thread touches it
        self.get_routes: dict[str, Callable[[RequestHead], Reply | Accept]] = {
            "/healthz": lambda head: Reply(200, b"ok\n"),
            "/readyz": self._readyz,
        }

        self.mounts: dict[str, Callable[[RequestHead], Reply | Accept]] = {}  # prefix -> route

    def add_get_route(self, path: str, route: Callable[[RequestHead], Reply | Accept]) -> None:
        """Serve GET/HEAD `path` with `route` (on the loop: return `Accept` for work that blocks)."""
        self.get_routes[path] = route

    def mount(self, prefix: str, route: Callable[[RequestHead], Reply | Accept]) -> None:
        """Serve every request for `prefix` and the paths below it with `route` (the web view's `/ui`)."""
        self.mounts[prefix.rstrip("/")] = route

    def _mounted(self, path: str) -> Callable[[RequestHead], Reply | Accept] | None:
        for prefix, route in self.mounts.items():
            if path == prefix or path.startswith(prefix + "/"):
                return route
        return None

    def _readyz(self, head: RequestHead) -> Reply:
        ready, detail = self.readiness()
        return Reply(200 if ready else 503, (detail + "\n").encode())

    def __call__(self, head: RequestHead) -> Reply | Accept:
        mounted = self._mounted(head.path)
        if mounted is not None:
            return mounted(head)
        if head.method in ("GET", "HEAD"):
            route = self.get_routes.get(head.path)
            return route(head) if route is not None else Reply(404, b"not found\n")
        if head.method != "POST":
            return Reply(405, b"method not allowed\n", headers=(("Allow", "GET, HEAD, POST"),))
        route = _ROUTES.get(head.path)
        content_type = head.headers.get("content-type", "").split(";")[0].strip().lower()
        answer_type = JSON if content_type == JSON else PROTOBUF
        if route is None:
            return _status_reply(404, f"no OTLP route {head.path}", answer_type)
        signal = route[1]
        if not self.auth.allows(head.headers.get("authorization")):
            self.stats.refused(signal, v.REFUSED_UNAUTHENTICATED)
            return _status_reply(401, "missing or wrong bearer token", answer_type, {"WWW-Authenticate": "Bearer"})
        if content_type not in (JSON, PROTOBUF):
            self.stats.refused(signal, v.REFUSED_UNSUPPORTED)
            return _status_reply(415, f"unsupported content type {content_type!r}; use {PROTOBUF} or {JSON}",
                                 PROTOBUF)
        # Refused before the body is read, so requests over the limit hold no body in memory.
        if self.in_flight >= self.max_concurrent_requests:
            self.stats.refused(signal, v.REFUSED_OVER_LIMIT)
            return _status_reply(429, f"over the limit of {self.max_concurrent_requests} concurrent requests",
                                 answer_type, _RETRY_LATER)
        self.in_flight += 1
        encoding = head.headers.get("content-encoding", "identity").strip().lower()
        return Accept(handle=lambda body: self._export(route, content_type, answer_type, encoding, body),
                      error=lambda code, message: self._front_error(signal, code, message, answer_type),
                      release=self._release)

    def _front_error(self, signal: str, code: int, message: str, answer_type: str) -> Reply:
        """What the front found reading the body: too large (413), bad framing (400), too slow (408)."""
        if code == 413:
            self.stats.refused(signal, v.REFUSED_TOO_LARGE)
        elif code == 400:
            self.stats.refused(signal, v.REFUSED_UNDECODABLE)
        return _status_reply(code, message, answer_type)

    def _release(self) -> None:
        # Released before the answer is written: a client that has its answer
        # finds the slot free, and a slow reader holds no admission.
        self.in_flight -= 1

    def _export(self, route, content_type: str, answer_type: str, encoding: str, body: bytes) -> Reply:
        message_cls, signal = route
        try:
            if encoding == "gzip":
                body = gunzip_capped(body) if body else body
            elif encoding not in ("identity", ""):
                self.stats.refused(signal, v.REFUSED_UNSUPPORTED)
                return _status_reply(415, f"unsupported Content-Encoding {encoding!r}", answer_type)
            request = message_cls()
            if body:
                if content_type == JSON:
                    request = parse_otlp_json(body, request)  # what can be read of it
                else:
                    request = read_otlp_protobuf(body, message_cls)  # what can be read of it
        except BodyTooLarge as exc:
            self.stats.refused(signal, v.REFUSED_TOO_LARGE)
            return _status_reply(413, str(exc), answer_type)
        except (ValueError, DecodeError, RecursionError) as exc:
            self.stats.refused(signal, v.REFUSED_UNDECODABLE)
            return _status_reply(400, f"undecodable {signal} request: {exc}", answer_type)
        try:
            handle = self.handler.handler(signal)
            response = handle(request)
        except Backpressure as exc:
            return _status_reply(429, f"back-pressure: {exc}", answer_type, _RETRY_LATER)
        except IngestUnavailable as exc:
            return _status_reply(503, str(exc), answer_type, _RETRY_LATER)
        if answer_type == JSON:
            return Reply(200, otlp_json_response(response), JSON)
        return Reply(200, response.SerializeToString(), PROTOBUF)


def _status_reply(code: int, message: str, content_type: str, headers: dict | None = None) -> Reply:
    """An error answer: a `google.rpc.Status` in the request's encoding."""
    status = status_pb2.Status(code=_grpc_code(code), message=message)
    if content_type == JSON:
        body = otlp_json_response(status)
    else:
        body, content_type = status.SerializeToString(), PROTOBUF
    return Reply(code, body, content_type, tuple((headers or {}).items()))


def _grpc_code(http_code: int) -> int:
    return {400: 3, 401: 16, 404: 5, 408: 4, 413: 8, 415: 3, 429: 8, 500: 13, 503: 14}.get(http_code, 2)


class HttpReceiver(ServerThread):
    """Owns the OTLP/HTTP front; `port` is the bound port (useful with port 0).

    `app` holds the routes (`app.add_get_route` mounts another page); `front.events()`
    counts what the front refused, timed out or saw hang up.
    """

    def __init__(self, handler: OtlpIntake, host: str, port: int, *,
                 auth: BearerAuth = BearerAuth(), tls: TlsConfig = TlsConfig(),
                 readiness: Callable[[], tuple[bool, str]] = lambda: (True, "ready"),
                 reuse_port: bool = False, max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
                 limits: HttpLimits = HttpLimits()):
        self.app = OtlpHttpApp(handler, auth, readiness, handler.stats, max_concurrent_requests)
        # The TLS handshake runs on the connection, bounded by the header timeout, never on the accept path.
        self.front = HttpFront((host, port), self.app, limits=limits, pool_size=max_concurrent_requests,
                               max_body_bytes=MAX_BODY_BYTES,
                               tls_context=tls.server_context() if tls.enabled else None,
                               reuse_port=reuse_port, retry_after_s=RETRY_AFTER_S, name="traceml-otlp-http",
                               on_event=handler.stats.connection_event)
        super().__init__(self.front, host, "traceml-otlp-http")
