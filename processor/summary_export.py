"""Outgoing summary metrics: the series both surfaces carry, and the OTLP push, off the ingest path.

(Incoming OTLP Export requests are `otlp_intake`'s; the Prometheus `/metrics`
endpoint is `prometheus_exposition`'s.)

Both surfaces read the same list of points (`metric_point.MetricPoint`, named
after `SUMMARY_METRICS` / `PROCESSOR_METRICS`) through one series grouping
with one series limit (`SeriesLimit`); neither carries a `step` attribute. The
OTLP push hands the OpenTelemetry SDK's official OTLP metric exporter (gRPC or
HTTP/protobuf) the SDK's own `MetricsData`, built from the latest snapshot on its
own thread, so transport, retries, TLS and the `OTEL_EXPORTER_OTLP_*` variables
are the SDK's, and a slow or absent destination costs nothing but that thread.

Why not a `MeterProvider` with observable instruments: its per-instrument
aggregation state keeps every attribute set it ever saw (asynchronous
instruments never release one), so the series of ended runs fill the
cardinality limit (2000 per instrument by default) and a later run's series
land in the `otel.metric.overflow` series; raising the limit only turns that
into memory that grows with every run the processor has seen
(docs/processor.md gives the measurement).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from traceml.processor import settings
from traceml.processor.metric_point import SPECS, MetricPoint
from traceml.schema import vocabulary as v
from traceml.schema.distribution import package_version, user_agent

LOG = logging.getLogger(__name__)

DEFAULT_MAX_SERIES = settings.MAX_SERIES.default
"""Series one scrape or push carries at most (`--max-series`, `TRACEML_PROCESSOR_MAX_SERIES`).

Per-rank series are bounded per run (reporting/summary_metrics.py) and runs by
`--max-runs`, so this is a safety net that keeps a scrape under about a second,
not a limit a normal deployment reaches."""

Families = dict[str, dict[tuple, object]]


def _series(points: Iterable, specs: Mapping[str, v.MetricSpec]) -> Families:
    """Points by metric name, one per series (attribute values in the spec's key order): the first wins."""
    families: Families = {}
    for point in points:
        spec = specs.get(point.name)
        if spec is None:
            LOG.debug("no MetricSpec for %s; not exported", point.name)
            continue
        key = tuple(point.attributes.get(k) for k in spec.attributes)
        families.setdefault(point.name, {}).setdefault(key, point)
    return families


class SeriesLimit:
    """The series limit of one surface: whole runs beyond it are left out, counted, logged once.

    Series without a run id (the processor's own) always go out. Runs are taken
    in the order their first point arrives (the run monitor lists runs in the
    order it first saw them), each whole or not at all, while the total stays
    within `max_series`; the rest are left out of this scrape or push, so the
    runs already on a dashboard keep their series and a flood of new runs cannot
    push them out (as `--max-runs` refuses new runs, not old ones). The count of
    series left out is itself exported (`traceml.processor.series.left_out`,
    always present) and the first time it happens is logged.
    """

    def __init__(self, max_series: int = DEFAULT_MAX_SERIES, surface: str = "summary metrics"):
        if max_series < 1:
            raise ValueError(f"the series limit must be at least 1, not {max_series}")
        self.max_series = max_series
        self.surface = surface
        self.left_out_series = 0  # in the latest selection
        self.left_out_runs = 0
        self._logged = False
        self._lock = threading.Lock()

    def select(self, points: Iterable, specs: Mapping[str, v.MetricSpec] = SPECS) -> Families:
        """Both renderers take their series from here, so `/metrics` and the push carry the same ones."""
        by_run: dict[object, list] = {}
        for point in points:
            by_run.setdefault(point.attributes.get(v.ATTR_RUN_ID), []).append(point)
        families = _series(by_run.pop(None, ()), specs)
        budget = self.max_series - sum(len(series) for series in families.values()) - 1  # -1: the count itself
        left_runs, left_series, first_left = 0, 0, None
        for run_id, run_points in by_run.items():
            run_families = _series(run_points, specs)
            size = sum(len(series) for series in run_families.values())
            if size <= budget:
                budget -= size
                for name, series in run_families.items():
                    families.setdefault(name, {}).update(series)  # keys hold the run id: no collision
            else:
                left_runs += 1
                left_series += size
                first_left = run_id if first_left is None else first_left
        if v.METRIC_PROCESSOR_SERIES_LEFT_OUT in specs:
            left_out = v.METRIC_PROCESSOR_SERIES_LEFT_OUT
            families.setdefault(left_out, {})[()] = MetricPoint(left_out, {}, float(left_series))
        with self._lock:
            self.left_out_series, self.left_out_runs = left_series, left_runs
            log = left_runs and not self._logged
            self._logged = self._logged or bool(left_runs)
        if log:
            LOG.warning("%s: the series limit of %d is reached; %d run(s) (%r first) with %d series left out "
                        "(counted in traceml_processor_series_left_out; logged once); raise --max-series or "
                        "lower --rank-series-top-k", self.surface, self.max_series, left_runs, first_left,
                        left_series)
        return families


# --- OTLP push --------------------------------------------------------------------------------

SCOPE_NAME = "traceml.processor"
SERVICE_NAME_DEFAULT = "traceml-processor"
"""`service.name` of the pushed resource unless `OTEL_SERVICE_NAME` (or `OTEL_RESOURCE_ATTRIBUTES`) names one."""

MAX_POINTS_PER_REQUEST = 8192
"""Data points per Export request: one push of many runs is split so that each request stays
under the 4 MiB a Collector's OTLP receiver accepts by default."""

FINAL_PUSH_BOUND_S = 3.0
"""At shutdown the last push may retry this long at most, then it is abandoned (counted as failed)."""

IN_FLIGHT_PUSH_BOUND_S = 10.0
"""At shutdown a push still in flight is waited for this long at most (plus 2 s), since its timeout
may be "no limit" (`OTEL_EXPORTER_OTLP_TIMEOUT=0`); the exporter's shutdown then ends its retries."""

_HTTP_PATH = "/v1/metrics"


@dataclass(frozen=True)
class SummaryExportConfig:
    """Where summary metrics go; what is not set here the OpenTelemetry exporter reads itself.

    `endpoint` is the processor's own `--export-endpoint` (or
    `TRACEML_PROCESSOR_EXPORT_ENDPOINT`): a base URL like `OTEL_EXPORTER_OTLP_ENDPOINT`,
    so for OTLP/HTTP `/v1/metrics` is appended unless the URL already ends with it.
    None leaves the destination to the exporter, which reads
    `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` (used as is) or else
    `OTEL_EXPORTER_OTLP_ENDPOINT` (with `/v1/metrics` appended for HTTP), as the
    specification says. Certificates, client key and certificate, compression and
    `insecure` always come from the `OTEL_EXPORTER_OTLP_*` variables through the
    exporter. Headers and the timeout are passed explicitly: headers because both
    sides of TraceML read `OTEL_EXPORTER_OTLP_HEADERS` with one parser, the timeout
    because the Python exporters read `OTEL_EXPORTER_OTLP_TIMEOUT` as seconds where
    the specification says milliseconds.
    """

    endpoint: str | None
    protocol: str = "grpc"  # grpc | http/protobuf
    headers: Mapping[str, str] | None = None  # None: the exporter reads the headers variables
    timeout_s: float = settings.EXPORT_TIMEOUT.default  # one push, its retries included
    interval_s: float = settings.EXPORT_INTERVAL.default

    def exporter_endpoint(self) -> str | None:
        """What the exporter gets as `endpoint` (None: it resolves the OTEL_* variables)."""
        if self.endpoint is None or not self.protocol.startswith("http"):
            return self.endpoint
        url = self.endpoint if "://" in self.endpoint else "http://" + self.endpoint
        return url if url.rstrip("/").endswith(_HTTP_PATH) else url.rstrip("/") + _HTTP_PATH

    def describe(self) -> str:
        return self.exporter_endpoint() or "the OTEL_EXPORTER_OTLP_*ENDPOINT destination"


def processor_resource(instance_id: str | None = None):
    """The pushed resource: one per processor process.

    `service.instance.id` is a random UUID drawn when the process starts, so two
    replicas behind one Collector never share a series (host and port would: every
    container listens on the same port), and a restarted processor is a new
    instance. `OTEL_RESOURCE_ATTRIBUTES` and `OTEL_SERVICE_NAME` win over these
    defaults (an operator who names the instance there is trusted to keep it
    unique); `Resource.create` adds the `telemetry.sdk.*` attributes.
    """
    import uuid

    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    defaults = {v.RES_SERVICE_NAME: SERVICE_NAME_DEFAULT,
                v.RES_SERVICE_INSTANCE_ID: instance_id or str(uuid.uuid4())}
    defaults["service.version"] = package_version()
    return Resource.create({**defaults, **OTELResourceDetector().detect().attributes})


def build_metrics_data(points: Iterable, *, resource, start_time_ns: int, now_ns: int | None = None,
                       specs: Mapping[str, v.MetricSpec] = SPECS, limit: SeriesLimit | None = None):
    """Points -> the SDK's `MetricsData` (gauges; counters as cumulative monotonic sums).

    Built afresh from the latest snapshot on every push, as a metric reader would
    hand it to the exporter: a series of an ended (forgotten) run is simply absent
    from the next push, and no aggregation state outlives a run.
    """
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality, Gauge, Metric, MetricsData, NumberDataPoint, ResourceMetrics, ScopeMetrics, Sum)
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    now_ns = time.time_ns() if now_ns is None else now_ns
    metrics = []
    families = _series(points, specs) if limit is None else limit.select(points, specs)
    for name, series in families.items():
        spec = specs[name]
        data_points = [
            NumberDataPoint(attributes={k: val for k, val in zip(spec.attributes, key) if val is not None},
                            start_time_unix_nano=start_time_ns, time_unix_nano=now_ns,
                            value=float(point.value), exemplars=_exemplars(point.exemplar))
            for key, point in series.items()]
        data = (Sum(data_points=data_points, aggregation_temporality=AggregationTemporality.CUMULATIVE,
                    is_monotonic=True) if spec.kind == "counter" else Gauge(data_points=data_points))
        metrics.append(Metric(name=spec.name, description=spec.description, unit=spec.unit, data=data))
    scope = InstrumentationScope(SCOPE_NAME, package_version())
    return MetricsData(resource_metrics=[ResourceMetrics(
        resource=resource, schema_url="",
        scope_metrics=[ScopeMetrics(scope=scope, metrics=metrics, schema_url="")])])


def _exemplars(step) -> list:
    """A point's step (`metric_point.StepExemplar`) as the OTLP exemplar of its data point: the
    worst step's trace and span id, value and end time. OTLP allows one on gauges and sums alike."""
    if step is None:
        return []
    from opentelemetry.sdk.metrics import Exemplar

    return [Exemplar(filtered_attributes={}, value=float(step.value), time_unix_nano=int(step.time * 1e9),
                     span_id=int(step.span_id, 16), trace_id=int(step.trace_id, 16))]


def make_metric_exporter(config: SummaryExportConfig):
    """The official OTLP metric exporter (gRPC or HTTP/protobuf) for `config`.

    It owns the transport: retries with backoff within `timeout_s` (honouring
    gRPC RetryInfo and HTTP Retry-After), TLS from `OTEL_EXPORTER_OTLP_CERTIFICATE`
    and the client key/certificate variables, compression, `insecure`.
    """
    common = {"endpoint": config.exporter_endpoint(), "timeout": config.timeout_s}
    if config.headers is not None:
        common["headers"] = dict(config.headers)
    http = config.protocol.startswith("http")
    package = "opentelemetry-exporter-otlp-proto-" + ("http" if http else "grpc")
    try:
        if http:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        else:
            from opentelemetry.exporter.otlp.proto.grpc.exporter import InvalidCompressionValueException
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from grpc import Compression
    except ImportError as exc:  # a missing library is a start-up error with its remedy, not a traceback
        raise RuntimeError(f"the summary push over {config.protocol} needs {package} ({exc}); "
                           f"install it, or choose the other --export-protocol") from None
    if _accepts(OTLPMetricExporter, "max_export_batch_size"):
        common["max_export_batch_size"] = MAX_POINTS_PER_REQUEST
    else:
        LOG.warning("summary metrics export: %s %s cannot split a push into requests of at most %d data "
                    "points (its exporter takes no max_export_batch_size; newer releases do), so each push goes "
                    "as one request, which a receiver's size limit (4 MiB by default) may refuse when many runs "
                    "are open", package, _version(package), MAX_POINTS_PER_REQUEST)
    # Name the sender (distribution.user_agent): over HTTP as a header among the headers passed (unless
    # one was configured; SDKs that put their own after the configured headers keep theirs); over gRPC
    # as the channel's primary user agent, where the installed exporter takes channel options.
    agent = user_agent("Processor")
    if http:
        headers = common.get("headers")
        if headers is not None and not any(name.lower() == "user-agent" for name in headers):
            headers["user-agent"] = agent
        return OTLPMetricExporter(**common)
    if _accepts(OTLPMetricExporter, "channel_options"):
        common["channel_options"] = (("grpc.primary_user_agent", agent),)
    try:
        return OTLPMetricExporter(**common)
    except InvalidCompressionValueException as exc:  # an invalid value is warned about, not fatal
        LOG.warning("summary metrics export: %s; exporting uncompressed", exc)
        return OTLPMetricExporter(**common, compression=Compression.NoCompression)


def _version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "(version unknown)"


def _accepts(cls, argument: str) -> bool:
    """Whether `cls(...)` takes the keyword `argument`: the installed SDK's capability, not its version."""
    import inspect

    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return argument in parameters


class SummaryPusher:
    """Pushes the latest points every `interval_s` on its own thread through the OTLP exporter.

    The exporter retries within the push's timeout; a push it gives up on is
    counted (`failed`, the `traceml.processor.export.failures` self-metric) and
    logged, and the next push starts from the then-latest snapshot, so a dead
    destination never holds more than one snapshot nor slows ingest.
    """

    def __init__(self, config: SummaryExportConfig, collect: Callable[[], Sequence], *, resource=None,
                 max_series: int = DEFAULT_MAX_SERIES):
        self.config = config
        self._collect = collect
        self.limit = SeriesLimit(max_series, "summary metrics push")
        self._stop = threading.Event()
        self._start_ns = time.time_ns()
        self.resource = processor_resource() if resource is None else resource
        self._exporter = make_metric_exporter(config)
        self._thread = threading.Thread(target=self._run, name="traceml-summary-push", daemon=True)
        self.sent = 0
        self.failed = 0
        self.last_error: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, flush: bool = True) -> None:
        """Stop the thread, push the final snapshot (bounded), shut the exporter down.

        A push still in flight after its bounded wait is the last one: a second
        would wait on the same destination.
        """
        self._stop.set()
        self._thread.join(min(self.config.timeout_s, IN_FLIGHT_PUSH_BOUND_S) + 2)
        final = None
        if flush and not self._thread.is_alive():
            final = threading.Thread(target=self.push_once, name="traceml-summary-final-push", daemon=True)
            final.start()
            final.join(min(self.config.timeout_s, FINAL_PUSH_BOUND_S))
        self._exporter.shutdown()  # also ends the final push's retries, if it is still waiting
        if final is not None:
            final.join(2.0)

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            self.push_once()

    def push_once(self) -> bool:
        from opentelemetry.sdk.metrics.export import MetricExportResult

        points = list(self._collect())
        if not points:
            return True
        try:
            data = build_metrics_data(points, resource=self.resource, start_time_ns=self._start_ns,
                                      limit=self.limit)
            result = self._exporter.export(data, timeout_millis=self.config.timeout_s * 1000.0)
            ok = result is MetricExportResult.SUCCESS
            if not ok:
                self.last_error = "the OTLP exporter gave up (its log line above says why)"
        except Exception as exc:  # counted, never raised: the push thread must survive anything
            ok = False
            self.last_error = f"{type(exc).__name__}: {exc}"
        if ok:
            self.sent += 1
            return True
        self.failed += 1  # the `traceml.processor.export.failures` self-metric (service.points)
        LOG.warning("summary metrics export to %s failed: %s", self.config.describe(), self.last_error)
        return False
