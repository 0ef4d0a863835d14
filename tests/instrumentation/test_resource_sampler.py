"""The resource sampler: process and host figures on this machine, the GPU through a fake NVML,
absent figures absent, its thread off the training thread and unkillable by a sink.

NVML and a CUDA device cannot exist here: `FakeNvml` stands in for the `pynvml` module
(put in `sys.modules`, where the sampler imports it from), and a `CudaState` for the job's
initialised CUDA. Everything else is real: psutil, the thread, the sinks, `traceml.init()`.
"""
from __future__ import annotations

import logging
import sys
import threading
import time

import psutil
import pytest

import traceml
from traceml import resources as res
from traceml.records import GpuReading
from traceml.schema import env_values
from traceml.resources import CudaState, NvmlReader, NvmlTarget, ResourceSampler, nvml_target, visible_devices
from traceml.settings import DEFAULT_RESOURCE_INTERVAL_S, MIN_RESOURCE_INTERVAL_S, read_resource_settings

from harness.sinks import RecordingSink
from harness.child_python import python_output

UUIDS = ("GPU-aaaa1111-0000-0000-0000-000000000000", "GPU-bbbb2222-0000-0000-0000-000000000000",
         "GPU-cccc3333-0000-0000-0000-000000000000", "GPU-dddd4444-0000-0000-0000-000000000000")


class NVMLError(Exception):
    pass


class FakeNvml:
    """The parts of `pynvml` the sampler calls, over four fake devices; `failing` names the calls
    that raise NVMLError (as a real NVML does for an unsupported query)."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, failing=(), init_fails: bool = False) -> None:
        self.failing = set(failing)
        self.init_fails = init_fails
        self.calls: list[str] = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.failing:
            raise NVMLError(name)

    def nvmlInit(self):
        self._call("nvmlInit")
        if self.init_fails:
            raise NVMLError("driver not loaded")

    def nvmlShutdown(self):
        self._call("nvmlShutdown")

    def nvmlDeviceGetCount(self):
        self._call("nvmlDeviceGetCount")
        return len(UUIDS)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._call("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(UUIDS):
            raise NVMLError("invalid index")
        return ("handle", index)

    def nvmlDeviceGetHandleByUUID(self, uuid):  # the whole UUID only, as NVML
        self._call("nvmlDeviceGetHandleByUUID")
        if uuid not in UUIDS:
            raise NVMLError("not found")
        return ("handle", UUIDS.index(uuid))

    def nvmlDeviceGetUUID(self, handle):
        self._call("nvmlDeviceGetUUID")
        return UUIDS[handle[1]]

    def nvmlDeviceGetUtilizationRates(self, handle):
        self._call("nvmlDeviceGetUtilizationRates")
        return type("Utilization", (), {"gpu": 87 - handle[1], "memory": 40})()

    def nvmlDeviceGetMemoryInfo(self, handle):
        self._call("nvmlDeviceGetMemoryInfo")
        return type("Memory", (), {"total": 80 << 30, "used": (10 + handle[1]) << 30, "free": 0})()

    def nvmlDeviceGetTemperature(self, handle, sensor):
        self._call("nvmlDeviceGetTemperature")
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 61 + handle[1]

    def nvmlDeviceGetPowerUsage(self, handle):
        self._call("nvmlDeviceGetPowerUsage")
        return 250_500 + handle[1]  # milliwatts


@pytest.fixture
def fake_nvml(monkeypatch):
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def _cuda(index=0, uuid=None, allocated=1 << 20, reserved=4 << 20):
    return lambda local_rank: CudaState(index, uuid, allocated, reserved)


def _burn(seconds: float) -> float:
    """Busy this thread for `seconds` of wall time; returns the CPU time it used."""
    t0, c0 = time.perf_counter(), time.thread_time()
    x = 0
    while time.perf_counter() - t0 < seconds:
        x += 1
    return time.thread_time() - c0


# --- NVML -----------------------------------------------------------------------------------


def test_nvml_readings_are_converted_to_the_conventions_units(fake_nvml):
    reader = NvmlReader.open()
    assert reader is not None and fake_nvml.calls == ["nvmlInit"]
    reading = reader.read(NvmlTarget(1, None))
    assert reading == GpuReading(hw_id=UUIDS[1], utilization=0.86, memory_used_bytes=11 << 30,
                                 memory_total_bytes=80 << 30, temperature_c=62.0, power_w=250.501)
    reader.close()
    assert fake_nvml.calls[-1] == "nvmlShutdown"


@pytest.mark.parametrize("call, field", [
    ("nvmlDeviceGetUtilizationRates", "utilization"),
    ("nvmlDeviceGetMemoryInfo", "memory_used_bytes"),
    ("nvmlDeviceGetTemperature", "temperature_c"),
    ("nvmlDeviceGetPowerUsage", "power_w"),
])
def test_a_failing_nvml_call_gives_its_field_none_never_zero(monkeypatch, call, field):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(failing={call}))
    reading = NvmlReader.open().read(NvmlTarget(0, None))
    missing = {field, "memory_total_bytes"} if field == "memory_used_bytes" else {field}
    assert {name for name, value in reading._asdict().items() if value is None} == missing
    assert reading.hw_id == UUIDS[0]


def test_a_device_whose_uuid_cannot_be_read_is_named_by_its_index(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(failing={"nvmlDeviceGetUUID"}))
    reading = NvmlReader.open().read(NvmlTarget(2, None))
    assert reading.hw_id == "index:2" and reading.utilization == 0.85


def test_no_nvml_module_or_a_failing_init_means_no_reader(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert NvmlReader.open() is None
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(init_fails=True))
    assert NvmlReader.open() is None


def test_a_device_nvml_does_not_know_gives_no_reading(fake_nvml):
    reader = NvmlReader.open()
    assert reader.read(NvmlTarget(7, None)) is None
    assert reader.read(NvmlTarget(None, "GPU-ffff")) is None


# --- which device is the rank's ----------------------------------------------------------------


@pytest.mark.parametrize("raw, cuda_index, expected", [
    (None, 1, NvmlTarget(1, None)),  # unset: the two numberings agree
    ("3,1", 0, NvmlTarget(3, None)),
    ("3,1", 1, NvmlTarget(1, None)),
    ("3,1", 2, None),  # not visible to the process
    (f"{UUIDS[2]},0", 0, NvmlTarget(None, UUIDS[2])),
    ("0,-1,2", 2, None),  # CUDA stops at the first invalid entry
    ("", 0, None),  # an empty value hides every device
    ("GPU-bbbb", 0, NvmlTarget(None, "GPU-bbbb")),
])
def test_cuda_visible_devices_maps_the_process_device_onto_nvml(raw, cuda_index, expected):
    assert nvml_target(cuda_index, visible_devices(raw)) == expected


def test_the_uuid_torch_reports_wins_over_the_mapping():
    assert nvml_target(0, visible_devices("3,1"), UUIDS[1]) == NvmlTarget(None, UUIDS[1])


def test_a_uuid_prefix_as_cuda_accepts_it_finds_the_one_device_it_names(fake_nvml):
    reader = NvmlReader.open()
    assert reader.read(NvmlTarget(None, "GPU-cccc")).hw_id == UUIDS[2]
    assert reader.read(NvmlTarget(None, "GPU-")) is None  # ambiguous: every device matches


def test_the_sampler_reads_the_gpu_behind_cuda_visible_devices(fake_nvml):
    sampler = ResourceSampler(sinks=(), environ={"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "3,2"},
                              read_cuda=_cuda(index=1, allocated=123, reserved=456))
    snapshot = sampler.sample()
    assert snapshot.gpu.hw_id == UUIDS[2] and snapshot.gpu.utilization == 0.85
    assert (snapshot.cuda_device, snapshot.cuda_allocated_bytes, snapshot.cuda_reserved_bytes) == ("cuda:1", 123, 456)


def test_a_torch_uuid_nvml_does_not_know_falls_back_to_the_mapping(fake_nvml):
    sampler = ResourceSampler(sinks=(), environ={"CUDA_VISIBLE_DEVICES": "3"},
                              read_cuda=_cuda(index=0, uuid="MIG-9999"))
    assert sampler.sample().gpu.hw_id == UUIDS[3]


def test_cuda_in_use_without_nvml_gives_allocator_figures_and_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    snapshot = ResourceSampler(sinks=(), environ={}, read_cuda=_cuda(index=0, allocated=7, reserved=9)).sample()
    assert snapshot.gpu is None
    assert (snapshot.cuda_device, snapshot.cuda_allocated_bytes, snapshot.cuda_reserved_bytes) == ("cuda:0", 7, 9)


def test_without_cuda_in_use_nvml_is_not_even_opened(fake_nvml):
    """A CPU job on a GPU host owns none of its GPUs: no GPU reading, NVML untouched."""
    snapshot = ResourceSampler(sinks=(), environ={}).sample()
    assert snapshot.gpu is None and snapshot.cuda_device is None
    assert fake_nvml.calls == []


@pytest.mark.parametrize("environ, expected", [
    ({}, 0), ({"LOCAL_RANK": "3"}, 3), ({"SLURM_LOCALID": "2"}, 2), ({"RANK": "5"}, 5),
    ({"LOCAL_RANK": "1", "RANK": "5"}, 1), ({"LOCAL_RANK": "x", "SLURM_LOCALID": "4"}, 4),
])
def test_local_rank_follows_the_resources_order(environ, expected):
    assert res.local_rank(environ) == expected


# --- a real tick on this machine ---------------------------------------------------------------


def test_a_real_tick_gives_process_cpu_and_rss_and_on_local_rank_0_the_host():
    sampler = ResourceSampler(sinks=(), environ={"LOCAL_RANK": "0"})
    sampler.baseline()
    t0 = time.monotonic()
    burned = _burn(0.4)
    snapshot = sampler.sample()
    elapsed = time.monotonic() - t0
    cpus = len(psutil.Process().cpu_affinity())
    assert burned / elapsed / cpus * 0.9 <= snapshot.process_cpu_utilization <= 1.0 + 0.05
    rss = psutil.Process().memory_info().rss
    assert abs(snapshot.process_rss_bytes - rss) < 64 << 20
    modes = snapshot.host_cpu_modes
    assert {"user", "system", "idle"} <= set(modes) and abs(sum(modes.values()) - 1.0) < 1e-9
    assert modes["user"] + modes["system"] > 0  # this thread was busy
    assert snapshot.host_cpu_count == psutil.cpu_count(logical=True)
    by_state = snapshot.host_memory_by_state
    assert set(by_state) == {"used", "free", "cached", "buffers"}
    assert snapshot.host_memory_used_bytes == by_state["used"] <= snapshot.host_memory_total_bytes
    assert snapshot.host_memory_total_bytes == psutil.virtual_memory().total
    # CPU-only torch, CUDA never initialised: no allocator, no GPU (absent, not zero).
    assert (snapshot.gpu, snapshot.cuda_device, snapshot.cuda_allocated_bytes, snapshot.cuda_reserved_bytes) == \
        (None, None, None, None)


def test_the_first_sample_without_a_previous_reading_has_no_cpu_utilisation():
    snapshot = ResourceSampler(sinks=(), environ={}).sample()
    assert snapshot.process_cpu_utilization is None and snapshot.host_cpu_modes is None
    assert snapshot.process_rss_bytes > 0 and snapshot.host_cpu_count >= 1  # levels need no baseline


def test_other_local_ranks_send_no_host_figures():
    sampler = ResourceSampler(sinks=(), environ={"LOCAL_RANK": "1"})
    sampler.baseline()
    _burn(0.05)
    snapshot = sampler.sample()
    assert snapshot.process_cpu_utilization is not None and snapshot.process_rss_bytes > 0
    assert (snapshot.host_cpu_modes, snapshot.host_cpu_count, snapshot.host_memory_used_bytes,
            snapshot.host_memory_total_bytes, snapshot.host_memory_by_state) == (None,) * 5


def test_without_psutil_process_and_host_figures_are_none_and_logged_once_at_debug(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "psutil", None)
    caplog.set_level(logging.DEBUG, logger="traceml")
    sampler = ResourceSampler(sinks=(), environ={})
    sampler.baseline()
    snapshot = sampler.sample()
    assert snapshot._replace(time_ns=0) == res.ResourceSnapshot(0, *(None,) * 11)
    assert [r.levelno for r in caplog.records if "psutil" in r.getMessage()] == [logging.DEBUG]


def test_the_sampler_never_imports_torch_nor_pynvml_without_cuda():
    code = ("import sys\n"
            "from traceml.resources import ResourceSampler\n"
            "s = ResourceSampler(sinks=(), environ={})\n"
            "s.baseline(); snap = s.sample()\n"
            "assert snap.process_rss_bytes > 0 and snap.gpu is None\n"
            "assert 'torch' not in sys.modules and 'pynvml' not in sys.modules, 'imported'\n"
            "print('ok')")
    assert python_output(code, timeout=60) == "ok"


# --- the thread ----------------------------------------------------------------------------------


class _RaisingSink:
    def __init__(self) -> None:
        self.calls = 0

    def on_resources(self, snapshot) -> None:
        self.calls += 1
        raise RuntimeError("broken sink")


class _StepsOnlySink:
    def on_step_time(self, record) -> None: ...

    def on_step_memory(self, record) -> None: ...


def _wait(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_the_thread_survives_a_raising_sink_and_skips_sinks_without_on_resources(caplog):
    broken, recording = _RaisingSink(), RecordingSink()
    sampler = ResourceSampler(sinks=(broken, _StepsOnlySink(), recording), interval_s=0.05, environ={})
    sampler.start()
    try:
        assert _wait(lambda: len(recording.resources) >= 3)
        assert sampler.is_alive() and broken.calls >= 3
    finally:
        sampler.stop(timeout_s=5)
    assert not sampler.is_alive()
    failures = [r for r in caplog.records if "on_resources" in r.getMessage()]
    assert len(failures) == 1  # logged once, then quiet; the step-only sink raised nothing
    assert all(s.process_cpu_utilization is not None for s in recording.resources)  # baseline at start


@pytest.mark.slow
def test_the_first_snapshot_comes_one_interval_after_start():
    recording = RecordingSink()
    sampler = ResourceSampler(sinks=(recording,), interval_s=0.5, environ={})
    started = time.monotonic()
    sampler.start()
    try:
        assert _wait(lambda: recording.resources)
        assert time.monotonic() - started >= 0.5
    finally:
        sampler.stop()


@pytest.mark.slow
def test_stop_takes_a_last_sample_so_a_short_run_still_has_its_figures():
    recording = RecordingSink()
    sampler = ResourceSampler(sinks=(recording,), interval_s=60.0, environ={})
    sampler.start()
    time.sleep(1.1)  # FINAL_SAMPLE_MIN_S
    sampler.stop()
    assert len(recording.resources) == 1 and recording.resources[0].process_cpu_utilization is not None


def test_stop_right_after_start_takes_no_sample_over_a_few_milliseconds():
    recording = RecordingSink()
    sampler = ResourceSampler(sinks=(recording,), interval_s=60.0, environ={})
    sampler.start()
    time.sleep(0.05)
    sampler.stop()
    assert recording.resources == [] and not sampler.is_alive()


def test_the_sampler_runs_on_its_own_daemon_thread():
    seen = []

    class ThreadSink:
        def on_resources(self, snapshot) -> None:
            seen.append(threading.current_thread())

    sampler = ResourceSampler(sinks=(ThreadSink(),), interval_s=0.05, environ={})
    sampler.start()
    try:
        assert _wait(lambda: seen)
    finally:
        sampler.stop()
    assert seen[0] is not threading.main_thread() and seen[0].daemon and seen[0].name == ResourceSampler.name
    assert sampler.ticks >= 1 and sampler.tick_cpu_s > 0


# --- traceml.init() / shutdown() and the variables ---------------------------------------------


@pytest.mark.slow
def test_init_starts_it_shutdown_stops_it_and_registered_sinks_get_snapshots(monkeypatch, sink):
    monkeypatch.setenv("TRACEML_RESOURCE_INTERVAL", "0.1")
    traceml.init(mode="manual")
    sampler = traceml._resource_sampler
    assert sampler is not None and sampler.is_alive() and sampler.interval_s == 0.1
    assert _wait(lambda: len(sink.resources) >= 2)
    traceml.shutdown()
    assert traceml._resource_sampler is None and not sampler.is_alive()


def test_traceml_resources_off_starts_no_sampler(monkeypatch):
    monkeypatch.setenv("TRACEML_RESOURCES", "off")
    traceml.init(mode="manual")
    assert traceml._resource_sampler is None
    assert not any(t.name == ResourceSampler.name for t in threading.enumerate())


@pytest.mark.slow
def test_a_forked_child_forgets_the_sampler():
    code = ("import os, traceml\n"
            "traceml.init(mode='manual')\n"
            "assert traceml._resource_sampler is not None\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os._exit(0 if traceml._resource_sampler is None else 3)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "traceml.shutdown()\n"
            "print(os.waitstatus_to_exitcode(status))")
    assert python_output(code, timeout=60) == "0"


@pytest.mark.parametrize("raw, enabled", [
    (None, True), ("", True), ("1", True), ("ON", True), ("yes", True),
    ("0", False), ("off", False), ("False", False), ("no", False),
])
def test_traceml_resources_switch(raw, enabled):
    environ = {} if raw is None else {"TRACEML_RESOURCES": raw}
    assert read_resource_settings(environ).enabled is enabled


@pytest.mark.parametrize("raw, seconds", [
    (None, DEFAULT_RESOURCE_INTERVAL_S), ("2.5", 2.5), ("10", 10.0), ("0.01", MIN_RESOURCE_INTERVAL_S),
])
def test_traceml_resource_interval(raw, seconds):
    environ = {} if raw is None else {"TRACEML_RESOURCE_INTERVAL": raw}
    assert read_resource_settings(environ).interval_s == seconds


@pytest.mark.parametrize("name, raw", [
    ("TRACEML_RESOURCES", "maybe"),
    ("TRACEML_RESOURCE_INTERVAL", "0"), ("TRACEML_RESOURCE_INTERVAL", "-3"),
    ("TRACEML_RESOURCE_INTERVAL", "five"), ("TRACEML_RESOURCE_INTERVAL", "inf"),
    ("TRACEML_RESOURCE_INTERVAL", "nan"),
])
def test_an_invalid_value_is_warned_once_and_the_default_applies(monkeypatch, caplog, name, raw):
    monkeypatch.setattr(env_values, "_warned", set())  # once per (variable, value) and process
    caplog.set_level(logging.WARNING)
    for _ in range(2):
        settings = read_resource_settings({name: raw})
    assert (settings.enabled, settings.interval_s) == (True, DEFAULT_RESOURCE_INTERVAL_S)
    assert len([r for r in caplog.records if name in r.getMessage() and repr(raw) in r.getMessage()]) == 1


def test_the_sampler_parks_while_no_step_completes_and_resumes_with_the_steps(monkeypatch):
    """Host and GPU state are sampled on a clock while the job trains; when nothing trains the
    sampler sends the tick covering the pause and then sleeps with no timeout until steps resume."""
    from traceml import samplers

    monkeypatch.setattr(res, "IDLE_AFTER_S", 0.05)
    steps = {"n": 7}
    recording = RecordingSink()
    sampler = ResourceSampler(sinks=(recording,), interval_s=0.02, environ={}, steps=lambda: steps["n"])
    sampler.start()
    try:
        assert _wait(lambda: sampler.parked)
        ticks = sampler.ticks
        assert ticks >= 2  # it sampled through the pause's first 50 ms
        time.sleep(0.2)  # ten intervals
        assert sampler.ticks == ticks and sampler.parked
        steps["n"] += 1
        samplers._announce_resumed()  # what the timing sampler does with the first step after a pause
        assert _wait(lambda: sampler.ticks > ticks)
        assert not sampler.parked or sampler.ticks > ticks
    finally:
        sampler.stop()
    assert samplers._resumed_listeners == ()


def test_a_sampler_without_a_step_count_never_parks():
    recording = RecordingSink()
    sampler = ResourceSampler(sinks=(recording,), interval_s=0.02, environ={})
    sampler.start()
    try:
        assert _wait(lambda: len(recording.resources) >= 5)
        assert sampler.parks == 0 and not sampler.parked
    finally:
        sampler.stop()
