"""A real OTLP receiver for tests: gRPC and HTTP/protobuf servers on 127.0.0.1 (free ports).

Built only from `opentelemetry-proto` and grpcio/http.server; it stores every decoded
request (traces, metrics, and logs: a job's own SDK sends those) and can be switched at
run time to misbehave:
- `ok`: accept (200 / OK);
- `stall`: hold each request up to `stall_s` seconds, then accept;
- `error`: answer a retryable error (HTTP 503, gRPC UNAVAILABLE);
- `reject`: answer a permanent error (HTTP 400, gRPC INVALID_ARGUMENT);
- `throttle`: back-pressure (HTTP 503, gRPC UNAVAILABLE), `exhausted`: HTTP 429, gRPC
  RESOURCE_EXHAUSTED; both carry `retry_delay_s` when it is set (gRPC: a
  `google.rpc.RetryInfo` in the status details; HTTP: `Retry-After`, or `retry_after`
  verbatim). `failures_left` limits any failing mode to that many calls.

Helpers flatten what arrived into plain dicts keyed by (run id, rank, step), so
tests compare values exactly. Usable as a context manager.
"""
from __future__ import annotations

import gzip
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

MODES = ("ok", "stall", "error", "reject", "throttle", "exhausted")
_FAILING = ("error", "reject", "throttle", "exhausted")
MAX_BODY = 64 * 1024 * 1024


def any_value(value):
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind in ("array_value", "kvlist_value"):
        return str(getattr(value, kind))
    return getattr(value, kind)


def attributes(kvs) -> dict:
    return {kv.key: any_value(kv.value) for kv in kvs}


class OtlpTestReceiver:
    def __init__(self, mode: str = "ok", stall_s: float = 30.0, keep: bool = True, grpc_port: int = 0,
                 http_port: int = 0, tls: tuple | None = None):
        self.mode = mode
        self.tls = tls  # (certificate PEM path, key PEM path[, client CA PEM path]): both servers speak
        # TLS only; with a client CA they require a client certificate it signed (mTLS)
        self.retry_delay_s: float | None = None  # throttle/exhausted: the delay the answer asks for
        self.retry_after: str | None = None  # HTTP: a Retry-After value sent as it is (an HTTP date, say)
        self.failures_left: int | None = None  # a failing mode answers this many calls, then accepts
        self.call_times: list[float] = []  # time.monotonic() as each request arrived
        self.keep = keep  # False: count spans/points only (benchmarks), keep no requests
        self.span_count = 0
        self.point_count = 0
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self._released = threading.Event()
        self.trace_requests: list = []
        self.metric_requests: list = []
        self.log_requests: list = []
        self.calls = {"grpc": 0, "http": 0}
        self.last_headers: dict[str, str] = {}  # gRPC metadata or HTTP headers of the latest request (lower-case)
        self._grpc_server = None
        self._http_server = None
        self.grpc_port = grpc_port  # 0: any free port
        self.http_port = http_port  # 0: any free port

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> "OtlpTestReceiver":
        self._grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                                        options=[("grpc.max_receive_message_length", MAX_BODY)])
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceServicer(self), self._grpc_server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsServicer(self), self._grpc_server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(_LogsServicer(self), self._grpc_server)
        address = f"127.0.0.1:{self.grpc_port}"
        if self.tls is None:
            self.grpc_port = self._grpc_server.add_insecure_port(address)
        else:
            cert, key, *client_ca = (open(path, "rb").read() for path in self.tls)
            credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca[0] if client_ca
                                                      else None, require_client_auth=bool(client_ca))
            self.grpc_port = self._grpc_server.add_secure_port(address, credentials)
        self._grpc_server.start()
        self._http_server = ThreadingHTTPServer(("127.0.0.1", self.http_port), _http_handler(self))
        self._http_server.daemon_threads = True
        if self.tls is not None:
            import ssl

            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*map(str, self.tls[:2]))
            if len(self.tls) > 2:
                context.load_verify_locations(str(self.tls[2]))
                context.verify_mode = ssl.CERT_REQUIRED
            self._http_server.socket = context.wrap_socket(self._http_server.socket, server_side=True)
        self.http_port = self._http_server.server_address[1]
        # shutdown() waits for serve_forever to poll; at its default 0.5 s every test paid that at teardown.
        threading.Thread(target=self._http_server.serve_forever, kwargs={"poll_interval": 0.02},
                         name="otlp-test-http", daemon=True).start()
        return self

    def stop(self) -> None:
        self._released.set()  # free any stalled handler
        if self._grpc_server is not None:
            self._grpc_server.stop(grace=0.5).wait(2.0)
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def grpc_endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.http_port}"

    def release_stalls(self) -> None:
        self._released.set()

    # --- what arrived ---------------------------------------------------------------------

    def _accept(self, signal: str, request) -> str:
        """Record (in ok/stall mode) and return the mode that decided the answer."""
        with self._lock:
            self.call_times.append(time.monotonic())
            mode = self.mode
            if mode in _FAILING and self.failures_left is not None:
                if self.failures_left <= 0:
                    mode = "ok"
                else:
                    self.failures_left -= 1
        if mode == "stall":
            self._released.wait(self.stall_s)
        if mode in ("ok", "stall"):
            with self._lock:
                if signal == "logs":
                    if self.keep:
                        self.log_requests.append(request)
                    return mode
                if signal == "traces":
                    self.span_count += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                else:
                    self.point_count += sum(len(getattr(m, m.WhichOneof("data")).data_points)
                                            for rm in request.resource_metrics for sm in rm.scope_metrics
                                            for m in sm.metrics if m.WhichOneof("data"))
                if self.keep:
                    (self.trace_requests if signal == "traces" else self.metric_requests).append(request)
        return mode

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) for every span received, in arrival order."""
        with self._lock:
            requests = list(self.trace_requests)
        out = []
        for request in requests:
            for rs in request.resource_spans:
                res = attributes(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        out.append((res, span))
        return out

    def metric_points(self) -> list[tuple[dict, object, object]]:
        """(resource attributes, metric, data point) for every number point received."""
        with self._lock:
            requests = list(self.metric_requests)
        out = []
        for request in requests:
            for rm in request.resource_metrics:
                res = attributes(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        kind = metric.WhichOneof("data")
                        for point in getattr(metric, kind).data_points:
                            out.append((res, metric, point))
        return out

    def step_spans(self, name: str = "traceml.step") -> dict[tuple, dict]:
        """(run, rank, step) -> {"attributes", "resource", "start", "end", "span_id", "trace_id"}."""
        rows = {}
        for res, span in self.spans():
            if span.name != name:
                continue
            attrs = attributes(span.attributes)
            key = (attrs.get("traceml.run.id"), attrs.get("traceml.rank"), attrs.get("traceml.step"))
            rows[key] = {"attributes": attrs, "resource": res, "start": span.start_time_unix_nano,
                         "end": span.end_time_unix_nano, "span_id": span.span_id, "trace_id": span.trace_id,
                         "parent_span_id": span.parent_span_id}
        return rows

    def wait_for(self, predicate, timeout_s: float = 30.0, poll_s: float = 0.05) -> bool:
        """Poll until `predicate()` holds ("did not hang" bound, not a timing assertion)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if predicate():
                return True
            time.sleep(poll_s)
        return bool(predicate())


def _grpc_refuse(receiver: OtlpTestReceiver, mode: str, context) -> None:
    """Abort the call as `mode` says (returns for modes that accept)."""
    if mode == "error":
        context.abort(grpc.StatusCode.UNAVAILABLE, "test receiver: unavailable")
    if mode == "reject":
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "test receiver: rejected")
    if mode in ("throttle", "exhausted"):
        code = grpc.StatusCode.UNAVAILABLE if mode == "throttle" else grpc.StatusCode.RESOURCE_EXHAUSTED
        if receiver.retry_delay_s is not None:
            from google.protobuf import duration_pb2
            from google.rpc import error_details_pb2, status_pb2

            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(receiver.retry_delay_s * 1e9))
            status = status_pb2.Status(code=code.value[0], message=f"test receiver: {mode}")
            status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
            context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
        context.abort(code, f"test receiver: {mode}")


class _TraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpTestReceiver):
        self.receiver = receiver

    def Export(self, request, context):
        self.receiver.calls["grpc"] += 1
        self.receiver.last_headers = {k.lower(): val for k, val in context.invocation_metadata()}
        _grpc_refuse(self.receiver, self.receiver._accept("traces", request), context)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsServicer(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: OtlpTestReceiver):
        self.receiver = receiver

    def Export(self, request, context):
        self.receiver.calls["grpc"] += 1
        self.receiver.last_headers = {k.lower(): val for k, val in context.invocation_metadata()}
        _grpc_refuse(self.receiver, self.receiver._accept("metrics", request), context)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class _LogsServicer(logs_service_pb2_grpc.LogsServiceServicer):
    def __init__(self, receiver: OtlpTestReceiver):
        self.receiver = receiver

    def Export(self, request, context):
        self.receiver.calls["grpc"] += 1
        self.receiver.last_headers = {k.lower(): val for k, val in context.invocation_metadata()}
        _grpc_refuse(self.receiver, self.receiver._accept("logs", request), context)
        return logs_service_pb2.ExportLogsServiceResponse()


def _http_handler(receiver: OtlpTestReceiver):
    routes = {
        "/v1/traces": ("traces", trace_service_pb2.ExportTraceServiceRequest,
                       trace_service_pb2.ExportTraceServiceResponse),
        "/v1/metrics": ("metrics", metrics_service_pb2.ExportMetricsServiceRequest,
                        metrics_service_pb2.ExportMetricsServiceResponse),
        "/v1/logs": ("logs", logs_service_pb2.ExportLogsServiceRequest, logs_service_pb2.ExportLogsServiceResponse),
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep test output clean
            pass

        def _answer(self, status: int, body: bytes, content_type: str = "application/x-protobuf",
                    headers: tuple = ()):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up waiting (stall mode): nothing to answer

        def do_POST(self):
            receiver.calls["http"] += 1
            receiver.last_headers = {k.lower(): val for k, val in self.headers.items()}
            route = routes.get(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if route is None:
                return self._answer(404, b"not found", "text/plain")
            signal, request_type, response_type = route
            if self.headers.get("Content-Type", "").split(";")[0].strip() != "application/x-protobuf":
                return self._answer(415, b"protobuf only", "text/plain")
            try:
                if (self.headers.get("Content-Encoding") or "").lower() == "gzip":
                    body = gzip.decompress(body)
                    if len(body) > MAX_BODY:
                        raise ValueError("body too large after decompression")
                request = request_type()
                request.ParseFromString(body)
            except Exception as exc:
                return self._answer(400, f"bad request: {exc}".encode(), "text/plain")
            mode = receiver._accept(signal, request)
            if mode == "error":
                return self._answer(503, b"test receiver: unavailable", "text/plain")
            if mode == "reject":
                return self._answer(400, b"test receiver: rejected", "text/plain")
            if mode in ("throttle", "exhausted"):
                after = receiver.retry_after or (None if receiver.retry_delay_s is None
                                                 else str(round(receiver.retry_delay_s)))
                return self._answer(503 if mode == "throttle" else 429, f"test receiver: {mode}".encode(),
                                    "text/plain", (("Retry-After", after),) if after else ())
            return self._answer(200, response_type().SerializeToString())

    return Handler


def main() -> None:
    """`python -m harness.otlp_receiver`: serve (count only) until stdin closes; prints the ports,
    and on exit the span and point counts. Lets benchmarks keep the receiver's CPU out of the
    measured process."""
    import sys

    with OtlpTestReceiver(keep=False) as receiver:
        print(receiver.grpc_port, receiver.http_port, flush=True)
        for line in sys.stdin:
            if line.strip() == "counts":
                print(receiver.span_count, receiver.point_count, flush=True)
        print(receiver.span_count, receiver.point_count, flush=True)


if __name__ == "__main__":
    main()
