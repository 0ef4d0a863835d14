"""Sends encoded OTLP requests over gRPC or HTTP/protobuf with bounded, counted retries.

One job: deliver one request before a deadline. Each signal goes where its own
settings say (`SignalSettings`: endpoint, protocol, TLS and mTLS files, headers,
compression, timeout); `make_transport` routes each signal to its transport, and
two signals with identical settings share one (one gRPC channel).

Retries follow the OTLP specification and the Collector's exporter, the peer a
user's Collector is: transient failures are gRPC CANCELLED, DEADLINE_EXCEEDED,
ABORTED, OUT_OF_RANGE, UNAVAILABLE, DATA_LOSS, and RESOURCE_EXHAUSTED only when
the server says recovery is possible with a `google.rpc.RetryInfo`; HTTP 429, 502,
503, 504 and connection errors. They are retried with exponential backoff and
jitter, waiting at least what the server asked for (`RetryInfo.retry_delay`, the
HTTP `Retry-After` in seconds or as an HTTP date), while the deadline allows and
the exporter is not stopping: a wait that would end past the deadline is not
started. Every retry and every final failure is reported to the caller, which
counts them. Nothing here raises: the outcome says what happened.
"""
from __future__ import annotations

import email.utils
import gzip
import http.client
import logging
import random
import ssl
import threading
import time
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from traceml.schema import vocabulary as v
from traceml.schema.hosts import is_loopback
from traceml.schema import distribution

from .settings import COMPRESSION_GZIP, PROTOCOL_GRPC, ExporterSettings, SignalSettings

_log = logging.getLogger("traceml.exporter")

_FIRST_BACKOFF_S = 0.25
_MAX_BACKOFF_S = 4.0
_RETRYABLE_HTTP = frozenset({429, 502, 503, 504})
_STATUS_DETAILS_KEY = "grpc-status-details-bin"  # a google.rpc.Status, where gRPC servers put details
_RETRY_INFO_KEY = "google.rpc.retryinfo-bin"  # a bare RetryInfo, which the OTel Python SDK also reads
_TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_METRICS_EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


def _serialized(request) -> bytes:
    """A request's bytes: a protobuf message or an already serialised `encoding.EncodedRequest`."""
    return request.SerializeToString()


@dataclass(frozen=True, slots=True)
class ExportOutcome:
    """What became of one request: delivered or not, retries spent, items the peer rejected."""

    delivered: bool
    retries: int = 0
    rejected: int = 0
    error: str | None = None


class _RetryLoop:
    """Shared retry policy: exponential backoff with jitter, at least the server's delay,
    cut short by the deadline or stop."""

    def __init__(self, stop: threading.Event):
        self._stop = stop

    def wait(self, attempt: int, deadline: float, server_delay_s: float | None = None) -> bool:
        """Sleep before retry `attempt` (1-based); False when no retry fits or we are stopping."""
        backoff = min(_MAX_BACKOFF_S, _FIRST_BACKOFF_S * 2 ** (attempt - 1)) * random.uniform(0.8, 1.2)
        if server_delay_s is not None:
            backoff = max(backoff, server_delay_s)
        if self._stop.is_set() or time.monotonic() + backoff >= deadline:
            return False
        return not self._stop.wait(backoff)


def _read_pem(path: str | None, what: str) -> bytes | None:
    """A PEM file's bytes, or None (and a warning) when it cannot be read: TLS then goes on
    without it, and the handshake, not the training process, fails if it was needed."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        _log.warning("traceml: %s %r cannot be read (%s); it is ignored", what, path, exc.strerror or exc)
        return None


def _client_pair(settings: SignalSettings) -> tuple[str, str] | None:
    """(certificate file, key file) for mTLS, or None; one without the other is ignored with a warning."""
    cert, key = settings.client_certificate_file, settings.client_key_file
    if bool(cert) != bool(key):
        _log.warning("traceml: an OTLP client %s is set without a client %s; mTLS is not used",
                     "certificate" if cert else "key", "key" if cert else "certificate")
        return None
    return (cert, key) if cert and key else None


def grpc_retry_delay_s(error) -> float | None:
    """`google.rpc.RetryInfo.retry_delay` of a failed call in seconds, or None when it carries none.

    The standard carrier is the `grpc-status-details-bin` trailer, a `google.rpc.Status`
    whose details hold the RetryInfo (what grpc-go's `status.WithDetails`, hence the
    Collector, sends); a bare `google.rpc.retryinfo-bin` trailer is read too.
    """
    try:
        trailers = dict(error.trailing_metadata() or ())
    except Exception:
        return None
    try:
        from google.rpc import error_details_pb2, status_pb2
    except ImportError:  # googleapis-common-protos missing: no RetryInfo can be read
        return None
    info = None
    try:
        if _STATUS_DETAILS_KEY in trailers:
            status = status_pb2.Status.FromString(trailers[_STATUS_DETAILS_KEY])
            for detail in status.details:
                if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    info = error_details_pb2.RetryInfo()
                    detail.Unpack(info)
                    break
        if info is None and _RETRY_INFO_KEY in trailers:
            info = error_details_pb2.RetryInfo.FromString(trailers[_RETRY_INFO_KEY])
    except Exception:  # a malformed detail is no RetryInfo
        return None
    if info is None:
        return None
    return max(0.0, info.retry_delay.seconds + info.retry_delay.nanos / 1e9)


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """An HTTP `Retry-After` value (delay-seconds or an HTTP date) as seconds from now, or None."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def user_agent() -> str:
    """What both transports send as User-Agent (`distribution.user_agent`): TraceML's exporter and its
    version. gRPC appends its own `grpc-python/...` after it."""
    return distribution.user_agent("OTLP-Exporter")


class GrpcTransport:
    """Both signals' services on one gRPC channel, built from one signal's settings."""

    def __init__(self, settings: SignalSettings, stop: threading.Event):
        import grpc

        self._grpc = grpc
        self._settings = settings
        self._timeout_s = settings.timeout_s
        self._metadata = tuple(settings.headers) or None
        self._retry = _RetryLoop(stop)
        c = grpc.StatusCode
        self._retryable = frozenset({c.UNAVAILABLE, c.DEADLINE_EXCEEDED, c.ABORTED, c.CANCELLED,
                                     c.OUT_OF_RANGE, c.DATA_LOSS})
        self._exhausted = c.RESOURCE_EXHAUSTED
        self._channel = None
        self._connect()

    def _connect(self) -> None:
        """Build the channel and the two services' stubs (at start, and again after `release`)."""
        grpc, settings = self._grpc, self._settings
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        compression = (grpc.Compression.Gzip if settings.compression == COMPRESSION_GZIP
                       else grpc.Compression.NoCompression)
        # gRPC's default reconnect backoff grows to 120 s: after a collector restart the channel
        # would keep failing fast for minutes. Cap it so export resumes within seconds.
        options = [("grpc.max_send_message_length", 64 * 1024 * 1024),
                   ("grpc.initial_reconnect_backoff_ms", 250),
                   ("grpc.min_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", 2000),
                   ("grpc.primary_user_agent", user_agent())]
        if settings.uses_tls:
            pair = _client_pair(settings)
            key = cert = None
            if pair is not None:
                cert, key = _read_pem(pair[0], "client certificate"), _read_pem(pair[1], "client key")
                if cert is None or key is None:
                    cert = key = None
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_pem(settings.certificate_file, "CA certificate"),
                private_key=key, certificate_chain=cert)
            self._channel = grpc.secure_channel(settings.grpc_target, credentials,
                                                options=options, compression=compression)
        else:
            self._channel = grpc.insecure_channel(settings.grpc_target, options=options, compression=compression)
        # The generated stubs' serializer is the message class's own, which refuses a request the
        # exporter already wrote as bytes (encoding.EncodedRequest); each request serialises itself.
        self._stubs = {
            v.SIGNAL_TRACES: self._channel.unary_unary(
                _TRACE_EXPORT, request_serializer=_serialized,
                response_deserializer=trace_service_pb2.ExportTraceServiceResponse.FromString),
            v.SIGNAL_METRICS: self._channel.unary_unary(
                _METRICS_EXPORT, request_serializer=_serialized,
                response_deserializer=metrics_service_pb2.ExportMetricsServiceResponse.FromString),
        }

    def release(self) -> None:
        """Close the channel while the exporter idles: an open gRPC channel keeps grpc's timer and
        poller threads waking (about 0.1 % of a core here). The next export connects again."""
        if self._channel is not None:
            self.close()
            self._channel = None

    def export(self, signal: str, request, deadline: float) -> ExportOutcome:
        if self._channel is None:
            try:
                self._connect()
            except Exception as exc:  # a channel that cannot be built is a failed export, never a crash
                self._channel = None
                return ExportOutcome(False, 0, error=f"{type(exc).__name__}: {exc}")
        stub = self._stubs[signal]
        deadline = min(deadline, time.monotonic() + self._timeout_s)
        retries = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ExportOutcome(False, retries, error="deadline passed before sending")
            try:
                response = stub(request, metadata=self._metadata, timeout=remaining)
                return ExportOutcome(True, retries, _rejected(signal, response))
            except self._grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                error = f"gRPC {getattr(code, 'name', code)}: {exc.details() if hasattr(exc, 'details') else exc}"
                delay = grpc_retry_delay_s(exc) if hasattr(exc, "trailing_metadata") else None
                # RESOURCE_EXHAUSTED is retryable only when the server says recovery is possible.
                retryable = code in self._retryable or (code == self._exhausted and delay is not None)
                if not retryable or not self._retry.wait(retries + 1, deadline, delay):
                    return ExportOutcome(False, retries, error=error)
                retries += 1
            except Exception as exc:  # an unexpected client error is a failed export, never a crash
                return ExportOutcome(False, retries, error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        try:
            if self._channel is not None:
                self._channel.close()
        except Exception:
            pass


def http_client_options(settings: SignalSettings, tls: bool) -> tuple[dict[str, str], object, tuple[str, str] | None]:
    """What a `requests` call to the processor takes from one signal's settings: the headers (the
    configured ones, the token among them, and User-Agent unless configured), `verify` (the CA file,
    else the system's) and the client pair for mTLS (when `tls`). One owner for the OTLP/HTTP
    transport and the deep-capture control client (`control`), so both authenticate alike."""
    headers = {k: val for k, val in settings.headers}
    if "user-agent" not in headers:  # configured headers are lower-cased: one set there wins
        headers["User-Agent"] = user_agent()
    # requests reads the files itself; an unreadable one is left out here, as over gRPC.
    ca = settings.certificate_file
    verify = ca if ca and _read_pem(ca, "CA certificate") is not None else True
    pair = _client_pair(settings) if tls else None
    if pair is not None and (_read_pem(pair[0], "client certificate") is None
                             or _read_pem(pair[1], "client key") is None):
        pair = None
    return headers, verify, pair


class KeptAliveConnection:
    """One kept-alive HTTP(S) connection to one server through `http.client`: a request costs the
    calling thread (and so, through the GIL, the training thread) a fraction of what a `requests`
    call does (docs/performance.md). Used for the deep-capture polls (`control`) and for OTLP/HTTP
    to a plain `http://` endpoint that no proxy variable covers (`HttpTransport`).

    `verify` (a CA file, or True for the system's) and `cert` (a client pair) are
    `http_client_options`' for HTTPS."""

    def __init__(self, base_url: str, verify=True, cert=None) -> None:
        parts = urlsplit(base_url)
        self._https = parts.scheme.lower() == "https"
        self._host, self._port = parts.hostname, parts.port
        self.prefix = parts.path.rstrip("/")
        self._context = None
        if self._https:
            self._context = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
            if cert is not None:
                self._context.load_cert_chain(cert[0], cert[1])
        self._conn = None

    def request(self, method: str, target: str, headers: dict, timeout_s: float, body: bytes | None = None,
                max_bytes: int = 1 << 20) -> tuple[int, http.client.HTTPMessage, bytes]:
        """(status, headers, at most `max_bytes` + 1 of the body) of one request; raises OSError or
        http.client.HTTPException (the connection is then dropped and made again by the next call).
        A kept-alive connection the server closed meanwhile (its idle timeout) is replaced once, at
        once: that is no failed request."""
        if self._conn is not None:
            try:
                return self._request(method, target, headers, timeout_s, body, max_bytes)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                pass  # closed by the peer while idle; _request dropped it
        return self._request(method, target, headers, timeout_s, body, max_bytes)

    def _request(self, method, target, headers, timeout_s, body, max_bytes):
        conn = self._conn
        if conn is None:
            conn = self._conn = (http.client.HTTPSConnection(self._host, self._port, timeout=timeout_s,
                                                             context=self._context) if self._https
                                 else http.client.HTTPConnection(self._host, self._port, timeout=timeout_s))
        elif conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        try:
            conn.request(method, self.prefix + target, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read(max_bytes + 1)
            if response.will_close or not response.isclosed():
                self.close()
            return response.status, response.headers, data
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass


def direct_http(url: str) -> bool:
    """A plain `http://` URL that `KeptAliveConnection` reaches: a loopback address (this
    machine's: a proxy could not reach it for us; `traceml run`'s own processor is one), or one
    that no proxy variable (HTTP_PROXY, NO_PROXY: what `requests` reads) sends through a proxy.
    HTTPS stays with `requests`, whose trust store (certifi, REQUESTS_CA_BUNDLE) users of an
    OTLP/HTTP exporter configure, and so does a URL with a query (the connection posts to a path)."""
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme.lower() != "http" or not host or parts.query:
        return False
    if is_loopback(host) or not urllib.request.getproxies().get("http"):
        return True
    return bool(urllib.request.proxy_bypass(host))


class HttpTransport:
    """One signal's OTLP/HTTP endpoint: POSTs protobuf to `settings.endpoint` on a kept-alive
    connection (`KeptAliveConnection` where `direct_http`, else a `requests` session)."""

    def __init__(self, settings: SignalSettings, stop: threading.Event):
        self._url = settings.endpoint
        self._direct = KeptAliveConnection(self._url) if direct_http(self._url) else None
        if self._direct is None:
            import requests

            self._requests = requests
            self._session = requests.Session()
        self._timeout_s = settings.timeout_s
        self._headers, self._verify, self._cert = http_client_options(settings, settings.uses_tls)
        self._headers["Content-Type"] = "application/x-protobuf"
        self._gzip = settings.compression == COMPRESSION_GZIP
        if self._gzip:
            self._headers["Content-Encoding"] = "gzip"
        self._retry = _RetryLoop(stop)

    def export(self, signal: str, request, deadline: float) -> ExportOutcome:
        body = request.SerializeToString()
        if self._gzip:
            body = gzip.compress(body, compresslevel=5)
        deadline = min(deadline, time.monotonic() + self._timeout_s)
        retries = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ExportOutcome(False, retries, error="deadline passed before sending")
            delay = None
            try:
                status, headers, content = self._post(body, remaining)
                if status == 200:
                    return ExportOutcome(True, retries, _rejected_http(signal, content))
                retryable = status in _RETRYABLE_HTTP
                if retryable:
                    delay = retry_after_s(headers.get("Retry-After"))
                error = f"HTTP {status}: {content[:200].decode('utf-8', 'replace')}"
            except Exception as exc:
                retryable, error = self._retryable(exc), f"{type(exc).__name__}: {exc}"
            if not retryable or not self._retry.wait(retries + 1, deadline, delay):
                return ExportOutcome(False, retries, error=error)
            retries += 1

    def _retryable(self, exc: Exception) -> bool:
        """Whether a POST that raised is retried: a failed connection or a timeout is (for the
        direct connection every socket or HTTP-framing error: plain HTTP has no other kind);
        anything else is not."""
        if self._direct is not None:
            return isinstance(exc, (OSError, http.client.HTTPException))
        errors = self._requests.exceptions
        return isinstance(exc, (errors.ConnectionError, errors.Timeout))

    def _post(self, body: bytes, timeout_s: float):
        """(status, headers, body) of one POST of `body`."""
        if self._direct is not None:
            return self._direct.request("POST", "", self._headers, timeout_s, body)
        response = self._session.post(self._url, data=body, headers=self._headers,
                                      timeout=timeout_s, verify=self._verify, cert=self._cert)
        return response.status_code, response.headers, response.content

    def close(self) -> None:
        try:
            if self._direct is not None:
                self._direct.close()
            else:
                self._session.close()
        except Exception:
            pass


class SignalRoutes:
    """The exporter's transport: each signal to the transport its own settings built."""

    def __init__(self, settings: ExporterSettings, stop: threading.Event):
        built: dict[SignalSettings, GrpcTransport | HttpTransport] = {}
        self._routes = {}
        for signal in v.EXPORTED_SIGNALS:
            signal_settings = settings.signal(signal)
            if signal_settings not in built:
                built[signal_settings] = (GrpcTransport(signal_settings, stop)
                                          if signal_settings.protocol == PROTOCOL_GRPC
                                          else HttpTransport(signal_settings, stop))
            self._routes[signal] = built[signal_settings]
        self._transports = list(built.values())

    def export(self, signal: str, request, deadline: float) -> ExportOutcome:
        return self._routes[signal].export(signal, request, deadline)

    def release(self) -> None:
        """Let go of what costs while nothing is sent (a gRPC channel's threads); exports reconnect."""
        for transport in self._transports:
            release = getattr(transport, "release", None)
            if release is not None:
                release()

    def close(self) -> None:
        for transport in self._transports:
            transport.close()


def make_transport(settings: ExporterSettings, stop: threading.Event) -> SignalRoutes:
    return SignalRoutes(settings, stop)


def _rejected(signal: str, response) -> int:
    partial = getattr(response, "partial_success", None)
    if partial is None:
        return 0
    return int(partial.rejected_spans if signal == v.SIGNAL_TRACES else partial.rejected_data_points)


def _rejected_http(signal: str, content: bytes) -> int:
    if not content:
        return 0
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    message = (trace_service_pb2.ExportTraceServiceResponse() if signal == v.SIGNAL_TRACES
               else metrics_service_pb2.ExportMetricsServiceResponse())
    try:
        message.ParseFromString(content)
    except Exception:
        return 0
    return _rejected(signal, message)
