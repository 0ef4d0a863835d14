"""The resource sampler: process, host and GPU figures every few seconds, on a thread of its own.

One daemon thread per rank process (`traceml.init()` starts it, `shutdown()` stops it)
builds a `ResourceSnapshot` every interval and hands it to each registered sink that
has `on_resources` (the exporter). What it reads, each only where it can be read:

- the process: CPU utilisation since the previous sample (psutil's CPU times, the
  difference over the elapsed time and the CPUs the process may run on) and its RSS;
- PyTorch's CUDA caching allocator on the rank's device, only once the job itself
  imported torch and initialised CUDA: this thread never imports torch and never
  creates a CUDA context;
- the host (CPU time per mode since the previous sample, logical CPUs, memory by
  state), only on the node's local rank 0: one report per node is enough;
- the rank's GPU through NVML (`pynvml`, from nvidia-ml-py): utilisation, memory,
  temperature, power and its UUID. Only once the job initialised CUDA: a CPU job
  on a GPU host owns none of its GPUs, and another job's busy GPU must not be
  reported as this rank's.

A figure that could not be read is None, never 0: no psutil, no NVML, an NVML call
that failed, a device that is not visible. CPU utilisation needs a previous reading,
taken as the thread starts, so the first snapshot comes one interval later.

Sampling host and GPU state is time-driven by nature, so the cadence stays while the
job trains. When nothing trains it idles: the sampler `traceml.init()` starts watches
the published step count, and after `IDLE_AFTER_S` (or two intervals, if longer)
without a completed step it sends the tick that covers the pause and parks, with no
timeout; the first step after the pause wakes it (the timing sampler announces it,
`samplers.on_steps_resumed`), it takes a new baseline and samples an interval later.
A job that sits between steps for a minute is not sampled, and costs nothing, meanwhile.

Nothing here touches the training thread: no lock or queue is shared with the hot
path; the sinks only append to bounded queues of their own. This module sends
nothing (`traceml.exporter` does) and combines nothing across ranks (the processor
does).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable, Mapping, NamedTuple

from traceml.schema import env_values
from traceml.schema import environment as env_names
from traceml.schema.resources import DEVICE_INDEX_PREFIX

from .records import GpuReading, ResourceSnapshot
from . import samplers as _samplers
from .samplers import _deliver, registered_sinks
from .settings import DEFAULT_RESOURCE_INTERVAL_S, read_resource_settings
from .traced_step import tracked_cuda_index

_log = logging.getLogger("traceml")

FINAL_SAMPLE_MIN_S = 1.0
"""`stop()` takes one last sample when the previous one is at least this old (or a whole
interval, if shorter): a run shorter than the interval still gets its figures, and a
utilisation over a few milliseconds would be noise."""

IDLE_AFTER_S = 30.0
"""With no step completed for this long (or two intervals, if longer), the sampler parks until
steps resume: long enough that a slow step (a large model's 10-20 s) never parks it."""

_CPU_MODES: Mapping[str, str] = {
    "user": "user", "nice": "nice", "system": "system", "idle": "idle", "iowait": "iowait",
    "irq": "interrupt", "softirq": "interrupt", "interrupt": "interrupt", "dpc": "interrupt",
    "steal": "steal",
}
"""psutil's CPU time fields -> the conventions' `cpu.mode` values. Linux's `guest` and
`guest_nice` are left out: the kernel already counts them in `user` and `nice`."""

_MEMORY_STATES: Mapping[str, str] = {"used": "used", "free": "free", "cached": "cached", "buffers": "buffers"}
"""psutil's `virtual_memory()` fields -> `system.memory.state` values (where the platform has them)."""


def _import_psutil():
    try:
        import psutil
    except ImportError:
        _log.debug("TraceML: psutil is not installed; process and host resource figures are not sampled")
        return None
    return psutil


# --- which device is the rank's ----------------------------------------------------------


def local_rank(environ: Mapping[str, str]) -> int:
    """The rank's index on its node: LOCAL_RANK, else SLURM_LOCALID, else the global rank (RANK,
    SLURM_PROCID), else 0: the order `traceml.local_rank` on the exported resource follows.

    A value that is not a whole number >= 0 is warned about and skipped.
    """
    for name in (env_names.LOCAL_RANK, env_names.SLURM_LOCALID, env_names.RANK, env_names.SLURM_PROCID):
        value = env_values.non_negative_int(name, environ.get(name))
        if value is not None:
            return value
    return 0


def visible_devices(raw: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: None when unset (every device, in order), else the
    entries up to the first that is neither an index nor a `GPU-`/`MIG-` UUID (CUDA ignores the
    rest). An empty value hides every device."""
    if raw is None:
        return None
    entries = []
    for entry in raw.split(","):
        entry = entry.strip()
        if entry.isdigit() or entry.startswith(("GPU-", "MIG-")):
            entries.append(entry)
        else:
            break
    return entries


class NvmlTarget(NamedTuple):
    """How NVML finds one device: by host index, or by (a prefix of) its UUID."""

    index: int | None
    uuid: str | None


def nvml_target(cuda_index: int, visible: list[str] | None, cuda_uuid: str | None = None) -> NvmlTarget | None:
    """The NVML device behind the process's CUDA device `cuda_index`, or None (not visible).

    The UUID torch reports for the device wins (it needs no assumption about device order);
    else CUDA_VISIBLE_DEVICES maps the process's numbering onto the host's: an index entry
    is NVML's index, a UUID entry names the device itself. Unset, the two numberings agree.
    """
    if cuda_uuid:
        return NvmlTarget(None, cuda_uuid)
    if cuda_index < 0:
        return None
    if visible is None:
        return NvmlTarget(cuda_index, None)
    if cuda_index >= len(visible):
        return None
    entry = visible[cuda_index]
    return NvmlTarget(int(entry), None) if entry.isdigit() else NvmlTarget(None, entry)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlReader:
    """Reads one GPU through NVML; every call is guarded, a failed one gives its field None."""

    def __init__(self, nvml) -> None:
        self._nvml = nvml
        self._handles: dict[NvmlTarget, tuple[object, str] | None] = {}

    @classmethod
    def open(cls) -> "NvmlReader | None":
        """A reader when `pynvml` imports and `nvmlInit()` succeeds, else None (logged at debug)."""
        try:
            import pynvml
        except Exception:
            _log.debug("TraceML: pynvml (nvidia-ml-py) is not importable; no GPU resource figures")
            return None
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            _log.debug("TraceML: nvmlInit failed (%r); no GPU resource figures", exc)
            return None
        return cls(pynvml)

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass

    def _handle(self, target: NvmlTarget) -> tuple[object, str] | None:
        """(handle, hw id) of `target`, looked up once; hw id is the UUID, else `index:N`."""
        if target in self._handles:
            return self._handles[target]
        nvml, found = self._nvml, None
        try:
            if target.index is not None:
                found = nvml.nvmlDeviceGetHandleByIndex(target.index)
            else:
                found = self._by_uuid(target.uuid)
        except Exception:
            found = None
        result = None
        if found is not None:
            try:
                hw_id = _text(nvml.nvmlDeviceGetUUID(found))
            except Exception:
                hw_id = f"{DEVICE_INDEX_PREFIX}{target.index}" if target.index is not None else target.uuid
            result = (found, hw_id)
        self._handles[target] = result
        return result

    def _by_uuid(self, uuid: str):
        """CUDA accepts a unique UUID prefix, NVML only the whole UUID: try it whole, then match."""
        nvml = self._nvml
        try:
            return nvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:
            pass
        matches = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            if _text(nvml.nvmlDeviceGetUUID(handle)).startswith(uuid):
                matches.append(handle)
        return matches[0] if len(matches) == 1 else None

    def read(self, target: NvmlTarget) -> GpuReading | None:
        """One reading of `target`; None when NVML cannot find it."""
        found = self._handle(target)
        if found is None:
            return None
        handle, hw_id = found
        nvml = self._nvml
        utilization = memory_used = memory_total = temperature = power = None
        try:
            utilization = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu) / 100.0
        except Exception:
            pass
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
            memory_used, memory_total = int(info.used), int(info.total)
        except Exception:
            pass
        try:
            temperature = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
        except Exception:
            pass
        try:
            power = float(nvml.nvmlDeviceGetPowerUsage(handle)) / 1000.0  # mW
        except Exception:
            pass
        return GpuReading(hw_id, utilization, memory_used, memory_total, temperature, power)


# --- the job's CUDA, read only -------------------------------------------------------------


class CudaState(NamedTuple):
    """The rank's device as the job's torch sees it, and its caching allocator's counters."""

    index: int
    uuid: str | None  # `GPU-...` as NVML spells it, when torch reports one
    allocated_bytes: int | None
    reserved_bytes: int | None


def read_job_cuda(local: int) -> CudaState | None:
    """The job's CUDA state, or None while it has not imported torch or initialised CUDA.

    Never imports torch and never initialises CUDA: it only looks at a torch the job has
    already loaded. The device is the one the steps track, else the local rank's (the
    usual one-GPU-per-rank placement); CUDA's current device is per thread, so this
    thread's would say nothing about the training thread's.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        cuda = torch.cuda
        if not cuda.is_initialized():
            return None
        index = tracked_cuda_index()
        if index is None:
            count = int(cuda.device_count())
            if count < 1:
                return None
            index = local if local < count else local % count
    except Exception:
        return None
    uuid = allocated = reserved = None
    try:
        text = str(cuda.get_device_properties(index).uuid)
        uuid = text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
    except Exception:
        pass
    try:
        allocated = int(cuda.memory_allocated(index))
    except Exception:
        pass
    try:
        reserved = int(cuda.memory_reserved(index))
    except Exception:
        pass
    return CudaState(index, uuid, allocated, reserved)


# --- the sampler ----------------------------------------------------------------------------


class _Previous(NamedTuple):
    monotonic: float
    process_cpu_s: float | None
    host_cpu: Mapping[str, float] | None


class ResourceSampler:
    """The daemon thread described in the module docstring; `sample()` is one synchronous tick.

    Args:
        sinks: receivers of the snapshots (default: every registered sink with `on_resources`).
        interval_s: seconds between two samples.
        environ: where LOCAL_RANK and CUDA_VISIBLE_DEVICES are read (default `os.environ`).
        psutil_module: psutil, or None for "not installed" (default: imported on first use).
        nvml_open: builds the NVML reader or returns None (default `NvmlReader.open`).
        read_cuda: `read_job_cuda`'s signature; tests stand in a GPU here.
        clock: the monotonic clock of the elapsed times.
        steps: the count of completed steps (`step_events.steps_completed`); given, the sampler
            parks while it does not move (see the module docstring). None: it samples always.
    """

    name = "traceml-resource-sampler"

    def __init__(self, sinks=None, interval_s: float = DEFAULT_RESOURCE_INTERVAL_S, *,
                 environ: Mapping[str, str] | None = None, psutil_module=..., nvml_open=None,
                 read_cuda: Callable[[int], CudaState | None] = read_job_cuda,
                 clock: Callable[[], float] = time.monotonic,
                 steps: Callable[[], int] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._sinks = sinks
        self.interval_s = interval_s
        self.local_rank = local_rank(env)
        self.reports_host = self.local_rank == 0
        self._visible = visible_devices(env.get(env_names.CUDA_VISIBLE_DEVICES))
        self._psutil = psutil_module
        self._process = None
        self._nvml_open = NvmlReader.open if nvml_open is None else nvml_open
        self._nvml: NvmlReader | None = None
        self._nvml_tried = False
        self._read_cuda = read_cuda
        self._clock = clock
        self._previous: _Previous | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # stop, or steps resumed while parked
        self._steps = steps
        self.parked = False
        self.parks = 0
        self._thread: threading.Thread | None = None
        self._tick_failed_logged = False
        self.delivered = 0
        self.ticks = 0
        self.tick_cpu_s = 0.0
        """CPU time this sampler's thread spent in its ticks (time.thread_time), for the benchmark."""

    # --- thread ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._wake.clear()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        self._guarded(self.baseline)
        stop, wake, thread_time, clock = self._stop, self._wake, time.thread_time, self._clock
        steps = self._steps
        seen = steps() if steps is not None else None
        moved_at = clock()
        while True:
            wake.wait(None if self.parked else self.interval_s)
            wake.clear()
            if stop.is_set():
                return
            if self.parked:  # steps resumed: measure from now, not across the pause
                _samplers.on_steps_resumed(wake.set, add=False)
                self.parked = False
                self._guarded(self.baseline)
                seen, moved_at = steps(), clock()
                continue
            t0 = thread_time()
            self._guarded(self.run_once)
            self.tick_cpu_s += thread_time() - t0
            if steps is None:
                continue
            count, now = steps(), clock()
            if count != seen:
                seen, moved_at = count, now
            elif now - moved_at >= max(IDLE_AFTER_S, 2 * self.interval_s):
                self.parked = self._park(seen)

    def _park(self, seen: int) -> bool:
        """Sleep until steps resume (False when one completed while this was being set up)."""
        self.parks += 1
        _samplers.on_steps_resumed(self._wake.set)
        if self._steps() != seen:
            _samplers.on_steps_resumed(self._wake.set, add=False)
            return False
        return True

    def _guarded(self, fn) -> None:
        try:
            fn()
        except Exception:  # the thread must outlive anything a reading can raise
            if not self._tick_failed_logged:
                self._tick_failed_logged = True
                _log.exception("TraceML %s tick failed; later failures are not logged", self.name)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; take one last sample (see FINAL_SAMPLE_MIN_S), then close NVML."""
        self._stop.set()
        self._wake.set()
        _samplers.on_steps_resumed(self._wake.set, add=False)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        self._thread = None
        if thread is not None and thread.is_alive():
            return  # stuck in a reading: leave NVML to it (the thread is a daemon)
        previous = self._previous
        if previous is not None and self._clock() - previous.monotonic >= min(FINAL_SAMPLE_MIN_S, self.interval_s):
            self._guarded(self.run_once)
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None

    # --- one tick ----------------------------------------------------------------------------

    def run_once(self) -> ResourceSnapshot:
        """Sample now and hand the snapshot to the sinks that take resources."""
        snapshot = self.sample()
        sinks = self._sinks if self._sinks is not None else registered_sinks()
        takers = [sink for sink in sinks if getattr(sink, "on_resources", None) is not None]
        _deliver("on_resources", snapshot, takers)
        self.ticks += 1
        self.delivered += len(takers)
        return snapshot

    def baseline(self) -> None:
        """The reading the first snapshot's CPU utilisations are measured from."""
        self._previous = self._cpu_reading()

    def sample(self) -> ResourceSnapshot:
        """One snapshot; its CPU utilisations cover the time since the previous call (None on the first)."""
        previous = self._previous
        now = self._cpu_reading()
        self._previous = now
        psutil = self._psutil_module()
        elapsed = None if previous is None else now.monotonic - previous.monotonic
        process_cpu = None
        if elapsed and elapsed > 0 and now.process_cpu_s is not None and previous.process_cpu_s is not None:
            process_cpu = max(0.0, now.process_cpu_s - previous.process_cpu_s) / elapsed / _cpus_available()
        rss = None
        if self._process is not None:
            try:
                rss = int(self._process.memory_info().rss)
            except Exception:
                rss = None
        cuda = self._read_cuda(self.local_rank)
        gpu = None
        if cuda is not None:
            target = nvml_target(cuda.index, self._visible, cuda.uuid)
            nvml = self._open_nvml()
            if target is not None and nvml is not None:
                gpu = nvml.read(target)
                if gpu is None and cuda.uuid is not None:  # torch's UUID unknown to NVML (MIG spelling)
                    fallback = nvml_target(cuda.index, self._visible)
                    gpu = nvml.read(fallback) if fallback is not None else None
        modes = count = used = total = by_state = None
        if self.reports_host and psutil is not None:
            if previous is not None:
                modes = _mode_fractions(previous.host_cpu, now.host_cpu)
            try:
                count = int(psutil.cpu_count(logical=True))
            except Exception:
                count = None
            try:
                memory = psutil.virtual_memory()
                total = int(memory.total)
                used = int(memory.used)
                by_state = {state: int(getattr(memory, field)) for field, state in _MEMORY_STATES.items()
                            if hasattr(memory, field)}
            except Exception:
                used = total = by_state = None
        return ResourceSnapshot(
            time_ns=time.time_ns(), process_cpu_utilization=process_cpu, process_rss_bytes=rss,
            cuda_device=None if cuda is None else f"cuda:{cuda.index}",
            cuda_allocated_bytes=None if cuda is None else cuda.allocated_bytes,
            cuda_reserved_bytes=None if cuda is None else cuda.reserved_bytes,
            gpu=gpu, host_cpu_modes=modes, host_cpu_count=count, host_memory_used_bytes=used,
            host_memory_total_bytes=total, host_memory_by_state=by_state)

    def _psutil_module(self):
        if self._psutil is ...:
            self._psutil = _import_psutil()
        if self._psutil is not None and self._process is None:
            try:
                self._process = self._psutil.Process()
            except Exception:
                self._psutil = None
        return self._psutil

    def _open_nvml(self) -> NvmlReader | None:
        if not self._nvml_tried:
            self._nvml_tried = True
            self._nvml = self._nvml_open()
        return self._nvml

    def _cpu_reading(self) -> _Previous:
        psutil = self._psutil_module()
        process_cpu = host = None
        if psutil is not None:
            try:
                times = self._process.cpu_times()
                process_cpu = float(times.user) + float(times.system)
            except Exception:
                process_cpu = None
            if self.reports_host:
                try:
                    host = {field: float(value) for field, value in psutil.cpu_times()._asdict().items()}
                except Exception:
                    host = None
        return _Previous(self._clock(), process_cpu, host)


def _cpus_available() -> int:
    """CPUs this process may run on (its affinity mask), else the host's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _mode_fractions(before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> dict[str, float] | None:
    """Each `cpu.mode`'s share of the host's CPU time between two readings (summing to 1).

    Over the sum of the modes' times rather than elapsed x CPUs: the same quantity when
    every CPU is counted, without mixing the sampler's clock into the kernel's counters.
    """
    if before is None or after is None:
        return None
    deltas: dict[str, float] = {}
    for field, mode in _CPU_MODES.items():
        if field in after and field in before:
            deltas[mode] = deltas.get(mode, 0.0) + max(0.0, after[field] - before[field])
    total = sum(deltas.values())
    if total <= 0:
        return None
    return {mode: delta / total for mode, delta in deltas.items()}


def start_resource_sampler(environ: Mapping[str, str] | None = None) -> ResourceSampler | None:
    """The sampler `traceml.init()` starts, or None when TRACEML_RESOURCES turns it off."""
    settings = read_resource_settings(environ)
    if not settings.enabled:
        return None
    from .step_events import steps_completed

    sampler = ResourceSampler(interval_s=settings.interval_s, environ=environ, steps=steps_completed)
    sampler.start()
    return sampler
