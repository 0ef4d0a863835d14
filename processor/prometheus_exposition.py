"""`GET /metrics` through `prometheus_client`: a custom collector over the summary series.

The collector turns the same series the OTLP push sends (`summary_export.SeriesLimit.select`
over the run monitor's points) into `prometheus_client` metric families on every
scrape; it keeps no state between scrapes, so a forgotten run is simply absent
from the next one. `prometheus_client`'s own WSGI exposition does the rest:
OpenMetrics 1.0 when the scraper's `Accept` asks for it (Prometheus does by
default), text 0.0.4 otherwise, gzip when `Accept-Encoding` allows it, and
`name[]` filters. Beside the summary series the registry carries the
process's `process_*` metrics, `python_info` and `traceml_processor_build_info`.

Names in both formats are the vocabulary's (`MetricSpec.prometheus_name`): a
counter's family is its name without `_total` and its samples carry `_total`, so
the text format reads exactly as before and OpenMetrics is valid; gauges whose
unit is a Prometheus base unit (`_seconds`, `_bytes`, `_ratio`) declare it as
the OpenMetrics `# UNIT`. No `_created` samples: the processor does not know when
a training rank's counter started, and each would be one more series.

The endpoint runs on the processor's bounded HTTP front (`http_front.HttpFront`, as
the OTLP/HTTP port and the web view do): h11 on one asyncio loop, at most
`METRICS_MAX_CONNECTIONS` connections (at the cap the one that made the least
progress is closed), the same header, body and keep-alive deadlines, `METRICS_POOL_THREADS`
threads rendering, and the processor's TLS and bearer token when they are
configured (`/metrics` answers 401 without the token; `/healthz` and `/` stay open,
as the receiver's health checks do). Its connection events are counted with the
other ports' (`traceml_processor_http_connection_events_total`). The WSGI app still
makes every answer, so what a scraper sees is exactly what `prometheus_client` makes.

With `--workers N` only the main process serves `/metrics` (workers bind the
OTLP ports only): the record counters of every process are summed in shared
memory and the analysis runs in the main process alone, so one process
aggregates and `prometheus_client`'s multiprocess mode (one file per process per
metric, merged on scrape) is not needed; `process_*` describe that main process.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, Exemplar, GaugeMetricFamily, Metric

from traceml.processor.http_front import Accept, HttpFront, HttpLimits, Reply, RequestHead
from traceml.processor.listener import ServerThread
from traceml.processor.metric_point import SPECS
from traceml.processor.security import BearerAuth, TlsConfig
from traceml.processor.settings import MAX_SERIES
from traceml.processor.summary_export import SeriesLimit
from traceml.schema import vocabulary as v
from traceml.schema.distribution import package_version

LOG = logging.getLogger(__name__)

BUILD_INFO = "traceml_processor_build_info"
"""A gauge of 1 whose `version` label is the package version (the Prometheus `*_build_info`
convention, as `prometheus_build_info`). A gauge rather than an OpenMetrics info family
so that both formats name it the same and `promtool check metrics` reads both."""

METRICS_POOL_THREADS = 2
"""Scrapes rendered at once: a Prometheus server scrapes a target once per interval, so two
let a second scraper (or a person's curl) in beside it; more wait their turn."""
METRICS_MAX_CONNECTIONS = 64
"""Connections `/metrics` keeps open at most (a scraper keeps one): below the other ports'
cap, so a flood here takes few of the process's descriptors."""


def metric_families(families: Mapping[str, Mapping[tuple, object]],
                    specs: Mapping[str, v.MetricSpec] = SPECS) -> list[Metric]:
    """Selected series -> `prometheus_client` families, sorted by Prometheus name.

    A label whose value is None is left out of that sample (an absent label, as
    Prometheus reads an empty one), which is why samples are added by dict.
    """
    out: list[Metric] = []
    for name in sorted(families, key=lambda n: specs[n].prometheus_name):
        spec = specs[name]
        prom = spec.prometheus_name
        labels = [v.prometheus_label(k) for k in spec.attributes]
        if spec.kind == "counter":
            family: Metric = CounterMetricFamily(prom, spec.description, labels=labels)
            sample_name = family.name + "_total"
        else:
            unit = v.prometheus_unit(spec.unit)
            family = GaugeMetricFamily(prom, spec.description, labels=labels,
                                       unit=unit if unit and prom.endswith("_" + unit) else "")
            sample_name = prom
        counter = spec.kind == "counter"
        for key, point in families[name].items():
            family.add_sample(sample_name, {label: str(value) for label, value in zip(labels, key)
                                            if value is not None}, float(point.value),
                              exemplar=_exemplar(point.exemplar) if counter else None)
        out.append(family)
    return out


EXEMPLAR_TRACE_LABEL, EXEMPLAR_SPAN_LABEL = "trace_id", "span_id"
"""The exemplar's label names: what Grafana's `exemplarTraceIdDestinations` (deploy/grafana) and
Tempo read."""


def _exemplar(step) -> Exemplar | None:
    """A point's step (`metric_point.StepExemplar`) as an OpenMetrics exemplar: `trace_id` and
    `span_id` labels (the names Grafana's trace links and Tempo read), the step's value and end.
    Only counters get one: OpenMetrics allows exemplars on counters and histogram buckets, and
    Prometheus refuses a whole scrape that puts one on a gauge. The text format (0.0.4) has no
    exemplars: `prometheus_client` writes them only when the scraper asked for OpenMetrics."""
    if step is None:
        return None
    return Exemplar({EXEMPLAR_TRACE_LABEL: step.trace_id, EXEMPLAR_SPAN_LABEL: step.span_id}, float(step.value),
                    float(step.time))


class SummaryCollector:
    """The custom collector: on every scrape, the latest points through the series limit."""

    def __init__(self, collect: Callable[[], Sequence], limit: SeriesLimit, version: str | None = None):
        self._collect = collect
        self.limit = limit
        self.version = package_version() if version is None else version

    def collect(self) -> Iterable[Metric]:
        yield from metric_families(self.limit.select(self._collect()))
        build = GaugeMetricFamily(BUILD_INFO, "traceml-processor build: the version label is the package version.",
                                  labels=["version"])
        build.add_metric([self.version], 1.0)
        yield build


def make_registry(collect: Callable[[], Sequence], limit: SeriesLimit) -> CollectorRegistry:
    """A private registry (never prometheus_client's global one): summary series, process, platform."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SummaryCollector(collect, limit))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def metrics_app(registry: CollectorRegistry):
    """WSGI app: `/metrics` is prometheus_client's exposition; `/healthz` and `/` answer ok; else 404."""
    exposition = make_wsgi_app(registry)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            try:
                # The body is built before start_response, so a failing collector can still get a 500.
                captured: list = []
                body = b"".join(exposition(environ, lambda status, headers: captured.append((status, headers))))
            except Exception as exc:  # a scrape must never kill the server
                LOG.exception("rendering /metrics failed")
                start_response("500 Internal Server Error", [("Content-Type", "text/plain")])
                return [f"render failed: {type(exc).__name__}\n".encode()]
            status, headers = captured[0]
            start_response(status, headers)
            return [body]
        if path in ("/healthz", "/"):
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    return app


def front_route(app, auth: BearerAuth, scheme: str = "http") -> Callable[[RequestHead], Accept | Reply]:
    """The WSGI `app` as an HTTP-front route: the token is checked on the head (before any
    rendering), then the app runs on a pool thread (collecting reads the run monitor)."""

    def route(head: RequestHead) -> Accept | Reply:
        if head.path == "/metrics" and not auth.allows(head.headers.get("authorization")):
            return Reply(401, b"unauthenticated: send Authorization: Bearer <token>\n",
                         headers=(("WWW-Authenticate", 'Bearer realm="traceml-processor"'),))

        def answer(_body: bytes) -> Reply:
            environ = {"REQUEST_METHOD": "GET" if head.method == "HEAD" else head.method,
                       "PATH_INFO": head.path, "QUERY_STRING": head.query, "wsgi.url_scheme": scheme}
            for name in ("accept", "accept-encoding"):
                if name in head.headers:
                    environ["HTTP_" + name.upper().replace("-", "_")] = head.headers[name]
            started: list = []
            body = b"".join(app(environ, lambda status, headers, exc_info=None: started.append((status, headers))))
            status, headers = started[0]
            content_type, rest = "text/plain; charset=utf-8", []
            for name, value in headers:
                if name.lower() == "content-type":
                    content_type = value
                elif name.lower() != "content-length":  # the front sets it
                    rest.append((name, value))
            return Reply(int(status.split()[0]), body, content_type, tuple(rest))

        return Accept(handle=answer, error=lambda code, message: Reply(code, (message + "\n").encode()))

    return route


class PrometheusEndpoint(ServerThread):
    """`GET /metrics` on its own HOST:PORT (`--prometheus`), served from the main process only,
    on the bounded HTTP front with the processor's TLS and bearer token when configured."""

    def __init__(self, host: str, port: int, collect: Callable[[], Sequence], *,
                 max_series: int = MAX_SERIES.default, auth: BearerAuth = BearerAuth(),
                 tls: TlsConfig = TlsConfig(), limits: HttpLimits = HttpLimits(),
                 on_event: Callable[[str], None] | None = None):
        self.limit = SeriesLimit(max_series, "/metrics")
        self.registry = make_registry(collect, self.limit)
        self.scheme = "https" if tls.enabled else "http"
        capped = dataclasses.replace(limits, max_connections=min(limits.max_connections, METRICS_MAX_CONNECTIONS))
        front = HttpFront((host, port), front_route(metrics_app(self.registry), auth, self.scheme), limits=capped,
                          pool_size=METRICS_POOL_THREADS, max_body_bytes=64 * 1024,
                          tls_context=tls.server_context() if tls.enabled else None, name="traceml-prometheus",
                          on_event=on_event)
        super().__init__(front, host, "traceml-prometheus")


__all__ = ["BUILD_INFO", "EXEMPLAR_SPAN_LABEL", "EXEMPLAR_TRACE_LABEL", "METRICS_MAX_CONNECTIONS", "METRICS_POOL_THREADS", "PrometheusEndpoint",
           "SummaryCollector", "front_route", "make_registry", "metric_families", "metrics_app"]

