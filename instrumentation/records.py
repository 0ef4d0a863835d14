"""What the training-side samplers hand to the exporter (one typed record per finished step).

These are the boundary between `traceml` (instrumentation) and `traceml.exporter`.
Standard library only. Values are exactly what the samplers measured: a missing
GPU time is `None`, never 0. Immutable named tuples rather than frozen dataclasses:
the samplers build about ten per step while holding the GIL, and a frozen dataclass
costs three times as much to construct (they are built with `tuple.__new__`).
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Protocol


class EventTotals(NamedTuple):
    """One raw event summed over a step: repeated occurrences add up, clocks stay separate."""

    cpu_ms: float
    gpu_ms: float | None
    count: int


class PhaseInterval(NamedTuple):
    """One occurrence of a raw event on the wall clock (for trace-viewer child spans)."""

    raw_event: str
    start_time_ns: int
    end_time_ns: int


class ResolvedStepTime(NamedTuple):
    """One published StepTimeBatch after CUDA timing resolved (or was unavailable).

    `start_time_ns`/`end_time_ns` are wall-clock (time.time_ns epoch) bounds of the
    step's first and last event, derived from the captured perf_counter values.
    `parent` is the job's own OpenTelemetry `SpanContext` that was current when the
    step began (opaque here: nothing on this side imports OpenTelemetry), or None.
    `strategy`: the training strategy recognised from the model (`fsdp`, `sharding`), or
    None when nothing was (the resource's stands).
    """

    step: int
    start_time_ns: int
    end_time_ns: int
    events: Mapping[str, EventTotals]
    phases: tuple[PhaseInterval, ...] = ()
    parent: object = None
    strategy: str | None = None


class StepMemorySnapshot(NamedTuple):
    """Peak allocator memory of the tracked device over one step; None on non-CUDA devices."""

    step: int
    device: str
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    time_ns: int


class GpuReading(NamedTuple):
    """One NVML reading of the rank's GPU; a field NVML could not give is None (never 0)."""

    hw_id: str  # the NVML UUID (`GPU-...`), DCGM's `UUID` label too
    utilization: float | None  # 0..1
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    temperature_c: float | None
    power_w: float | None


class ResourceSnapshot(NamedTuple):
    """One tick of the resource sampler (its own thread; nothing here is per step).

    Every field is None when it was not measured: no psutil, no CUDA, no NVML, or (host
    fields) not this node's local rank 0, which alone reports the host for its node.
    `cpu_modes`: the host's CPU time per mode since the previous tick over elapsed time
    and CPUs (`user`, `system`, `idle`, `iowait`, ...), summing to about 1.
    """

    time_ns: int
    process_cpu_utilization: float | None
    process_rss_bytes: int | None
    cuda_device: str | None  # `cuda:N` whose allocator is read below
    cuda_allocated_bytes: int | None
    cuda_reserved_bytes: int | None
    gpu: GpuReading | None
    host_cpu_modes: Mapping[str, float] | None
    host_cpu_count: int | None
    host_memory_used_bytes: int | None
    host_memory_total_bytes: int | None
    host_memory_by_state: Mapping[str, int] | None


class TelemetrySink(Protocol):
    """Receives finished records on a sampler thread (never on the training thread).

    A sink may also have `on_resources(ResourceSnapshot)`, called on the resource
    sampler's thread; sinks without it get no resource snapshots."""

    def on_step_time(self, record: ResolvedStepTime) -> None: ...

    def on_step_memory(self, record: StepMemorySnapshot) -> None: ...
