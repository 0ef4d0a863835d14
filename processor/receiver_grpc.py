"""OTLP/gRPC receiver: TraceService and MetricsService on one server.

The receive limit is raised (collectors batch beyond grpcio's 4 MiB default);
gzip is handled by gRPC itself. Back-pressure and uncommitted batches answer
UNAVAILABLE, which OTLP clients retry with back-off; a missing or wrong bearer
token answers UNAUTHENTICATED; a body that is not protobuf INVALID_ARGUMENT
(counted `undecodable`, as HTTP counts its 400s).
"""
from __future__ import annotations

import logging
from concurrent import futures

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb2

from traceml.processor.ingest import Backpressure, IngestUnavailable
from traceml.processor.otlp_intake import OtlpIntake
from traceml.processor.security import BearerAuth, TlsConfig
from traceml.schema.vocabulary import SIGNAL_METRICS, SIGNAL_TRACES

LOG = logging.getLogger(__name__)

MAX_RECEIVE_BYTES = 64 * 1024 * 1024


def _authorise(context, auth: BearerAuth) -> None:
    if not auth.enabled:
        return
    metadata = dict(context.invocation_metadata())
    if not auth.allows(metadata.get("authorization")):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


# Requests arrive as raw bytes (no request deserializer) and are parsed here, so a
# body that is not protobuf is answered INVALID_ARGUMENT and counted `undecodable`
# like an HTTP 400, instead of grpcio answering INTERNAL and logging a traceback.
_SERVICES = (
    ("opentelemetry.proto.collector.trace.v1.TraceService", trace_pb2.ExportTraceServiceRequest, SIGNAL_TRACES),
    ("opentelemetry.proto.collector.metrics.v1.MetricsService", metrics_pb2.ExportMetricsServiceRequest,
     SIGNAL_METRICS),
)


def _export_method(handler: OtlpIntake, auth: BearerAuth, message_cls, signal: str):
    handle = handler.traces if signal == SIGNAL_TRACES else handler.metrics

    def export(body: bytes, context):
        _authorise(context, auth)
        request = message_cls()
        try:
            request.ParseFromString(body)
        except (DecodeError, RecursionError) as exc:
            handler.stats.add("undecodable", signal, 1)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable {signal} request: {exc}")
        try:
            return handle(request)
        except Backpressure as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"back-pressure: {exc}")
        except IngestUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    return grpc.unary_unary_rpc_method_handler(
        export, request_deserializer=None, response_serializer=lambda response: response.SerializeToString())


def _generic_handlers(handler: OtlpIntake, auth: BearerAuth) -> list:
    return [grpc.method_handlers_generic_handler(service, {"Export": _export_method(handler, auth, cls, signal)})
            for service, cls, signal in _SERVICES]


class GrpcReceiver:
    """Owns one `grpc.Server`; `port` is the bound port (useful with port 0)."""

    def __init__(self, handler: OtlpIntake, host: str, port: int, *,
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
        self._server.add_generic_rpc_handlers(_generic_handlers(handler, auth))
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
