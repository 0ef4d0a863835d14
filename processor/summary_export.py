"""Outgoing summary metrics: a Prometheus text endpoint and an OTLP push, both off the ingest path.

(Incoming OTLP Export requests are `otlp_intake`'s.)

Both read the same list of points (`.name`, `.attributes`, `.value`, named after
`SUMMARY_METRICS` / `PROCESSOR_METRICS`); neither carries a `step` attribute.
The Prometheus endpoint renders on scrape; the OTLP pusher runs on its own thread
with a bounded retry and only ever holds the latest snapshot, so a slow or absent
destination costs nothing but that thread.
"""
from __future__ import annotations

import logging
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable, Mapping, Sequence

from traceml.processor.serving import ServerThread
from traceml.schema import vocabulary as v

LOG = logging.getLogger(__name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SPECS: Mapping[str, v.MetricSpec] = {s.name: s for s in (*v.SUMMARY_METRICS, *v.PROCESSOR_METRICS)}


@dataclass(frozen=True, slots=True)
class Point:
    """One exported value (same shape as reporting's MetricPoint)."""

    name: str
    attributes: Mapping[str, object]
    value: float


# --- Prometheus text exposition ------------------------------------------------------------


def _escape_label(value: object) -> str:
    text = "" if value is None else str(value)
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def render_prometheus(points: Iterable, specs: Mapping[str, v.MetricSpec] = SPECS) -> str:
    """Points -> Prometheus text format 0.0.4, one HELP/TYPE block per family."""
    families: dict[str, list] = {}
    for point in points:
        if point.name not in specs:
            LOG.debug("no MetricSpec for %s; not exposed", point.name)
            continue
        families.setdefault(point.name, []).append(point)
    lines: list[str] = []
    for name in sorted(families, key=lambda n: specs[n].prometheus_name):
        spec = specs[name]
        prom = spec.prometheus_name
        help_text = spec.description.replace("\\", "\\\\").replace("\n", "\\n")
        lines.append(f"# HELP {prom} {help_text}")
        lines.append(f"# TYPE {prom} {'counter' if spec.kind == 'counter' else 'gauge'}")
        seen = set()
        for point in families[name]:
            labels = []
            for key in spec.attributes:
                value = point.attributes.get(key)
                if value is None:
                    continue
                labels.append(f'{v.prometheus_label(key)}="{_escape_label(value)}"')
            series = ",".join(labels)
            if series in seen:  # one sample per series: the first (latest projected) wins
                continue
            seen.add(series)
            lines.append(f"{prom}{{{series}}} {_format_value(point.value)}" if series
                         else f"{prom} {_format_value(point.value)}")
    return "\n".join(lines) + "\n" if lines else ""


class _MetricsHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_PromServer"

    def log_message(self, fmt, *args):
        LOG.debug("prometheus %s " + fmt, self.address_string(), *args)

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body = self.server.render().encode()
                code, ctype = 200, PROMETHEUS_CONTENT_TYPE
            except Exception as exc:  # a scrape must never kill the server
                LOG.exception("rendering /metrics failed")
                body, code, ctype = f"render failed: {exc}\n".encode(), 500, "text/plain"
        elif path in ("/healthz", "/"):
            body, code, ctype = b"ok\n", 200, "text/plain"
        else:
            body, code, ctype = b"not found\n", 404, "text/plain"
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _PromServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, render: Callable[[], str]):
        super().__init__(address, _MetricsHandler)
        self.render = render


class PrometheusEndpoint(ServerThread):
    """`GET /metrics` on its own HOST:PORT (`--prometheus`)."""

    def __init__(self, host: str, port: int, collect: Callable[[], Sequence]):
        super().__init__(_PromServer((host, port), lambda: render_prometheus(collect())), host, "traceml-prometheus")


# --- OTLP push --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SummaryExportConfig:
    """Where summary metrics go: an OTLP endpoint and how to talk to it."""

    endpoint: str
    protocol: str = "grpc"  # grpc | http/protobuf
    headers: Mapping[str, str] = None  # type: ignore[assignment]
    timeout_s: float = 10.0
    interval_s: float = 5.0
    insecure: bool | None = None  # None: decided by the URL scheme
    compression: str | None = None  # gzip | None

    @property
    def http_url(self) -> str:
        url = self.endpoint
        if not urllib.parse.urlparse(url).scheme:
            url = "http://" + url
        return url if url.rstrip("/").endswith("/v1/metrics") else url.rstrip("/") + "/v1/metrics"

    @property
    def grpc_target(self) -> tuple[str, bool]:
        """(host:port, secure)."""
        parsed = urllib.parse.urlparse(self.endpoint if "://" in self.endpoint else "//" + self.endpoint)
        secure = parsed.scheme == "https"
        if self.insecure is not None:
            secure = not self.insecure
        return parsed.netloc or parsed.path, secure


def build_summary_request(points: Iterable, *, start_time_ns: int, now_ns: int | None = None,
                          specs: Mapping[str, v.MetricSpec] = SPECS):
    """Points -> one `ExportMetricsServiceRequest` (gauges; counters as cumulative sums)."""
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
    from opentelemetry.proto.common.v1 import common_pb2
    from opentelemetry.proto.metrics.v1 import metrics_pb2
    from opentelemetry.proto.resource.v1 import resource_pb2

    now_ns = time.time_ns() if now_ns is None else now_ns
    by_name: dict[str, list] = {}
    for point in points:
        if point.name in specs:
            by_name.setdefault(point.name, []).append(point)
    metrics = []
    for name, group in by_name.items():
        spec = specs[name]
        data_points = []
        for point in group:
            attrs = [common_pb2.KeyValue(key=k, value=_any(point.attributes[k]))
                     for k in spec.attributes if point.attributes.get(k) is not None]
            data_points.append(metrics_pb2.NumberDataPoint(
                attributes=attrs, time_unix_nano=now_ns, start_time_unix_nano=start_time_ns,
                as_double=float(point.value)))
        metric = metrics_pb2.Metric(name=spec.name, unit=spec.unit, description=spec.description)
        if spec.kind == "counter":
            metric.sum.CopyFrom(metrics_pb2.Sum(
                data_points=data_points, is_monotonic=True,
                aggregation_temporality=metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE))
        else:
            metric.gauge.CopyFrom(metrics_pb2.Gauge(data_points=data_points))
        metrics.append(metric)
    resource = resource_pb2.Resource(attributes=[
        common_pb2.KeyValue(key=v.RES_SERVICE_NAME, value=common_pb2.AnyValue(string_value="traceml-processor"))])
    return metrics_service_pb2.ExportMetricsServiceRequest(resource_metrics=[metrics_pb2.ResourceMetrics(
        resource=resource,
        scope_metrics=[metrics_pb2.ScopeMetrics(
            scope=common_pb2.InstrumentationScope(name="traceml.processor"), metrics=metrics)])])


def _any(value):
    from opentelemetry.proto.common.v1 import common_pb2

    if isinstance(value, bool):
        return common_pb2.AnyValue(bool_value=value)
    if isinstance(value, int):
        return common_pb2.AnyValue(int_value=value)
    if isinstance(value, float):
        return common_pb2.AnyValue(double_value=value)
    return common_pb2.AnyValue(string_value=str(value))


class SummaryPusher:
    """Pushes the latest points every `interval_s` on its own thread; bounded retries."""

    RETRY_DELAYS_S = (0.5, 1.0, 2.0)

    def __init__(self, config: SummaryExportConfig, collect: Callable[[], Sequence]):
        self.config = config
        self._collect = collect
        self._stop = threading.Event()
        self._start_ns = time.time_ns()
        self._thread = threading.Thread(target=self._run, name="traceml-summary-push", daemon=True)
        self._channel = None
        self._stub = None
        self.sent = 0
        self.failed = 0
        self.last_error: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, flush: bool = True) -> None:
        self._stop.set()
        self._thread.join(self.config.timeout_s + 2)
        if flush:
            self.push_once(retries=0)
        if self._channel is not None:
            self._channel.close()

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            self.push_once()

    def push_once(self, retries: int | None = None) -> bool:
        points = list(self._collect())
        if not points:
            return True
        request = build_summary_request(points, start_time_ns=self._start_ns)
        delays = self.RETRY_DELAYS_S if retries is None else self.RETRY_DELAYS_S[:retries]
        for attempt in range(len(delays) + 1):
            try:
                self._send(request)
                self.sent += 1
                return True
            except Exception as exc:  # any failure is retried, then counted; never raised
                self.last_error = str(exc)
                if attempt < len(delays) and not self._stop.is_set():
                    if self._stop.wait(delays[attempt]):
                        break
        self.failed += 1  # the `traceml.processor.export.failures` self-metric (service.points)
        LOG.warning("summary metrics export to %s failed: %s", self.config.endpoint, self.last_error)
        return False

    def _send(self, request) -> None:
        if self.config.protocol.startswith("http"):
            body = request.SerializeToString()
            headers = {"Content-Type": "application/x-protobuf", **(self.config.headers or {})}
            if self.config.compression == "gzip":
                import gzip

                body = gzip.compress(body)
                headers["Content-Encoding"] = "gzip"
            req = urllib.request.Request(self.config.http_url, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=self.config.timeout_s) as response:
                response.read()
            return
        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc

        if self._stub is None:
            target, secure = self.config.grpc_target
            self._channel = (grpc.secure_channel(target, grpc.ssl_channel_credentials()) if secure
                             else grpc.insecure_channel(target))
            self._stub = metrics_service_pb2_grpc.MetricsServiceStub(self._channel)
        metadata = list((self.config.headers or {}).items())
        compression = grpc.Compression.Gzip if self.config.compression == "gzip" else None
        self._stub.Export(request, timeout=self.config.timeout_s, metadata=metadata, compression=compression)
