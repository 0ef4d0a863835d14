"""OTLP/gRPC receiver: TraceService and MetricsService on one server.

The receive limit is raised (collectors batch beyond grpcio's 4 MiB default);
gzip is handled by gRPC itself. Back-pressure and uncommitted batches answer
UNAVAILABLE, which OTLP clients retry with back-off; a missing or wrong bearer
token answers UNAUTHENTICATED.
"""
from __future__ import annotations

import logging
from concurrent import futures

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from traceml.processor.export_handler import ExportHandler
from traceml.processor.ingest import Backpressure, IngestUnavailable
from traceml.processor.security import BearerAuth, TlsConfig

LOG = logging.getLogger(__name__)

MAX_RECEIVE_BYTES = 64 * 1024 * 1024


def _authorise(context, auth: BearerAuth) -> None:
    if not auth.enabled:
        return
    metadata = dict(context.invocation_metadata())
    if not auth.allows(metadata.get("authorization")):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


def _call(context, auth: BearerAuth, handle, request):
    _authorise(context, auth)
    try:
        return handle(request)
    except Backpressure as exc:
        context.abort(grpc.StatusCode.UNAVAILABLE, f"back-pressure: {exc}")
    except IngestUnavailable as exc:
        context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, handler: ExportHandler, auth: BearerAuth):
        self._handler, self._auth = handler, auth

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        return _call(context, self._auth, self._handler.traces, request)


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, handler: ExportHandler, auth: BearerAuth):
        self._handler, self._auth = handler, auth

    def Export(self, request, context):  # noqa: N802
        return _call(context, self._auth, self._handler.metrics, request)


class GrpcReceiver:
    """Owns one `grpc.Server`; `port` is the bound port (useful with port 0)."""

    def __init__(self, handler: ExportHandler, host: str, port: int, *,
                 auth: BearerAuth = BearerAuth(), tls: TlsConfig = TlsConfig(), workers: int = 8,
                 reuse_port: bool = False):
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="traceml-otlp-grpc"),
            options=[
                ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
                ("grpc.max_send_message_length", 4 * 1024 * 1024),
                ("grpc.so_reuseport", 1 if reuse_port else 0),  # shared by ingest workers only
            ],
            # Beyond this, RESOURCE_EXHAUSTED (retryable): bounds memory held by queued requests.
            maximum_concurrent_rpcs=workers * 16,
        )
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(handler, auth), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsService(handler, auth), self._server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if tls.enabled:
            credentials = grpc.ssl_server_credentials([tls.pem_pair()])
            self.port = self._server.add_secure_port(address, credentials)
        else:
            self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind OTLP/gRPC to {address}")
        self.host = host

    def start(self) -> None:
        self._server.start()

    def stop(self, grace_s: float = 5.0) -> None:
        self._server.stop(grace_s).wait(grace_s + 1)
