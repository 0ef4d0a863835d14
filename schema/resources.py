"""Resource metrics on the wire: process, host and GPU, in OpenTelemetry's semantic conventions.

Standard library only (the lowest layer). The training side's resource sampler
sends these names; the processor reads them, and also the same facts when another
sender made them: the Collector's `hostmetrics` receiver (`system.*`, `process.*`,
older attribute spellings included) and NVIDIA's DCGM exporter scraped through the
Collector's Prometheus receiver (`DCGM_FI_DEV_*`). Every name below was checked
against the semantic conventions v1.45.0 (system, process and hardware/GPU pages;
all of them still "Development" there); `docs/wire-format.md` lists them for people.

Attributes stay bounded: run and rank on every point (as the telemetry counters),
host on the resource (`host.name`), and for a GPU its `hw.id` (the NVML UUID, the
same string DCGM's `UUID` label carries) with `hw.type=gpu`. Nothing carries a step.
A value that was not measured is not sent (no GPU, no NVML: no `hw.*` point at all).
"""
from __future__ import annotations

from typing import Mapping

from traceml.schema.vocabulary import ATTR_DEVICE, ATTR_RANK, ATTR_RUN_ID, MetricSpec

SEMCONV_VERSION = "1.45.0"
"""The semantic conventions release the names and units below were checked against."""

# --- Names (semantic conventions unless they start with `traceml.`) --------------------
PROCESS_CPU_UTILIZATION = "process.cpu.utilization"
"""Gauge, 1: process CPU time since the last sample / (elapsed time x CPUs available to it)."""
PROCESS_MEMORY_USAGE = "process.memory.usage"
"""UpDownCounter, By: the process's resident set size."""
SYSTEM_CPU_UTILIZATION = "system.cpu.utilization"
"""Gauge, 1, by `cpu.mode` (user, system, idle, iowait, ...): the host's CPUs, averaged."""
SYSTEM_CPU_TIME = "system.cpu.time"
"""Counter, s, by `cpu.mode` (and `cpu.logical_number`): what `hostmetrics` sends by default."""
SYSTEM_CPU_LOGICAL_COUNT = "system.cpu.logical.count"
"""UpDownCounter, {cpu}: logical CPUs of the host."""
SYSTEM_MEMORY_USAGE = "system.memory.usage"
"""UpDownCounter, By, by `system.memory.state` (used, free, cached, buffers)."""
SYSTEM_MEMORY_LIMIT = "system.memory.limit"
"""UpDownCounter, By: total physical memory of the host."""
GPU_UTILIZATION = "hw.gpu.utilization"
"""Gauge, 1: fraction of the sample period a kernel ran on the GPU (NVML's utilization.gpu / 100)."""
GPU_MEMORY_USAGE = "hw.gpu.memory.usage"
"""UpDownCounter, By: device memory in use (every process's, as NVML counts it)."""
GPU_MEMORY_LIMIT = "hw.gpu.memory.limit"
"""UpDownCounter, By: device memory size."""
HW_TEMPERATURE = "hw.temperature"
"""Gauge, Cel, with `hw.type=gpu`: the GPU's temperature."""
HW_POWER = "hw.power"
"""Gauge, W, with `hw.type=gpu`: the GPU's power draw."""
CUDA_MEMORY_ALLOCATED = "traceml.cuda.memory.allocated"
"""UpDownCounter, By, with `traceml.device`: PyTorch's caching allocator, bytes held by tensors
(no convention covers an allocator inside a process)."""
CUDA_MEMORY_RESERVED = "traceml.cuda.memory.reserved"
"""UpDownCounter, By, with `traceml.device`: bytes the caching allocator holds from the driver."""

# --- Attributes --------------------------------------------------------------------------
ATTR_CPU_MODE = "cpu.mode"
ATTR_CPU_LOGICAL_NUMBER = "cpu.logical_number"
ATTR_MEMORY_STATE = "system.memory.state"
ATTR_HW_ID = "hw.id"
ATTR_HW_TYPE = "hw.type"
HW_TYPE_GPU = "gpu"
RES_PROCESS_PID = "process.pid"
"""On each rank's resource (a convention resource attribute): how `hostmetrics`' process scraper,
which names its resources by pid and host, joins a foreign `process.*` point to a rank."""

LEGACY_ATTRIBUTES: Mapping[str, str] = {"state": ATTR_CPU_MODE, "cpu": ATTR_CPU_LOGICAL_NUMBER}
"""Spellings `hostmetrics` used before the conventions renamed them (`state` also stood for
`system.memory.state` on memory points)."""

CPU_MODE_IDLE = "idle"
MEMORY_STATE_USED = "used"
MEMORY_STATES_TOTAL = ("used", "free", "cached", "buffered", "buffers")
"""States whose sum is the host's memory when no limit is sent (`slab_*` overlap `used`)."""

# DCGM exporter field names (Prometheus names, kept by the Collector's Prometheus receiver),
# their labels, and what each becomes: (stored metric, factor to the convention's unit).
DCGM_METRICS: Mapping[str, tuple[str, float]] = {
    "DCGM_FI_DEV_GPU_UTIL": (GPU_UTILIZATION, 0.01),  # percent
    "DCGM_FI_DEV_FB_USED": (GPU_MEMORY_USAGE, float(1 << 20)),  # MiB
    "DCGM_FI_DEV_GPU_TEMP": (HW_TEMPERATURE, 1.0),  # degrees C
    "DCGM_FI_DEV_POWER_USAGE": (HW_POWER, 1.0),  # W
}
DCGM_LABEL_HOST = "Hostname"
DCGM_LABEL_UUID = "UUID"
DCGM_LABEL_INDEX = "gpu"

SYSTEM_CPU_TIME_BUSY = "system.cpu.time.busy"
SYSTEM_CPU_TIME_TOTAL = "system.cpu.time.total"
"""Stored from `system.cpu.time` (cumulative seconds, summed over the host's CPUs): all modes but
idle, and all modes. Utilisation is the busy delta over the total delta of consecutive samples."""

# --- What the processor stores (resource_samples.metric): one value per (host, device, time) --
STORED_METRICS: tuple[str, ...] = (
    PROCESS_CPU_UTILIZATION, PROCESS_MEMORY_USAGE,
    SYSTEM_CPU_UTILIZATION,  # busy fraction: 1 - idle, averaged over the host's CPUs
    SYSTEM_CPU_LOGICAL_COUNT,
    SYSTEM_MEMORY_USAGE,  # the `used` state only
    SYSTEM_MEMORY_LIMIT,
    GPU_UTILIZATION, GPU_MEMORY_USAGE, GPU_MEMORY_LIMIT, HW_TEMPERATURE, HW_POWER,
    CUDA_MEMORY_ALLOCATED, CUDA_MEMORY_RESERVED,
    SYSTEM_CPU_TIME_BUSY, SYSTEM_CPU_TIME_TOTAL,
)
HOST_METRICS: tuple[str, ...] = (SYSTEM_CPU_UTILIZATION, SYSTEM_CPU_LOGICAL_COUNT, SYSTEM_MEMORY_USAGE,
                                 SYSTEM_MEMORY_LIMIT, SYSTEM_CPU_TIME_BUSY, SYSTEM_CPU_TIME_TOTAL)
"""Stored per host (no rank): one node's figures, whichever rank or foreign sender sent them."""
GPU_METRICS: tuple[str, ...] = (GPU_UTILIZATION, GPU_MEMORY_USAGE, GPU_MEMORY_LIMIT, HW_TEMPERATURE, HW_POWER)
"""Stored per device (`hw.id`), joined to the rank that named that device."""

SOURCE_TRACEML = "traceml"
SOURCE_HOSTMETRICS = "hostmetrics"
SOURCE_DCGM = "dcgm"
SOURCES: tuple[str, ...] = (SOURCE_TRACEML, SOURCE_HOSTMETRICS, SOURCE_DCGM)

DEVICE_INDEX_PREFIX = "index:"
"""A device known only by its index on the host (DCGM's `gpu` label, a rank's `cuda:N` without
NVML): `index:0`. The UUID is preferred when either side knows it."""

_RUN_RANK = (ATTR_RUN_ID, ATTR_RANK)

RESOURCE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(PROCESS_CPU_UTILIZATION, "1",
               "CPU time of the rank's process since the last sample over elapsed time and the CPUs available "
               "to it.", _RUN_RANK),
    MetricSpec(PROCESS_MEMORY_USAGE, "By", "Resident set size of the rank's process.", _RUN_RANK,
               kind="updowncounter"),
    MetricSpec(SYSTEM_CPU_UTILIZATION, "1",
               "Fraction of the host's CPU time in each mode since the last sample, averaged over its CPUs "
               "(sent by local rank 0).", (*_RUN_RANK, ATTR_CPU_MODE)),
    MetricSpec(SYSTEM_CPU_LOGICAL_COUNT, "{cpu}", "Logical CPUs of the host (sent by local rank 0).",
               _RUN_RANK, kind="updowncounter"),
    MetricSpec(SYSTEM_MEMORY_USAGE, "By", "Host memory by state (sent by local rank 0).",
               (*_RUN_RANK, ATTR_MEMORY_STATE), kind="updowncounter"),
    MetricSpec(SYSTEM_MEMORY_LIMIT, "By", "Total host memory (sent by local rank 0).", _RUN_RANK,
               kind="updowncounter"),
    MetricSpec(GPU_UTILIZATION, "1", "Fraction of the sample period a kernel ran on the rank's GPU (NVML).",
               (*_RUN_RANK, ATTR_HW_ID, ATTR_HW_TYPE)),
    MetricSpec(GPU_MEMORY_USAGE, "By", "Memory in use on the rank's GPU, every process's (NVML).",
               (*_RUN_RANK, ATTR_HW_ID, ATTR_HW_TYPE), kind="updowncounter"),
    MetricSpec(GPU_MEMORY_LIMIT, "By", "Memory size of the rank's GPU (NVML).",
               (*_RUN_RANK, ATTR_HW_ID, ATTR_HW_TYPE), kind="updowncounter"),
    MetricSpec(HW_TEMPERATURE, "Cel", "Temperature of the rank's GPU (NVML).",
               (*_RUN_RANK, ATTR_HW_ID, ATTR_HW_TYPE)),
    MetricSpec(HW_POWER, "W", "Power draw of the rank's GPU (NVML).", (*_RUN_RANK, ATTR_HW_ID, ATTR_HW_TYPE)),
    MetricSpec(CUDA_MEMORY_ALLOCATED, "By", "Bytes PyTorch's CUDA caching allocator holds in tensors.",
               (*_RUN_RANK, ATTR_DEVICE), kind="updowncounter"),
    MetricSpec(CUDA_MEMORY_RESERVED, "By", "Bytes PyTorch's CUDA caching allocator holds from the driver.",
               (*_RUN_RANK, ATTR_DEVICE), kind="updowncounter"),
)
"""What each rank's resource sampler sends (`exporter.encoding` builds the points from these)."""
