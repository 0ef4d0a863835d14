"""Sends encoded OTLP requests over gRPC or HTTP/protobuf with bounded, counted retries.

One job: deliver one request before a deadline. Transient failures (gRPC
UNAVAILABLE/RESOURCE_EXHAUSTED/..., HTTP 429/502/503/504, connection errors) are
retried with exponential backoff while the deadline allows and the exporter is
not stopping; every retry and every final failure is reported to the caller,
which counts them. Nothing here raises: the outcome says what happened.
"""
from __future__ import annotations

import gzip
import random
import threading
import time
from dataclasses import dataclass

from traceml.schema import vocabulary as v

from .settings import PROTOCOL_GRPC, ExporterSettings

_FIRST_BACKOFF_S = 0.25
_MAX_BACKOFF_S = 4.0
_RETRYABLE_HTTP = frozenset({429, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class ExportOutcome:
    """What became of one request: delivered or not, retries spent, items the peer rejected."""

    delivered: bool
    retries: int = 0
    rejected: int = 0
    error: str | None = None


class _RetryLoop:
    """Shared retry policy: exponential backoff with jitter, cut short by the deadline or stop."""

    def __init__(self, stop: threading.Event):
        self._stop = stop

    def wait(self, attempt: int, deadline: float) -> bool:
        """Sleep before retry `attempt` (1-based); False when no retry fits or we are stopping."""
        backoff = min(_MAX_BACKOFF_S, _FIRST_BACKOFF_S * 2 ** (attempt - 1)) * random.uniform(0.8, 1.2)
        if self._stop.is_set() or time.monotonic() + backoff >= deadline:
            return False
        return not self._stop.wait(backoff)


class GrpcTransport:
    def __init__(self, settings: ExporterSettings, stop: threading.Event):
        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        self._grpc = grpc
        compression = grpc.Compression.Gzip if settings.compression == "gzip" else grpc.Compression.NoCompression
        # gRPC's default reconnect backoff grows to 120 s: after a collector restart the channel
        # would keep failing fast for minutes. Cap it so export resumes within seconds.
        options = [("grpc.max_send_message_length", 64 * 1024 * 1024),
                   ("grpc.initial_reconnect_backoff_ms", 250),
                   ("grpc.min_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", 2000)]
        if settings.uses_tls:
            root = None
            if settings.certificate_file:
                with open(settings.certificate_file, "rb") as f:
                    root = f.read()
            self._channel = grpc.secure_channel(settings.grpc_target, grpc.ssl_channel_credentials(root),
                                                options=options, compression=compression)
        else:
            self._channel = grpc.insecure_channel(settings.grpc_target, options=options, compression=compression)
        self._stubs = {
            v.SIGNAL_TRACES: trace_service_pb2_grpc.TraceServiceStub(self._channel),
            v.SIGNAL_METRICS: metrics_service_pb2_grpc.MetricsServiceStub(self._channel),
        }
        self._metadata = tuple(settings.headers) or None
        self._retry = _RetryLoop(stop)
        c = grpc.StatusCode
        self._retryable = frozenset({c.UNAVAILABLE, c.RESOURCE_EXHAUSTED, c.DEADLINE_EXCEEDED, c.ABORTED,
                                     c.CANCELLED, c.OUT_OF_RANGE, c.DATA_LOSS})

    def export(self, signal: str, request, deadline: float) -> ExportOutcome:
        stub = self._stubs[signal]
        retries = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ExportOutcome(False, retries, error="deadline passed before sending")
            try:
                response = stub.Export(request, metadata=self._metadata, timeout=remaining)
                return ExportOutcome(True, retries, _rejected(signal, response))
            except self._grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                error = f"gRPC {getattr(code, 'name', code)}: {exc.details() if hasattr(exc, 'details') else exc}"
                if code not in self._retryable or not self._retry.wait(retries + 1, deadline):
                    return ExportOutcome(False, retries, error=error)
                retries += 1
            except Exception as exc:  # an unexpected client error is a failed export, never a crash
                return ExportOutcome(False, retries, error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        try:
            self._channel.close()
        except Exception:
            pass


class HttpTransport:
    _PATHS = {v.SIGNAL_TRACES: "v1/traces", v.SIGNAL_METRICS: "v1/metrics"}

    def __init__(self, settings: ExporterSettings, stop: threading.Event):
        import requests

        self._requests = requests
        self._session = requests.Session()
        self._urls = {signal: settings.signal_url(path) for signal, path in self._PATHS.items()}
        self._headers = {k: val for k, val in settings.headers}
        self._headers["Content-Type"] = "application/x-protobuf"
        self._gzip = settings.compression == "gzip"
        if self._gzip:
            self._headers["Content-Encoding"] = "gzip"
        self._verify = settings.certificate_file or True
        self._retry = _RetryLoop(stop)

    def export(self, signal: str, request, deadline: float) -> ExportOutcome:
        body = request.SerializeToString()
        if self._gzip:
            body = gzip.compress(body, compresslevel=5)
        retries = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ExportOutcome(False, retries, error="deadline passed before sending")
            try:
                response = self._session.post(self._urls[signal], data=body, headers=self._headers,
                                              timeout=remaining, verify=self._verify)
                if response.status_code == 200:
                    return ExportOutcome(True, retries, _rejected_http(signal, response.content))
                retryable = response.status_code in _RETRYABLE_HTTP
                error = f"HTTP {response.status_code}: {response.text[:200]}"
            except self._requests.exceptions.RequestException as exc:
                retryable = isinstance(exc, (self._requests.exceptions.ConnectionError,
                                             self._requests.exceptions.Timeout))
                error = f"{type(exc).__name__}: {exc}"
            except Exception as exc:
                return ExportOutcome(False, retries, error=f"{type(exc).__name__}: {exc}")
            if not retryable or not self._retry.wait(retries + 1, deadline):
                return ExportOutcome(False, retries, error=error)
            retries += 1

    def close(self) -> None:
        try:
            self._session.close()
        except Exception:
            pass


def make_transport(settings: ExporterSettings, stop: threading.Event):
    return GrpcTransport(settings, stop) if settings.protocol == PROTOCOL_GRPC else HttpTransport(settings, stop)


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
