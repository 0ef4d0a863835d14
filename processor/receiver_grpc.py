"""OTLP/gRPC receiver: TraceService, MetricsService and LogsService on one server.

The receive limit is raised (collectors batch beyond grpcio's 4 MiB default);
gzip is handled by gRPC itself. Every refusal that means "try later" (more calls
than the concurrent-call limit, a full ingest queue, an uncommitted batch)
answers UNAVAILABLE with a `google.rpc.RetryInfo` detail, which every OTLP client
retries after that delay; a missing or wrong bearer token answers
UNAUTHENTICATED before the body is read (`BearerTokenInterceptor`); a body that
is not protobuf INVALID_ARGUMENT. Each refusal is counted once, by reason, in
`self_telemetry` (the ingest queue counts its own back-pressure and
unavailable refusals).
"""
from __future__ import annotations

import logging
import random
import threading
from concurrent import futures

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as logs_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb2

from traceml.processor.ingest import DEFAULT_MAX_CONCURRENT_REQUESTS, RETRY_AFTER_S, Backpressure, IngestUnavailable
from traceml.processor.otlp_intake import OtlpIntake
from traceml.processor.settings import GRPC_THREADS
from traceml.processor.otlp_read import read_otlp_protobuf
from traceml.processor.security import BearerAuth, TlsConfig
from traceml.processor.self_telemetry import SelfTelemetry
from traceml.schema import vocabulary as v
from traceml.schema.vocabulary import SIGNAL_LOGS, SIGNAL_METRICS, SIGNAL_TRACES

LOG = logging.getLogger(__name__)

MAX_RECEIVE_BYTES = 64 * 1024 * 1024

# The standard place of a status's details (a serialised `google.rpc.Status`), which
# the Collector's OTLP exporter and the Go, Java and .NET SDKs read.
STATUS_DETAILS_KEY = "grpc-status-details-bin"
# The OTel Python SDK's gRPC exporter reads its retry delay from this trailer instead
# (a bare serialised RetryInfo), so the advice is sent both ways.
PYTHON_SDK_RETRY_INFO_KEY = "google.rpc.retryinfo-bin"


def retry_info(delay_s: float) -> error_details_pb2.RetryInfo:
    info = error_details_pb2.RetryInfo()
    info.retry_delay.FromNanoseconds(int(delay_s * 1e9))
    return info


def refuse_for_now(context, message: str) -> None:
    """Abort the call with UNAVAILABLE and a RetryInfo detail: the client retries later.

    UNAVAILABLE, not RESOURCE_EXHAUSTED: OTLP says a server signals back-pressure
    with UNAVAILABLE, which every client retries, while RESOURCE_EXHAUSTED is
    retried by the Collector only with RetryInfo. The delay is `RETRY_AFTER_S`
    spread by +-50 %: clients wait exactly the advised time, so one fixed value
    would bring every refused client back in the same instant.
    """
    info = retry_info(RETRY_AFTER_S * random.uniform(0.5, 1.5))
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=message, details=[detail])
    context.set_trailing_metadata(((STATUS_DETAILS_KEY, status.SerializeToString()),
                                   (PYTHON_SDK_RETRY_INFO_KEY, info.SerializeToString())))
    context.abort(grpc.StatusCode.UNAVAILABLE, message)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Checks the bearer token on a call's metadata, before anything reads its body.

    grpcio runs interceptors when a call arrives, with its metadata only. An
    unauthenticated call gets a client-streaming refusal handler (the wire does
    not tell unary from streaming): grpcio hands such a behaviour an iterator
    instead of reading and deserialising the message first, as it does for a
    unary one, and the iterator is never advanced, so the body is never
    requested from the transport. The refusal runs on the receiver's own small
    lane (`pool`), never behind admitted calls and never taking an admission
    slot, so refused calls end at once and release what the transport buffered
    for them (at most its flow-control window). With the check in the handler,
    40 concurrent 50 MiB calls with a wrong token took the process from 44 MiB
    to 1.25 GiB; see tests/reliability/test_unauthenticated_bytes.py.
    """

    def __init__(self, auth: BearerAuth, stats: SelfTelemetry, pool: futures.ThreadPoolExecutor):
        self._auth = auth
        self._stats = stats

        def refuse(request_iterator, context) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        # grpcio runs a behaviour on its `experimental_thread_pool` when it has one
        # (else on the server's pool, where a refusal would still be correct).
        refuse.experimental_thread_pool = pool
        self._refusal = grpc.stream_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation, handler_call_details):
        authorization = next((value for key, value in handler_call_details.invocation_metadata or ()
                              if key == "authorization"), None)
        if self._auth.allows(authorization if isinstance(authorization, str) else None):
            return continuation(handler_call_details)
        signal = _SIGNAL_OF_METHOD.get(handler_call_details.method)
        if signal is None:
            return continuation(handler_call_details)  # not an OTLP export: UNIMPLEMENTED, body unread
        self._stats.refused(signal, v.REFUSED_UNAUTHENTICATED)
        return self._refusal


_LANE = threading.local()
"""`refusal` on a thread of the refusal lane: why the call it runs is refused."""


def _run_refused(message: str, fn, args, kwargs):
    _LANE.refusal = message
    try:
        return fn(*args, **kwargs)
    finally:
        _LANE.refusal = None


class AdmissionPool(futures.ThreadPoolExecutor):
    """grpcio's thread pool, which also admits or refuses each call as it arrives.

    grpcio hands every call to `submit` on its serving thread the moment the call
    arrives, and the submitted function always runs (also when the client has gone
    and the handler is skipped), so this is the one place that sees a call from
    arrival to its end. Up to `limit` calls are admitted (running, or waiting for
    one of the `workers` threads); a call beyond that runs on a small lane of its
    own, where the handler refuses it at once (`refuse_for_now`) instead of
    waiting behind admitted work. grpcio's own limit (`maximum_concurrent_rpcs`)
    is not used: it answers RESOURCE_EXHAUSTED without RetryInfo, which a
    Collector drops as permanent. Memory stays bounded by the threads: a call's
    body is read only once a thread runs it.
    """

    def __init__(self, workers: int, limit: int, refusal_workers: int = 2):
        if limit < 1:
            raise ValueError("the concurrent-call limit must be at least 1")
        super().__init__(max_workers=workers, thread_name_prefix="traceml-otlp-grpc")
        self._refusals = futures.ThreadPoolExecutor(max_workers=refusal_workers,
                                                    thread_name_prefix="traceml-otlp-grpc-refusal")
        self.limit = limit
        self._lock = threading.Lock()
        self.admitted = 0  # calls admitted and not yet finished
        self.refused = 0  # calls refused since start

    def submit(self, fn, /, *args, **kwargs):
        with self._lock:
            admit = self.admitted < self.limit
            if admit:
                self.admitted += 1
            else:
                self.refused += 1
        if not admit:
            message = f"over the limit of {self.limit} concurrent calls"
            return self._refusals.submit(_run_refused, message, fn, args, kwargs)
        try:
            return super().submit(self._run_admitted, fn, args, kwargs)
        except BaseException:
            self._finished()
            raise

    def _run_admitted(self, fn, args, kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            self._finished()

    def _finished(self) -> None:
        with self._lock:
            self.admitted -= 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._refusals.shutdown(wait, cancel_futures=cancel_futures)
        super().shutdown(wait, cancel_futures=cancel_futures)


# Requests arrive as raw bytes (no request deserializer) and are parsed here, so a
# body that is not protobuf is answered INVALID_ARGUMENT and counted `undecodable`
# like an HTTP 400, instead of grpcio answering INTERNAL and logging a traceback.
_SERVICES = (
    ("opentelemetry.proto.collector.trace.v1.TraceService", trace_pb2.ExportTraceServiceRequest, SIGNAL_TRACES),
    ("opentelemetry.proto.collector.metrics.v1.MetricsService", metrics_pb2.ExportMetricsServiceRequest,
     SIGNAL_METRICS),
    ("opentelemetry.proto.collector.logs.v1.LogsService", logs_pb2.ExportLogsServiceRequest, SIGNAL_LOGS),
)
_SIGNAL_OF_METHOD = {f"/{service}/Export": signal for service, _, signal in _SERVICES}


def _export_method(handler: OtlpIntake, message_cls, signal: str):
    handle = handler.handler(signal)

    def export(body: bytes, context):
        refusal = getattr(_LANE, "refusal", None)
        if refusal is not None:
            handler.stats.refused(signal, v.REFUSED_OVER_LIMIT)
            refuse_for_now(context, refusal)
        try:
            request = read_otlp_protobuf(body, message_cls)  # what can be read of it
        except (DecodeError, RecursionError) as exc:
            handler.stats.refused(signal, v.REFUSED_UNDECODABLE)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable {signal} request: {exc}")
        try:
            return handle(request)
        except Backpressure as exc:  # counted by the ingest queue, which decided it
            refuse_for_now(context, f"back-pressure: {exc}")
        except IngestUnavailable as exc:
            refuse_for_now(context, str(exc))

    return grpc.unary_unary_rpc_method_handler(
        export, request_deserializer=None, response_serializer=lambda response: response.SerializeToString())


def _generic_handlers(handler: OtlpIntake) -> list:
    return [grpc.method_handlers_generic_handler(service, {"Export": _export_method(handler, cls, signal)})
            for service, cls, signal in _SERVICES]


class GrpcReceiver:
    """Owns one `grpc.Server`; `port` is the bound port (useful with port 0).

    `workers` threads handle calls; at most `max_concurrent_requests` calls are
    admitted at once (see `AdmissionPool`).
    """

    def __init__(self, handler: OtlpIntake, host: str, port: int, *,
                 auth: BearerAuth = BearerAuth(), tls: TlsConfig = TlsConfig(), workers: int = GRPC_THREADS,
                 max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS, reuse_port: bool = False):
        self.pool = AdmissionPool(workers, max_concurrent_requests)
        # Unauthenticated calls are refused on a lane of their own (BearerTokenInterceptor).
        self._auth_refusals = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="traceml-otlp-grpc-auth")
        interceptors = [BearerTokenInterceptor(auth, handler.stats, self._auth_refusals)] if auth.enabled else []
        self._server = grpc.server(
            self.pool,
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
                ("grpc.max_send_message_length", 4 * 1024 * 1024),
                ("grpc.so_reuseport", 1 if reuse_port else 0),  # shared by ingest workers only
            ],
        )
        self._server.add_generic_rpc_handlers(_generic_handlers(handler))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if tls.enabled:
            credentials = grpc.ssl_server_credentials([tls.pem_pair()])
            self.port = self._server.add_secure_port(address, credentials)
        else:
            self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            self.pool.shutdown(wait=False)
            self._auth_refusals.shutdown(wait=False)
            raise OSError(f"cannot bind OTLP/gRPC to {address}")
        self.host = host

    def start(self) -> None:
        self._server.start()

    def stop(self, grace_s: float = 5.0) -> None:
        self._server.stop(grace_s).wait(grace_s + 1)
        self.pool.shutdown(wait=False)
        self._auth_refusals.shutdown(wait=False)
