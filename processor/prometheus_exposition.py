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

With `--workers N` only the main process serves `/metrics` (workers bind the
OTLP ports only): the record counters of every process are summed in shared
memory and the analysis runs in the main process alone, so one process
aggregates and `prometheus_client`'s multiprocess mode (one file per process per
metric, merged on scrape) is not needed; `process_*` describe that main process.
"""
from __future__ import annotations

import logging
import socketserver
from typing import Callable, Iterable, Mapping, Sequence
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from traceml.processor.metric_point import SPECS
from traceml.processor.listener import ServerThread
from traceml.processor.settings import MAX_SERIES
from traceml.processor.summary_export import SeriesLimit
from traceml.schema import vocabulary as v
from traceml.schema.distribution import package_version

LOG = logging.getLogger(__name__)

BUILD_INFO = "traceml_processor_build_info"
"""A gauge of 1 whose `version` label is the package version (the Prometheus `*_build_info`
convention, as `prometheus_build_info`). A gauge rather than an OpenMetrics info family
so that both formats name it the same and `promtool check metrics` reads both."""

REQUEST_TIMEOUT_S = 10.0
"""A scrape connection that sends nothing for this long is closed (a stalled client holds
one thread for at most this long)."""


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
        for key, point in families[name].items():
            family.add_sample(sample_name, {label: str(value) for label, value in zip(labels, key)
                                            if value is not None}, float(point.value))
        out.append(family)
    return out


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


class _QuietHandler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S

    def log_message(self, fmt, *args):
        LOG.debug("prometheus %s " + fmt, self.address_string(), *args)


class _MetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class PrometheusEndpoint(ServerThread):
    """`GET /metrics` on its own HOST:PORT (`--prometheus`), served from the main process only."""

    def __init__(self, host: str, port: int, collect: Callable[[], Sequence], *,
                 max_series: int = MAX_SERIES.default):
        self.limit = SeriesLimit(max_series, "/metrics")
        self.registry = make_registry(collect, self.limit)
        server = _MetricsServer((host, port), _QuietHandler)
        server.set_app(metrics_app(self.registry))
        super().__init__(server, host, "traceml-prometheus")


__all__ = ["BUILD_INFO", "PrometheusEndpoint", "SummaryCollector", "make_registry", "metric_families",
           "metrics_app"]

