"""A GPU in a real rank on a machine without one: a fake `pynvml` and a CUDA device that only
the resource sampler's thread sees.

What a rank's resource sampler needs before it reads a GPU (`traceml.resources`): the job's
torch has CUDA initialised (`torch.cuda.is_initialized()`, the device, its UUID, the caching
allocator's counters) and `import pynvml` gives an NVML that finds that UUID. Neither can
exist here, and nothing else of the rank is faked: `install` replaces those five
`torch.cuda` queries with ones that answer for the device only on the sampler's thread
(`ResourceSampler.name`) and as the CPU build does everywhere else, so the training thread,
TraceML's step timing (CUDA events only once CUDA is in use on that thread) and torch's own
seeding still see a CPU-only torch; and puts a one-device NVML module in `sys.modules`,
where the sampler imports it from. Everything after that is the product's own path: NVML
handle by UUID, the readings, the exporter's `hw.*` points with `hw.id`, the processor's
intake and the ledger's device count.

`HARNESS_FAKE_GPUS` (`rank=uuid,rank=uuid`) says which ranks of a launch have which GPU, so
one environment serves every rank of `traceml run`; `harness.fake_gpu_demo` reads it.
"""
from __future__ import annotations

import sys
import threading
import types
from typing import Mapping

FAKE_GPUS_ENV = "HARNESS_FAKE_GPUS"
UTILIZATION_PERCENT = 93  # busy: a low figure would add a LOW_GPU_UTILIZATION finding
MEMORY_TOTAL_BYTES = 80 << 30
MEMORY_USED_BYTES = 30 << 30
ALLOCATED_BYTES = 6 << 30
RESERVED_BYTES = 8 << 30


def fake_gpus_value(gpus: Mapping[int, str]) -> str:
    """`HARNESS_FAKE_GPUS`'s value for `{rank: uuid}`."""
    return ",".join(f"{rank}={uuid}" for rank, uuid in sorted(gpus.items()))


def parse_fake_gpus(value: str | None) -> dict[int, str]:
    out: dict[int, str] = {}
    for entry in (value or "").split(","):
        rank, sep, uuid = entry.partition("=")
        if sep and rank.strip().isdigit() and uuid.strip():
            out[int(rank)] = uuid.strip()
    return out


class NVMLError(Exception):
    pass


def fake_nvml_module(uuid: str) -> types.ModuleType:
    """A `pynvml` with one device, `uuid` (`GPU-...`), busy and at a steady temperature and power."""
    nvml = types.ModuleType("pynvml")
    nvml.NVML_TEMPERATURE_GPU = 0
    nvml.NVMLError = NVMLError
    handle = ("fake-nvml-handle", uuid)

    def by_uuid(wanted):
        if wanted != uuid:
            raise NVMLError("not found")
        return handle

    def by_index(index):
        if index != 0:
            raise NVMLError("invalid index")
        return handle

    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetCount = lambda: 1
    nvml.nvmlDeviceGetHandleByIndex = by_index
    nvml.nvmlDeviceGetHandleByUUID = by_uuid
    nvml.nvmlDeviceGetUUID = lambda h: h[1]
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=UTILIZATION_PERCENT, memory=40)
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=MEMORY_TOTAL_BYTES, used=MEMORY_USED_BYTES, free=MEMORY_TOTAL_BYTES - MEMORY_USED_BYTES)
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: 61
    nvml.nvmlDeviceGetPowerUsage = lambda h: 250_000  # milliwatts
    return nvml


def install(uuid: str, torch_module=None) -> None:
    """Give this process the GPU `uuid` (`GPU-...`), seen by the resource sampler's thread only."""
    from traceml.resources import ResourceSampler

    if not uuid.startswith("GPU-"):
        raise ValueError(f"an NVML UUID starts with GPU-: {uuid!r}")
    if torch_module is None:
        import torch as torch_module
    cuda = torch_module.cuda
    sampler_thread = ResourceSampler.name
    properties = types.SimpleNamespace(uuid=uuid[len("GPU-"):], name="Fake GPU (harness.fake_gpu)")

    def on_sampler() -> bool:
        return threading.current_thread().name == sampler_thread

    def seen_by_sampler(original, fake):
        def query(*args, **kwargs):
            return fake(*args, **kwargs) if on_sampler() else original(*args, **kwargs)
        return query

    cuda.is_initialized = seen_by_sampler(cuda.is_initialized, lambda: True)
    cuda.device_count = seen_by_sampler(cuda.device_count, lambda: 1)
    cuda.get_device_properties = seen_by_sampler(cuda.get_device_properties, lambda index=None: properties)
    cuda.memory_allocated = seen_by_sampler(cuda.memory_allocated, lambda index=None: ALLOCATED_BYTES)
    cuda.memory_reserved = seen_by_sampler(cuda.memory_reserved, lambda index=None: RESERVED_BYTES)
    sys.modules["pynvml"] = fake_nvml_module(uuid)


def install_for_rank(rank: int, environ: Mapping[str, str]) -> str | None:
    """`install` this rank's GPU when `HARNESS_FAKE_GPUS` names one; the UUID, else None."""
    uuid = parse_fake_gpus(environ.get(FAKE_GPUS_ENV)).get(rank)
    if uuid is not None:
        install(uuid)
    return uuid


__all__ = ["FAKE_GPUS_ENV", "fake_gpus_value", "fake_nvml_module", "install", "install_for_rank",
           "parse_fake_gpus"]
