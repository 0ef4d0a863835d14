"""A rank's resource samples as the processor stores them (`ResourceIngestRecord`s for the real writer).

For surface tests on a real store through the real pipeline: one record per stored metric
per time, in the conventions' units, as `processor.decode` hands a rank's sampler points
to storage (`schema.resources.STORED_METRICS`; the host's CPU as its busy fraction).
"""
from __future__ import annotations

from typing import Iterable

from traceml.processor.step_time.model import ResourceIngestRecord
from traceml.schema import resources as sr


def rank_resource_records(run_id: str, rank: int, times: Iterable[float], *, host: str = "node0",
                          cpu: float = 0.5, rss: float = float(1 << 30), gpu_util: float | None = 0.8,
                          gpu_memory: float = float(8 << 30), temperature: float = 60.0, power: float = 200.0,
                          host_cpu: float | None = None, host_memory_used: float = float(32 << 30),
                          host_memory_total: float = float(128 << 30)) -> list[ResourceIngestRecord]:
    """`gpu_util=None`: no GPU; `host_cpu`: the host's busy fraction, sent by this rank (its node's
    local rank 0), none when None."""
    out = []
    uuid = f"GPU-{rank:04d}-test"

    def add(metric: str, device: str, value: float, t: float) -> None:
        out.append(ResourceIngestRecord(run_id=run_id, global_rank=rank, host=host, device=device, metric=metric,
                                        sample_time=t, value=float(value), source=sr.SOURCE_TRACEML,
                                        pid=4000 + rank))

    for t in times:
        add(sr.PROCESS_CPU_UTILIZATION, "", cpu, t)
        add(sr.PROCESS_MEMORY_USAGE, "", rss, t)
        if gpu_util is not None:
            add(sr.GPU_UTILIZATION, uuid, gpu_util, t)
            add(sr.GPU_MEMORY_USAGE, uuid, gpu_memory, t)
            add(sr.HW_TEMPERATURE, uuid, temperature, t)
            add(sr.HW_POWER, uuid, power, t)
        if host_cpu is not None:
            add(sr.SYSTEM_CPU_UTILIZATION, "", host_cpu, t)
            add(sr.SYSTEM_MEMORY_USAGE, "", host_memory_used, t)
            add(sr.SYSTEM_MEMORY_LIMIT, "", host_memory_total, t)
    return out
