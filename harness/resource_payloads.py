"""Hand-built OTLP resource metrics as each sender shapes them (a rank, `hostmetrics`, DCGM).

A rank's points carry run and rank on the resource (as `exporter.encoding` sends them);
the Collector's `hostmetrics` receiver sends per-CPU, per-mode points under a resource
with `host.name` only (`legacy=True`: its older `state` / `cpu` attribute names); DCGM's
exporter, scraped by the Collector's Prometheus receiver, sends Prometheus-named gauges
with `Hostname`, `UUID` and `gpu` labels on each point.
"""
from __future__ import annotations

import time
from typing import Iterable, Mapping

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2 as metric_data
from opentelemetry.proto.resource.v1 import resource_pb2
from harness.otlp_payloads import kv

from traceml.schema import resources as sr
from traceml.schema import vocabulary as v

_CUMULATIVE = metric_data.AGGREGATION_TEMPORALITY_CUMULATIVE


def point(value: float | int, attrs: Mapping | None = None, *, time_ns: int | None = None,
          flags: int = 0) -> metric_data.NumberDataPoint:
    p = metric_data.NumberDataPoint(time_unix_nano=time.time_ns() if time_ns is None else time_ns, flags=flags,
                                    attributes=[kv(k, val) for k, val in (attrs or {}).items()])
    if isinstance(value, int) and not isinstance(value, bool):
        p.as_int = value
    else:
        p.as_double = value
    return p


def gauge(name: str, points: Iterable, unit: str = "1") -> metric_data.Metric:
    return metric_data.Metric(name=name, unit=unit, gauge=metric_data.Gauge(data_points=list(points)))


def updown(name: str, points: Iterable, unit: str = "By") -> metric_data.Metric:
    return metric_data.Metric(name=name, unit=unit, sum=metric_data.Sum(
        data_points=list(points), is_monotonic=False, aggregation_temporality=_CUMULATIVE))


def counter(name: str, points: Iterable, unit: str = "s") -> metric_data.Metric:
    return metric_data.Metric(name=name, unit=unit, sum=metric_data.Sum(
        data_points=list(points), is_monotonic=True, aggregation_temporality=_CUMULATIVE))


def metrics_request(resource_attrs: Mapping, metrics: Iterable[metric_data.Metric], *,
                    scope: str = "traceml") -> metrics_pb2.ExportMetricsServiceRequest:
    return metrics_pb2.ExportMetricsServiceRequest(resource_metrics=[metric_data.ResourceMetrics(
        resource=resource_pb2.Resource(attributes=[kv(k, val) for k, val in resource_attrs.items()]),
        scope_metrics=[metric_data.ScopeMetrics(scope=common_pb2.InstrumentationScope(name=scope),
                                                metrics=list(metrics))],
    )])


def rank_resource(run_id: str, rank: int, *, host: str = "host-a", pid: int | None = 4242) -> dict:
    attrs = {v.RES_SERVICE_NAME: v.DEFAULT_SERVICE_NAME, v.RES_HOST_NAME: host, v.ATTR_RUN_ID: run_id,
             v.ATTR_RANK: rank, v.ATTR_LOCAL_RANK: rank, v.ATTR_WORLD_SIZE: 2}
    if pid is not None:
        attrs[sr.RES_PROCESS_PID] = pid
    return attrs


def hostmetrics_request(host: str | None, *, cpu_modes: Iterable[Mapping[str, float]] = (),
                        cpu_seconds: Iterable[Mapping[str, float]] = (),
                        memory_states: Mapping[str, int] | None = None, legacy: bool = False,
                        time_ns: int | None = None) -> metrics_pb2.ExportMetricsServiceRequest:
    """One `hostmetrics` scrape: per-CPU mode fractions, per-CPU mode seconds, memory by state."""
    now = time.time_ns() if time_ns is None else time_ns
    mode_key, cpu_key = ("state", "cpu") if legacy else (sr.ATTR_CPU_MODE, sr.ATTR_CPU_LOGICAL_NUMBER)
    state_key = "state" if legacy else sr.ATTR_MEMORY_STATE

    def per_cpu(rows):
        return [point(float(value), {cpu_key: f"cpu{i}" if legacy else i, mode_key: mode}, time_ns=now)
                for i, modes in enumerate(rows) for mode, value in modes.items()]

    metrics = []
    cpu_modes, cpu_seconds = list(cpu_modes), list(cpu_seconds)
    if cpu_modes:
        metrics.append(gauge(sr.SYSTEM_CPU_UTILIZATION, per_cpu(cpu_modes)))
    if cpu_seconds:
        metrics.append(counter(sr.SYSTEM_CPU_TIME, per_cpu(cpu_seconds)))
    if memory_states:
        metrics.append(updown(sr.SYSTEM_MEMORY_USAGE, [point(int(n), {state_key: state}, time_ns=now)
                                                       for state, n in memory_states.items()]))
    attrs = {} if host is None else {v.RES_HOST_NAME: host}
    return metrics_request(attrs, metrics, scope="github.com/open-telemetry/opentelemetry-collector-contrib/"
                                                 "receiver/hostmetricsreceiver/internal/scraper/cpuscraper")


def dcgm_request(host: str | None, fields: Mapping[str, float], *, uuid: str | None = "GPU-1234",
                 gpu: str | None = "0", resource_host: str | None = None,
                 time_ns: int | None = None) -> metrics_pb2.ExportMetricsServiceRequest:
    """DCGM exporter fields (`DCGM_FI_DEV_*` -> value in DCGM's unit) for one GPU."""
    now = time.time_ns() if time_ns is None else time_ns
    labels = {"modelName": "NVIDIA H100 80GB HBM3", "device": "nvidia0"}
    if gpu is not None:
        labels[sr.DCGM_LABEL_INDEX] = gpu
    if uuid is not None:
        labels[sr.DCGM_LABEL_UUID] = uuid
    if host is not None:
        labels[sr.DCGM_LABEL_HOST] = host
    metrics = [gauge(name, [point(float(value), labels, time_ns=now)], unit="") for name, value in fields.items()]
    attrs = {v.RES_SERVICE_NAME: "dcgm-exporter", "service.instance.id": "10.0.0.7:9400"}
    if resource_host is not None:
        attrs[v.RES_HOST_NAME] = resource_host
    return metrics_request(attrs, metrics, scope="otelcol/prometheusreceiver")
