"""Resource snapshots on the wire: the conventions' names, units, instruments and attributes,
decoded with the official `opentelemetry-proto` classes; absent figures send no point.

The processor cannot store these yet, so the checks read the OTLP messages themselves:
the encoder's request serialised and parsed back, and what a real OTLP receiver got
from the exporter over gRPC and HTTP.
"""
from __future__ import annotations

import os

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1 import metrics_pb2

from harness.exporter_records import BASE_NS, identity
from harness.otlp_receiver import OtlpTestReceiver, attributes
from traceml.exporter import OtlpStepExporter, resolve_settings
from traceml.exporter.encoding import OtlpEncoder
from traceml.exporter.step_exporter import QUEUE_METRICS
from traceml.records import GpuReading, ResourceSnapshot
from traceml.schema import resources as r
from traceml.schema import vocabulary as v

SPECS = {spec.name: spec for spec in r.RESOURCE_METRICS}
CUMULATIVE = metrics_pb2.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
GPU_UUID = "GPU-5e1f0c2a-0000-0000-0000-000000000000"
START_NS = BASE_NS - 10_000_000_000

FULL = ResourceSnapshot(
    time_ns=BASE_NS, process_cpu_utilization=0.625, process_rss_bytes=3 << 30,
    cuda_device="cuda:1", cuda_allocated_bytes=5 << 30, cuda_reserved_bytes=6 << 30,
    gpu=GpuReading(GPU_UUID, utilization=0.87, memory_used_bytes=40 << 30, memory_total_bytes=80 << 30,
                   temperature_c=61.0, power_w=250.5),
    host_cpu_modes={"user": 0.5, "system": 0.125, "idle": 0.375},
    host_cpu_count=16, host_memory_used_bytes=20 << 30, host_memory_total_bytes=64 << 30,
    host_memory_by_state={"used": 20 << 30, "free": 30 << 30, "cached": 12 << 30, "buffers": 2 << 30})

CPU_ONLY_OTHER_RANK = ResourceSnapshot(  # no CUDA, no NVML, not local rank 0
    time_ns=BASE_NS, process_cpu_utilization=0.25, process_rss_bytes=1 << 30, cuda_device=None,
    cuda_allocated_bytes=None, cuda_reserved_bytes=None, gpu=None, host_cpu_modes=None, host_cpu_count=None,
    host_memory_used_bytes=None, host_memory_total_bytes=None, host_memory_by_state=None)


def _settings(endpoint="http://127.0.0.1:4317", protocol="grpc", env=None):
    return resolve_settings(endpoint, protocol, environ=env or {})


def _decoded(*snapshots) -> ExportMetricsServiceRequest:
    """The encoder's request for `snapshots`, serialised and parsed back as a receiver would."""
    encoder = OtlpEncoder(identity("res-run", rank=3, world_size=4), _settings())
    batch = encoder.new_metrics_batch()
    for snapshot in snapshots:
        encoder.add_resource_points(batch, snapshot, START_NS)
    return ExportMetricsServiceRequest.FromString(batch.request.SerializeToString())


def _metrics(request) -> dict:
    (resource_metrics,) = request.resource_metrics
    (scope_metrics,) = resource_metrics.scope_metrics
    return {metric.name: metric for metric in scope_metrics.metrics}


def _points(metric):
    return list(getattr(metric, metric.WhichOneof("data")).data_points)


def test_every_resource_metric_has_its_specs_name_unit_description_and_instrument():
    metrics = _metrics(_decoded(FULL))
    assert set(metrics) == set(SPECS)  # the full snapshot sends every one of them
    for name, metric in metrics.items():
        spec = SPECS[name]
        assert (metric.unit, metric.description) == (spec.unit, spec.description), name
        if spec.kind == "gauge":
            assert metric.WhichOneof("data") == "gauge", name
            assert all(p.WhichOneof("value") == "as_double" and p.start_time_unix_nano == 0
                       for p in _points(metric)), name
        else:  # an UpDownCounter: a cumulative, non-monotonic sum of whole numbers
            assert spec.kind == "updowncounter" and metric.WhichOneof("data") == "sum", name
            assert (metric.sum.is_monotonic, metric.sum.aggregation_temporality) == (False, CUMULATIVE), name
            assert all(p.WhichOneof("value") == "as_int" and p.start_time_unix_nano == START_NS
                       for p in _points(metric)), name
        for point in _points(metric):
            attrs = attributes(point.attributes)
            assert set(attrs) == set(spec.attributes), name
            assert (attrs[v.ATTR_RUN_ID], attrs[v.ATTR_RANK]) == ("res-run", 3)
            assert point.time_unix_nano == BASE_NS


def _values(metrics, name, key=None) -> dict:
    out = {}
    for point in _points(metrics[name]):
        attrs = attributes(point.attributes)
        out[attrs.get(key) if key else None] = getattr(point, point.WhichOneof("value"))
    return out


def test_the_values_and_the_per_mode_state_and_device_attributes():
    metrics = _metrics(_decoded(FULL))
    assert _values(metrics, r.PROCESS_CPU_UTILIZATION) == {None: 0.625}
    assert _values(metrics, r.PROCESS_MEMORY_USAGE) == {None: 3 << 30}
    assert _values(metrics, r.SYSTEM_CPU_UTILIZATION, r.ATTR_CPU_MODE) == {"user": 0.5, "system": 0.125, "idle": 0.375}
    assert _values(metrics, r.SYSTEM_CPU_LOGICAL_COUNT) == {None: 16}
    assert _values(metrics, r.SYSTEM_MEMORY_USAGE, r.ATTR_MEMORY_STATE) == {
        "used": 20 << 30, "free": 30 << 30, "cached": 12 << 30, "buffers": 2 << 30}
    assert _values(metrics, r.SYSTEM_MEMORY_LIMIT) == {None: 64 << 30}
    assert _values(metrics, r.GPU_UTILIZATION, r.ATTR_HW_ID) == {GPU_UUID: 0.87}
    assert _values(metrics, r.GPU_MEMORY_USAGE, r.ATTR_HW_ID) == {GPU_UUID: 40 << 30}
    assert _values(metrics, r.GPU_MEMORY_LIMIT, r.ATTR_HW_ID) == {GPU_UUID: 80 << 30}
    assert _values(metrics, r.HW_TEMPERATURE, r.ATTR_HW_ID) == {GPU_UUID: 61.0}
    assert _values(metrics, r.HW_POWER, r.ATTR_HW_ID) == {GPU_UUID: 250.5}
    for name in r.GPU_METRICS:
        assert {attributes(p.attributes)[r.ATTR_HW_TYPE] for p in _points(metrics[name])} == {r.HW_TYPE_GPU}
    assert _values(metrics, r.CUDA_MEMORY_ALLOCATED, v.ATTR_DEVICE) == {"cuda:1": 5 << 30}
    assert _values(metrics, r.CUDA_MEMORY_RESERVED, v.ATTR_DEVICE) == {"cuda:1": 6 << 30}


def test_a_gpu_less_snapshot_of_another_local_rank_sends_only_process_points():
    metrics = _metrics(_decoded(CPU_ONLY_OTHER_RANK))
    assert set(metrics) == {r.PROCESS_CPU_UTILIZATION, r.PROCESS_MEMORY_USAGE}
    assert not any(name.startswith(("hw.", "system.", "traceml.cuda")) for name in metrics)


def test_a_failed_nvml_field_sends_no_point_and_the_others_still_go():
    gpu = FULL.gpu._replace(utilization=None, power_w=None)
    metrics = _metrics(_decoded(FULL._replace(gpu=gpu)))
    assert r.GPU_UTILIZATION not in metrics and r.HW_POWER not in metrics
    assert {r.GPU_MEMORY_USAGE, r.GPU_MEMORY_LIMIT, r.HW_TEMPERATURE} <= set(metrics)


def test_used_memory_without_a_breakdown_is_the_used_state():
    metrics = _metrics(_decoded(CPU_ONLY_OTHER_RANK._replace(host_memory_used_bytes=9, host_memory_total_bytes=10)))
    assert _values(metrics, r.SYSTEM_MEMORY_USAGE, r.ATTR_MEMORY_STATE) == {"used": 9}


def test_the_point_count_returned_is_what_the_request_holds():
    encoder = OtlpEncoder(identity("count"), _settings())
    batch = encoder.new_metrics_batch()
    assert encoder.add_resource_points(batch, FULL, START_NS) == len(batch) == 18
    assert encoder.add_resource_points(batch, CPU_ONLY_OTHER_RANK, START_NS) == 2


def test_several_snapshots_share_one_request_one_metric_each():
    later = FULL._replace(time_ns=BASE_NS + 5_000_000_000, process_cpu_utilization=0.5)
    metrics = _metrics(_decoded(FULL, later))
    assert [p.as_double for p in _points(metrics[r.PROCESS_CPU_UTILIZATION])] == [0.625, 0.5]
    assert len(_points(metrics[r.SYSTEM_CPU_UTILIZATION])) == 6


def test_a_snapshot_that_cannot_be_encoded_adds_no_point():
    encoder = OtlpEncoder(identity("bad"), _settings())
    batch = encoder.new_metrics_batch()
    with pytest.raises((TypeError, ValueError)):
        encoder.add_resource_points(batch, FULL._replace(cuda_reserved_bytes="lots"), START_NS)
    assert len(batch) == 0


def test_the_ranks_resource_carries_its_process_pid():
    encoder = OtlpEncoder(identity("pid"), _settings())
    assert attributes(encoder.resource.attributes)[r.RES_PROCESS_PID] == os.getpid()


# --- through the exporter to a real receiver -------------------------------------------------


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_the_exporter_sends_queued_snapshots_as_resource_metrics(receiver, protocol):
    run_id = f"res-e2e-{protocol}"
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    exporter = OtlpStepExporter(identity(run_id), _settings(endpoint, protocol), instrumentation_drops=lambda: {})
    exporter.on_resources(FULL)
    exporter.on_resources(CPU_ONLY_OTHER_RANK._replace(time_ns=BASE_NS + 1))
    assert exporter.shutdown(10.0)
    stats = exporter.stats()
    assert stats.resources_exported == 2 and stats.failures[v.SIGNAL_METRICS] == 0
    got = [(metric, point) for res, metric, point in receiver.metric_points()
           if res.get(v.ATTR_RUN_ID) == run_id and metric.name in SPECS]
    assert {metric.name for metric, _ in got} == set(SPECS)
    # FULL: process 2, CPU modes 3, CPU count 1, memory states 4 and limit 1, GPU 5, allocator 2;
    # then the CPU-only snapshot's 2.
    assert len(got) == 18 + 2
    gauges = {m.name for m, _ in got if m.WhichOneof("data") == "gauge"}
    assert gauges == {s.name for s in r.RESOURCE_METRICS if s.kind == "gauge"}
    (res,) = {tuple(sorted(res.items())) for res, metric, _ in receiver.metric_points()
              if res.get(v.ATTR_RUN_ID) == run_id and metric.name in SPECS}
    assert dict(res)[r.RES_PROCESS_PID] == os.getpid() and dict(res)[v.RES_HOST_NAME] == "host-a"


@pytest.mark.slow
def test_a_full_resource_queue_drops_and_counts_under_metrics():
    with OtlpTestReceiver(mode="stall", stall_s=30.0) as stalled:
        settings = _settings(stalled.grpc_endpoint, env={"TRACEML_EXPORT_QUEUE_SIZE": "4"})
        exporter = OtlpStepExporter(identity("res-full"), settings, instrumentation_drops=lambda: {})
        exporter.on_resources(FULL)
        exporter.force_flush(0.0)  # wake the worker: it sends FULL and stalls there
        assert stalled.wait_for(lambda: stalled.calls["grpc"] >= 1, 10.0)
        for i in range(10):
            exporter.on_resources(FULL._replace(time_ns=BASE_NS + i + 1))
        stats = exporter.stats()
        assert stats.queued_resources == 4 and stats.dropped[QUEUE_METRICS] == 6
        stalled.release_stalls()
        assert exporter.shutdown(10.0)
        assert exporter.stats().resources_exported == 5


@pytest.mark.slow
def test_a_rejected_resource_request_counts_its_points_as_metrics_failures():
    with OtlpTestReceiver(mode="reject") as rejecting:
        rejecting.failures_left = 1
        exporter = OtlpStepExporter(identity("res-reject"), _settings(rejecting.grpc_endpoint),
                                    instrumentation_drops=lambda: {})
        exporter.on_resources(CPU_ONLY_OTHER_RANK)
        assert exporter.force_flush(10.0)
        stats = exporter.stats()
        assert stats.failures[v.SIGNAL_METRICS] == 2 and stats.resources_exported == 0
        assert exporter.shutdown(10.0)


@pytest.mark.slow
def test_a_cpu_run_sends_process_and_host_metrics_and_nothing_of_a_gpu(fresh_receiver, monkeypatch):
    """traceml.init() on this CPU machine: the real sampler, the real exporter, a real receiver."""
    import time

    import traceml
    from traceml._testing import reset_for_tests

    for name in ("LOCAL_RANK", "SLURM_LOCALID", "RANK", "SLURM_PROCID", "TRACEML_RESOURCES", "TRACEML_DISABLE",
                 "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRACEML_RESOURCE_INTERVAL", "0.2")
    run_id = "res-cpu-run"
    reset_for_tests()
    traceml.init(mode="manual", endpoint=fresh_receiver.grpc_endpoint, protocol="grpc", run_id=run_id)
    try:
        sampler = traceml._resource_sampler
        deadline = time.monotonic() + 10
        while sampler.ticks < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        traceml.shutdown()
        reset_for_tests()
    names = {metric.name for res, metric, _ in fresh_receiver.metric_points() if res.get(v.ATTR_RUN_ID) == run_id}
    assert {r.PROCESS_CPU_UTILIZATION, r.PROCESS_MEMORY_USAGE, r.SYSTEM_CPU_UTILIZATION, r.SYSTEM_CPU_LOGICAL_COUNT,
            r.SYSTEM_MEMORY_USAGE, r.SYSTEM_MEMORY_LIMIT} <= names
    assert not names & {*r.GPU_METRICS, r.CUDA_MEMORY_ALLOCATED, r.CUDA_MEMORY_RESERVED}


def test_wire_format_lists_every_resource_metric_with_its_instrument_unit_attributes_and_description():
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "wire-format.md").read_text()
    section = doc.split("\n## Resource metrics", 1)[1].split("\n## ", 1)[0]
    assert f"v{r.SEMCONV_VERSION}" in section
    assert "`TRACEML_RESOURCE_INTERVAL`" in section and "`TRACEML_RESOURCES=0`" in section
    instrument = {"gauge": "gauge (double)", "updowncounter": "UpDownCounter (int)"}
    for spec in r.RESOURCE_METRICS:
        row = next((line for line in section.splitlines() if line.startswith(f"| `{spec.name}` |")), None)
        assert row is not None, spec.name
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[1] == instrument[spec.kind] and cells[2] == f"`{spec.unit}`", spec.name
        further = {a.strip("` ") for a in cells[3].split(",") if a.strip()}
        assert further == set(spec.attributes) - {v.ATTR_RUN_ID, v.ATTR_RANK}, spec.name
        assert cells[5] == spec.description, spec.name
    assert f"`{r.RES_PROCESS_PID}`" in doc.split("\n## Resource (", 1)[1].split("\n## ", 1)[0]
