"""One tick of a rank's resource sampler as OTLP, every figure in it (process, GPU, host).

The shape `exporter.encoding.OtlpEncoder.add_resource_points` gives a `ResourceSnapshot`:
run and rank on the resource and on every point, `hw.id` / `hw.type=gpu` on the GPU
points, `cpu.mode` on the host's CPU points and `system.memory.state` on its memory
(local rank 0 only). For the surfaces' end-to-end tests, where a CPU-only machine has
no GPU to measure (the one thing faked) and psutil may be absent.
"""
from __future__ import annotations

from typing import Mapping

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb2

from harness.resource_payloads import gauge, metrics_request, point, rank_resource, updown
from traceml.schema import resources as sr
from traceml.schema import vocabulary as v


def sampler_request(run_id: str, rank: int, time_ns: int, *, host: str = "host-a", cpu: float = 0.5,
                    rss: int = 1 << 30, gpu_util: float | None = 0.8, gpu_memory: int = 8 << 30,
                    gpu_total: int = 80 << 30, temperature: float = 60.0, power: float = 200.0,
                    host_cpu_modes: Mapping[str, float] | None = None, host_memory_used: int = 32 << 30,
                    host_memory_total: int = 128 << 30) -> metrics_pb2.ExportMetricsServiceRequest:
    """`gpu_util=None`: no GPU (no `hw.*` point at all); `host_cpu_modes`: the host's points
    (as the node's local rank 0 sends them), none when None."""
    run_rank = {v.ATTR_RUN_ID: run_id, v.ATTR_RANK: rank}
    hw = {**run_rank, sr.ATTR_HW_ID: f"GPU-{rank:04d}-test", sr.ATTR_HW_TYPE: sr.HW_TYPE_GPU}
    metrics = [gauge(sr.PROCESS_CPU_UTILIZATION, [point(float(cpu), run_rank, time_ns=time_ns)]),
               updown(sr.PROCESS_MEMORY_USAGE, [point(int(rss), run_rank, time_ns=time_ns)])]
    if gpu_util is not None:
        metrics += [gauge(sr.GPU_UTILIZATION, [point(float(gpu_util), hw, time_ns=time_ns)]),
                    updown(sr.GPU_MEMORY_USAGE, [point(int(gpu_memory), hw, time_ns=time_ns)]),
                    updown(sr.GPU_MEMORY_LIMIT, [point(int(gpu_total), hw, time_ns=time_ns)]),
                    gauge(sr.HW_TEMPERATURE, [point(float(temperature), hw, time_ns=time_ns)], unit="Cel"),
                    gauge(sr.HW_POWER, [point(float(power), hw, time_ns=time_ns)], unit="W")]
    if host_cpu_modes is not None:
        metrics += [
            gauge(sr.SYSTEM_CPU_UTILIZATION, [point(float(share), {**run_rank, sr.ATTR_CPU_MODE: mode},
                                                    time_ns=time_ns) for mode, share in host_cpu_modes.items()]),
            updown(sr.SYSTEM_MEMORY_USAGE, [point(int(host_memory_used),
                                                  {**run_rank, sr.ATTR_MEMORY_STATE: sr.MEMORY_STATE_USED},
                                                  time_ns=time_ns)]),
            updown(sr.SYSTEM_MEMORY_LIMIT, [point(int(host_memory_total), run_rank, time_ns=time_ns)]),
        ]
    return metrics_request(rank_resource(run_id, rank, host=host, pid=4000 + rank), metrics)
