"""The decoder on resource metrics: each sender's names and units, the folds, the refusals."""
from __future__ import annotations

import math

import pytest
from opentelemetry.proto.metrics.v1 import metrics_pb2 as metric_data
from harness.resource_payloads import (
    counter,
    dcgm_request,
    gauge,
    hostmetrics_request,
    metrics_request,
    point,
    rank_resource,
    updown,
)

from traceml.processor import decode_metrics
from traceml.processor import store_records as d
from traceml.processor.decode import Decoder
from traceml.schema import resources as sr
from traceml.schema import vocabulary as v

T = 1_790_000_000_000_000_000  # ns
GIB = 1 << 30


def _records(batch):
    return {(rec.metric, rec.device): rec for rec in batch.resource_records}


def _rank_request(metrics, **resource):
    return metrics_request(rank_resource("run-1", 3, **resource), metrics)


def test_a_ranks_own_figures_are_stored_in_the_conventions_units_with_its_identity():
    gpu = {sr.ATTR_HW_ID: "GPU-abc", sr.ATTR_HW_TYPE: sr.HW_TYPE_GPU}
    batch = Decoder().decode_metrics(_rank_request([
        gauge(sr.PROCESS_CPU_UTILIZATION, [point(0.25, time_ns=T)]),
        updown(sr.PROCESS_MEMORY_USAGE, [point(3 * GIB, time_ns=T)]),
        updown(sr.SYSTEM_CPU_LOGICAL_COUNT, [point(64, time_ns=T)], unit="{cpu}"),
        updown(sr.SYSTEM_MEMORY_LIMIT, [point(512 * GIB, time_ns=T)]),
        gauge(sr.GPU_UTILIZATION, [point(0.9, gpu, time_ns=T)]),
        updown(sr.GPU_MEMORY_USAGE, [point(70 * GIB, gpu, time_ns=T)]),
        updown(sr.GPU_MEMORY_LIMIT, [point(80 * GIB, gpu, time_ns=T)]),
        gauge(sr.HW_TEMPERATURE, [point(61.0, gpu, time_ns=T)], unit="Cel"),
        gauge(sr.HW_POWER, [point(450.5, gpu, time_ns=T)], unit="W"),
        updown(sr.CUDA_MEMORY_ALLOCATED, [point(20 * GIB, {v.ATTR_DEVICE: "cuda:3"}, time_ns=T)]),
        updown(sr.CUDA_MEMORY_RESERVED, [point(24 * GIB, {v.ATTR_DEVICE: "cuda:3"}, time_ns=T)]),
    ]))
    assert not batch.rejected and not batch.ignored
    got = {(rec.metric, rec.device): rec.value for rec in batch.resource_records}
    assert got == {
        (sr.PROCESS_CPU_UTILIZATION, ""): 0.25, (sr.PROCESS_MEMORY_USAGE, ""): 3 * GIB,
        (sr.SYSTEM_CPU_LOGICAL_COUNT, ""): 64, (sr.SYSTEM_MEMORY_LIMIT, ""): 512 * GIB,
        (sr.GPU_UTILIZATION, "GPU-abc"): 0.9, (sr.GPU_MEMORY_USAGE, "GPU-abc"): 70 * GIB,
        (sr.GPU_MEMORY_LIMIT, "GPU-abc"): 80 * GIB, (sr.HW_TEMPERATURE, "GPU-abc"): 61.0,
        (sr.HW_POWER, "GPU-abc"): 450.5, (sr.CUDA_MEMORY_ALLOCATED, "cuda:3"): 20 * GIB,
        (sr.CUDA_MEMORY_RESERVED, "cuda:3"): 24 * GIB,
    }
    for rec in batch.resource_records:
        assert (rec.run_id, rec.global_rank, rec.host, rec.pid, rec.source) == ("run-1", 3, "host-a", 4242,
                                                                                sr.SOURCE_TRACEML)
        assert rec.sample_time == T / 1e9 and isinstance(rec.value, float)
    assert batch.record_count == 11 and batch.run_ids == {"run-1"}


def test_run_and_rank_on_the_points_when_the_resource_has_neither():
    attrs = {v.RES_HOST_NAME: "host-b"}
    batch = Decoder().decode_metrics(metrics_request(attrs, [
        updown(sr.PROCESS_MEMORY_USAGE, [point(GIB, {v.ATTR_RUN_ID: "run-2", v.ATTR_RANK: 5}, time_ns=T)])]))
    (rec,) = batch.resource_records
    assert (rec.run_id, rec.global_rank, rec.host, rec.pid, rec.source) == ("run-2", 5, "host-b", None,
                                                                            sr.SOURCE_TRACEML)


def test_a_rank_point_without_a_rank_is_rejected_and_the_rest_kept():
    attrs = rank_resource("run-1", 0)
    del attrs[v.ATTR_RANK]
    batch = Decoder().decode_metrics(metrics_request(attrs, [
        updown(sr.PROCESS_MEMORY_USAGE, [point(GIB, time_ns=T), point(GIB, {v.ATTR_RANK: 1}, time_ns=T)])]))
    assert batch.rejected == {d.MISSING_RANK: 1}
    assert [rec.global_rank for rec in batch.resource_records] == [1]


def test_host_cpu_modes_become_one_busy_fraction_one_minus_idle():
    modes = {"user": 0.30, "system": 0.10, "iowait": 0.05, "idle": 0.55}
    points = [point(value, {sr.ATTR_CPU_MODE: mode}, time_ns=T) for mode, value in modes.items()]
    batch = Decoder().decode_metrics(_rank_request([gauge(sr.SYSTEM_CPU_UTILIZATION, points)]))
    (rec,) = batch.resource_records
    assert rec.metric == sr.SYSTEM_CPU_UTILIZATION and rec.value == pytest.approx(0.45)
    assert (rec.run_id, rec.global_rank, rec.source) == ("run-1", 3, sr.SOURCE_TRACEML)
    assert batch.record_count == 1 and not batch.ignored


def test_without_an_idle_mode_the_busy_fraction_is_the_sum_of_the_modes_sent():
    points = [point(0.2, {sr.ATTR_CPU_MODE: "user"}, time_ns=T), point(0.1, {sr.ATTR_CPU_MODE: "system"}, time_ns=T)]
    (rec,) = Decoder().decode_metrics(_rank_request([gauge(sr.SYSTEM_CPU_UTILIZATION, points)])).resource_records
    assert rec.value == pytest.approx(0.3)


def test_hostmetrics_per_cpu_modes_are_averaged_over_the_cpus_in_both_attribute_spellings():
    cpus = [{"user": 0.9, "system": 0.05, "idle": 0.05}, {"user": 0.1, "idle": 0.9},
            {"user": 0.5, "wait": 0.1, "idle": 0.4}]
    for legacy in (False, True):
        batch = Decoder().decode_metrics(hostmetrics_request("node-7", cpu_modes=cpus, legacy=legacy, time_ns=T))
        (rec,) = batch.resource_records
        assert rec.value == pytest.approx((0.95 + 0.1 + 0.6) / 3)
        assert (rec.run_id, rec.global_rank, rec.host, rec.source, rec.device) == (
            None, None, "node-7", sr.SOURCE_HOSTMETRICS, "")
        assert not batch.rejected and not batch.ignored


def test_hostmetrics_cpu_seconds_become_busy_and_total_summed_over_cpus():
    cpus = [{"user": 100.0, "system": 20.0, "idle": 880.0}, {"user": 50.0, "steal": 1.5, "idle": 948.5}]
    batch = Decoder().decode_metrics(hostmetrics_request("node-7", cpu_seconds=cpus, time_ns=T))
    got = {rec.metric: rec.value for rec in batch.resource_records}
    assert got == {sr.SYSTEM_CPU_TIME_BUSY: pytest.approx(171.5), sr.SYSTEM_CPU_TIME_TOTAL: pytest.approx(2000.0)}
    assert all(rec.source == sr.SOURCE_HOSTMETRICS for rec in batch.resource_records)


def test_cpu_seconds_without_idle_are_not_folded_into_a_false_full_host():
    batch = Decoder().decode_metrics(hostmetrics_request("node-7", cpu_seconds=[{"user": 10.0, "system": 5.0}],
                                                         time_ns=T))
    assert batch.resource_records == [] and batch.ignored == {d.IGNORED_UNUSED_METRIC: 2}


def test_memory_keeps_the_used_state_and_sums_the_states_into_a_limit_when_none_was_sent():
    states = {"used": 40 * GIB, "free": 20 * GIB, "cached": 3 * GIB, "buffered": GIB, "slab_reclaimable": GIB}
    for legacy in (False, True):
        batch = Decoder().decode_metrics(hostmetrics_request("node-7", memory_states=states, legacy=legacy,
                                                             time_ns=T))
        got = {rec.metric: rec.value for rec in batch.resource_records}
        assert got == {sr.SYSTEM_MEMORY_USAGE: 40 * GIB, sr.SYSTEM_MEMORY_LIMIT: 64 * GIB}
        assert batch.ignored == {d.IGNORED_UNUSED_METRIC: 1}  # slab_reclaimable: inside `used`


def test_a_sent_limit_wins_over_the_sum_of_states():
    states = [point(40 * GIB, {sr.ATTR_MEMORY_STATE: s}, time_ns=T) for s in ("used", "free")]
    batch = Decoder().decode_metrics(_rank_request([
        updown(sr.SYSTEM_MEMORY_USAGE, states), updown(sr.SYSTEM_MEMORY_LIMIT, [point(100 * GIB, time_ns=T)])]))
    got = sorted((rec.metric, rec.value) for rec in batch.resource_records)
    assert got == [(sr.SYSTEM_MEMORY_LIMIT, 100 * GIB), (sr.SYSTEM_MEMORY_USAGE, 40 * GIB)]


def test_used_alone_gives_no_limit():
    batch = Decoder().decode_metrics(hostmetrics_request("node-7", memory_states={"used": GIB}, time_ns=T))
    assert [rec.metric for rec in batch.resource_records] == [sr.SYSTEM_MEMORY_USAGE]


def test_hostmetrics_process_figures_keep_the_pid_and_sum_their_modes():
    attrs = {v.RES_HOST_NAME: "node-7", sr.RES_PROCESS_PID: 777, "process.executable.name": "python"}
    batch = Decoder().decode_metrics(metrics_request(attrs, [
        updown(sr.PROCESS_MEMORY_USAGE, [point(5 * GIB, time_ns=T)]),
        gauge(sr.PROCESS_CPU_UTILIZATION, [point(0.2, {"state": "user"}, time_ns=T),
                                           point(0.05, {"state": "system"}, time_ns=T)]),
    ]))
    got = {rec.metric: (rec.value, rec.pid, rec.host, rec.source, rec.run_id) for rec in batch.resource_records}
    assert got == {sr.PROCESS_MEMORY_USAGE: (5 * GIB, 777, "node-7", sr.SOURCE_HOSTMETRICS, None),
                   sr.PROCESS_CPU_UTILIZATION: (pytest.approx(0.25), 777, "node-7", sr.SOURCE_HOSTMETRICS, None)}


def test_a_foreign_point_without_a_host_is_ignored_as_not_traceml():
    batch = Decoder().decode_metrics(hostmetrics_request(None, cpu_modes=[{"idle": 0.5, "user": 0.5}],
                                                         memory_states={"used": GIB}, time_ns=T))
    assert batch.resource_records == [] and batch.ignored == {d.IGNORED_FOREIGN: 3} and not batch.rejected


def test_gpu_and_allocator_names_from_a_foreign_sender_are_ignored():
    batch = Decoder().decode_metrics(metrics_request({v.RES_HOST_NAME: "node-7"}, [
        gauge(sr.GPU_UTILIZATION, [point(0.5, {sr.ATTR_HW_ID: "GPU-1"}, time_ns=T)]),
        updown(sr.CUDA_MEMORY_ALLOCATED, [point(GIB, time_ns=T)])]))
    assert batch.resource_records == [] and batch.ignored == {d.IGNORED_FOREIGN: 2}


def test_dcgm_fields_are_scaled_to_the_conventions_units_and_keyed_by_uuid():
    fields = {"DCGM_FI_DEV_GPU_UTIL": 87.0, "DCGM_FI_DEV_FB_USED": 40_000.0, "DCGM_FI_DEV_GPU_TEMP": 66.0,
              "DCGM_FI_DEV_POWER_USAGE": 512.25, "DCGM_FI_DEV_SM_CLOCK": 1980.0}
    batch = Decoder().decode_metrics(dcgm_request("node-7", fields, time_ns=T))
    got = {rec.metric: rec.value for rec in batch.resource_records}
    assert got == {sr.GPU_UTILIZATION: pytest.approx(0.87), sr.GPU_MEMORY_USAGE: 40_000 * (1 << 20),
                   sr.HW_TEMPERATURE: 66.0, sr.HW_POWER: 512.25}
    assert {(rec.host, rec.device, rec.source, rec.run_id) for rec in batch.resource_records} == {
        ("node-7", "GPU-1234", sr.SOURCE_DCGM, None)}
    assert batch.ignored == {d.IGNORED_FOREIGN: 1}  # SM clock: not a name TraceML reads


def test_dcgm_without_uuid_names_the_gpu_by_index_and_takes_the_resource_host():
    batch = Decoder().decode_metrics(dcgm_request(None, {"DCGM_FI_DEV_GPU_UTIL": 10.0}, uuid=None, gpu="3",
                                                  resource_host="node-9", time_ns=T))
    (rec,) = batch.resource_records
    assert (rec.host, rec.device, rec.value) == ("node-9", f"{sr.DEVICE_INDEX_PREFIX}3", pytest.approx(0.1))


def test_a_prometheus_staleness_marker_is_ignored_not_rejected():
    req = dcgm_request("node-7", {"DCGM_FI_DEV_GPU_UTIL": 50.0}, time_ns=T)
    req.resource_metrics[0].scope_metrics[0].metrics[0].gauge.data_points.append(
        point(math.nan, {"UUID": "GPU-1234", "Hostname": "node-7"}, time_ns=T + 1, flags=1))
    batch = Decoder().decode_metrics(req)
    assert len(batch.resource_records) == 1 and batch.ignored == {d.IGNORED_NO_VALUE: 1} and not batch.rejected


@pytest.mark.parametrize(("name", "value", "reason"), [
    (sr.PROCESS_CPU_UTILIZATION, math.nan, d.NON_FINITE),
    (sr.PROCESS_CPU_UTILIZATION, math.inf, d.NON_FINITE),
    (sr.PROCESS_CPU_UTILIZATION, -0.1, d.NEGATIVE),
    (sr.PROCESS_CPU_UTILIZATION, 1.6, d.ABSURD),
    (sr.GPU_UTILIZATION, 87.0, d.ABSURD),  # percent, not a fraction
    (sr.PROCESS_MEMORY_USAGE, 2**51, d.ABSURD),
    (sr.PROCESS_MEMORY_USAGE, -1, d.NEGATIVE),
    (sr.HW_TEMPERATURE, 1500.0, d.ABSURD),
    (sr.HW_POWER, 20_000.0, d.ABSURD),
    (sr.SYSTEM_CPU_LOGICAL_COUNT, 2**21, d.ABSURD),
])
def test_a_bad_value_is_rejected_with_its_reason_and_the_rest_kept(name, value, reason):
    batch = Decoder().decode_metrics(_rank_request([
        gauge(name, [point(value, {sr.ATTR_HW_ID: "GPU-1"}, time_ns=T)]),
        updown(sr.PROCESS_MEMORY_USAGE, [point(GIB, time_ns=T + 1)])]))
    assert batch.rejected == {reason: 1}
    assert [(rec.metric, rec.value) for rec in batch.resource_records] == [(sr.PROCESS_MEMORY_USAGE, GIB)]


def test_a_utilisation_a_little_over_one_is_stored_as_one():
    (rec,) = Decoder().decode_metrics(_rank_request([
        gauge(sr.PROCESS_CPU_UTILIZATION, [point(1.04, time_ns=T)])])).resource_records
    assert rec.value == 1.0


def test_a_folded_value_over_its_cap_is_rejected_with_its_points():
    points = [point(0.9, {sr.ATTR_CPU_MODE: m}, time_ns=T) for m in ("user", "system")]  # no idle: sum 1.8
    batch = Decoder().decode_metrics(_rank_request([gauge(sr.SYSTEM_CPU_UTILIZATION, points)]))
    assert batch.resource_records == [] and batch.rejected == {d.ABSURD: 2}


def test_time_zero_a_wrong_kind_and_wrong_attribute_types_are_rejected():
    hist = metric_data.Metric(name=sr.PROCESS_MEMORY_USAGE, histogram=metric_data.Histogram(
        data_points=[metric_data.HistogramDataPoint(time_unix_nano=T, count=1)]))
    batch = Decoder().decode_metrics(_rank_request([
        hist,
        updown(sr.PROCESS_MEMORY_USAGE, [point(GIB, time_ns=0)]),
        gauge(sr.GPU_UTILIZATION, [point(0.5, {sr.ATTR_HW_ID: 7}, time_ns=T)]),
        gauge(sr.SYSTEM_CPU_UTILIZATION, [point(0.5, {sr.ATTR_CPU_MODE: 1.5}, time_ns=T)]),
        updown(sr.CUDA_MEMORY_ALLOCATED, [point(GIB, {v.ATTR_DEVICE: "x" * 5000}, time_ns=T)]),
    ]))
    assert batch.rejected == {d.WRONG_TYPE: 3, d.MISSING_TIMESTAMP: 1, d.ATTRIBUTE_TOO_LARGE: 1}
    assert batch.resource_records == []


def test_an_oversized_foreign_host_name_is_rejected():
    batch = Decoder().decode_metrics(hostmetrics_request("h" * 5000, memory_states={"used": GIB}, time_ns=T))
    assert batch.rejected == {d.ATTRIBUTE_TOO_LARGE: 1} and batch.resource_records == []


def test_other_hw_components_and_unknown_names_stay_ignored_as_before():
    batch = Decoder().decode_metrics(_rank_request([
        gauge(sr.HW_TEMPERATURE, [point(40.0, {sr.ATTR_HW_ID: "fan0", sr.ATTR_HW_TYPE: "fan"}, time_ns=T)]),
        gauge("system.cpu.frequency", [point(3.1e9, time_ns=T)]),
        gauge(sr.SYSTEM_CPU_UTILIZATION.replace("cpu", "gpu"), [point(0.1, time_ns=T)]),
        counter(v.METRIC_EXPORT_FAILURES, [point(1, time_ns=T)], unit="{export}"),
    ]))
    assert batch.resource_records == []
    assert batch.ignored == {d.IGNORED_UNUSED_METRIC: 2, d.IGNORED_FOREIGN: 2}


def test_every_stored_metric_has_a_cap():
    assert set(sr.STORED_METRICS) <= set(decode_metrics._RESOURCE_CAPS)
