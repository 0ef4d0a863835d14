"""CUDA check of the training-side instrumentation: known GPU work through the real samplers.

Prints one PASS/FAIL line per check and exits 1 if any failed; prints a SKIP line
and exits 0 where no CUDA device is available.

What is checked (each through `traceml.init()`, `trace_step`, timed regions and the
real background samplers, delivered to a sink):
- sleep kernels of a known length (`torch.cuda._sleep`, calibrated here with plain
  CUDA events) resolve to that GPU time per region; repeated regions sum; the same
  through `wrap_forward`'s class-wide call wrapper;
- the training thread is not synchronised: the step's CPU time stays far below its
  GPU time when the step only enqueues long kernels;
- a matmul of known FLOPs resolves to a time matching the same matmul timed directly;
- peak memory: a step that allocates N bytes reports a peak of N above the baseline,
  and the next step's smaller allocation shows the counters were reset;
- automatic mode on a real CUDA training step: every region is seen once per step,
  H2D only for real host-to-device copies, GPU times on every phase;
- CUDA events return to the pool (no growth over many steps);
- GPU step overhead: wall time of a small CUDA training loop with and without
  automatic instrumentation (alternating blocks);
- resource sampler with NVML (nvidia-ml-py): the rank's GPU utilisation reads high (> 0.5)
  under back-to-back large matmuls and low (< 0.2) while the GPU sleeps; memory used/total,
  temperature, power and the UUID are present, the caching allocator is read; the real
  sampler thread started by `init()` delivers GPU readings; the tick cost with NVML.
  Skipped when `pynvml` is not importable;
- NCCL collective wait (one-rank NCCL group): an explicit `all_reduce` enqueued behind a
  sleep kernel gets a GPU time per step while the CPU call returns without waiting
  for the kernel (nothing synchronised); a DDP training step gets one collective-wait occurrence
  with a GPU time inside backward's. Skipped when NCCL is unavailable;
- deep capture (issue 33) with CUDA activities, under the real `traceml run --nproc-per-node 2`
  (embedded processor, `--capture auto`) of harness.sort_straggler_job: two gloo ranks on cuda:0
  (two NCCL ranks cannot share one device), rank 1's forward sorting a large CUDA tensor (about
  30 ms per step) that rank 0 never sorts. From final_summary.json: COMPUTE_STRAGGLER rank 1; one
  automatic capture, done, rank 1 against rank 0; both ranks recorded `cuda` activities (the
  processor's captures route, and no "no device kernels" in the digest's not_seen); the top
  row a sort kernel with device time, on rank 1 only; both raw traces beside the summary are
  gzip'd Chrome traces with kernel events, the culprit's with sort kernels. The job stops its
  steps after 60 s, the launch is stopped after 150 s (the CPU form took 13 s on 2 cores).
  Skipped when a distribution `traceml run` or its processor needs is not installed (a bare
  GPU image may lack the OTLP ones). Written without a GPU: it has not yet run on one (its
  launching and reading ran against the job's `--device cpu` form).

    python -m checks.gpu        (from the repository root; works from a copy of the tree without installing)
"""
from __future__ import annotations

import gzip
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib import checkout  # noqa: F401  (imports the checkout when not installed)
import traceml  # noqa: E402
from traceml.schema.vocabulary import (  # noqa: E402
    RAW_BACKWARD,
    RAW_COLLECTIVE_WAIT,
    RAW_DATALOADER_NEXT,
    RAW_FORWARD,
    RAW_H2D,
    RAW_OPTIMIZER_STEP,
    RAW_STEP_TIME,
)

from harness.sinks import RecordingSink  # noqa: E402  (the one recording sink; stdlib only)

MiB = 1 << 20
_failures: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        _failures.append(name)


def close(measured: float | None, expected: float, rel: float = 0.15, abs_ms: float = 0.05) -> bool:
    return measured is not None and abs(measured - expected) <= max(rel * expected, abs_ms)


def wait_for(sink: RecordingSink, steps: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(sink.steps) < steps and time.monotonic() < deadline:
        time.sleep(0.01)


def reference_ms(torch, fn, repeats: int = 5) -> float:
    """Median GPU time of `fn` with plain CUDA events and a synchronize (the check's own ruler)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def session(mode: str):
    sink = RecordingSink()
    traceml.register_sink(sink)
    traceml.init(mode=mode)
    return sink


def end_session(sink: RecordingSink) -> None:
    traceml.shutdown(timeout_s=30)
    traceml.unregister_sink(sink)


def check_sleep_kernels(torch) -> None:
    cycles = 20_000_000
    sleep = lambda c=cycles: torch.cuda._sleep(c)  # noqa: E731
    for _ in range(3):
        sleep()
    torch.cuda.synchronize()
    ref = reference_ms(torch, sleep)
    sink = session("manual")
    model = torch.nn.Linear(4, 4).cuda()
    steps = 5
    cpu_t0 = time.perf_counter()
    for _ in range(steps):
        with traceml.trace_step(model):
            with traceml.timed_forward():
                sleep()
            with traceml.timed_forward():
                sleep()
            with traceml.timed_backward():
                sleep(2 * cycles)
            with traceml.timed_optimizer_step():
                sleep(cycles // 2)
    enqueue_s = time.perf_counter() - cpu_t0
    torch.cuda.synchronize()
    wait_for(sink, steps)
    end_session(sink)
    check("sleep.delivered", [r.step for r in sink.steps] == list(range(steps)),  # first session
          f"steps {[r.step for r in sink.steps]}")
    if len(sink.steps) != steps:
        return
    last = sink.steps[-1].events
    fwd, bwd, opt, st = last[RAW_FORWARD], last[RAW_BACKWARD], last[RAW_OPTIMIZER_STEP], last[RAW_STEP_TIME]
    check("sleep.forward_sum", fwd.count == 2 and close(fwd.gpu_ms, 2 * ref),
          f"forward gpu {fwd.gpu_ms:.3f} ms over {fwd.count} regions, expected {2 * ref:.3f} (ref sleep {ref:.3f} ms)")
    check("sleep.backward", close(bwd.gpu_ms, 2 * ref), f"backward gpu {bwd.gpu_ms:.3f} ms, expected {2 * ref:.3f}")
    check("sleep.optimizer", close(opt.gpu_ms, ref / 2), f"optimizer gpu {opt.gpu_ms:.3f} ms, expected {ref / 2:.3f}")
    check("sleep.step_covers_phases", st.gpu_ms is not None and st.gpu_ms >= 0.98 * (fwd.gpu_ms + bwd.gpu_ms + opt.gpu_ms),
          f"step gpu {st.gpu_ms:.3f} ms >= sum of phases {fwd.gpu_ms + bwd.gpu_ms + opt.gpu_ms:.3f}")
    gpu_total = sum(r.events[RAW_STEP_TIME].gpu_ms for r in sink.steps)
    check("sleep.no_sync", enqueue_s * 1e3 < 0.25 * gpu_total,
          f"training thread spent {enqueue_s * 1e3:.2f} ms enqueueing {gpu_total:.1f} ms of GPU work "
          f"(a synchronising tracer would wait the full GPU time)")
    check("sleep.cpu_gpu_separate", st.cpu_ms < st.gpu_ms,
          f"step cpu {st.cpu_ms:.3f} ms vs gpu {st.gpu_ms:.3f} ms kept apart")


def check_forward_wrapper(torch) -> None:
    """`wrap_forward` (the class-wide call wrapper of traceml.forward) times a module's calls
    on the GPU clock: a forward that runs one sleep kernel resolves to that kernel's time."""
    cycles = 20_000_000
    sleep = lambda: torch.cuda._sleep(cycles)  # noqa: E731
    sleep()
    ref = reference_ms(torch, sleep)

    class Sleeper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            torch.cuda._sleep(cycles)
            return self.lin(x)

    sink = session("manual")
    model = traceml.wrap_forward(Sleeper().cuda())
    wrapped = "__call__" in vars(Sleeper)
    x = torch.randn(2, 4, device="cuda")
    for _ in range(3):
        with traceml.trace_step(model):
            model(x)
            model(x)
    torch.cuda.synchronize()
    wait_for(sink, 3)
    end_session(sink)
    if len(sink.steps) != 3:
        check("forward_wrapper.delivered", False, f"{len(sink.steps)} of 3 steps")
        return
    fwd = sink.steps[-1].events[RAW_FORWARD]
    check("forward_wrapper.gpu_time", wrapped and fwd.count == 2 and close(fwd.gpu_ms, 2 * ref),
          f"class wrapper installed: {wrapped}; forward gpu {fwd.gpu_ms} ms over {fwd.count} calls, "
          f"expected {2 * ref:.3f} (ref sleep {ref:.3f} ms)")


def check_matmul(torch) -> None:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm = lambda: torch.mm(a, b)  # noqa: E731
    for _ in range(3):
        mm()
    ref = reference_ms(torch, mm)
    sink = session("manual")
    model = torch.nn.Linear(4, 4).cuda()
    for _ in range(4):
        with traceml.trace_step(model):
            with traceml.timed_forward():
                mm()
    torch.cuda.synchronize()
    wait_for(sink, 4)
    end_session(sink)
    if len(sink.steps) < 4:
        check("matmul.delivered", False, f"{len(sink.steps)} of 4 steps")
        return
    got = statistics.median(r.events[RAW_FORWARD].gpu_ms for r in sink.steps[1:])
    tflops = 2 * n ** 3 / (got / 1e3) / 1e12
    check("matmul.gpu_time", close(got, ref, rel=0.15),
          f"{n}^3 bf16 matmul: {got:.3f} ms via TraceML vs {ref:.3f} ms direct ({tflops:.0f} TFLOP/s)")


def check_memory(torch) -> None:
    sink = session("manual")
    model = torch.nn.Linear(4, 4).cuda()
    torch.cuda.synchronize()
    sizes = [256 * MiB, 64 * MiB, 0]
    baselines = []
    for size in sizes:
        baselines.append(torch.cuda.memory_allocated())
        with traceml.trace_step(model):
            if size:
                block = torch.empty(size, dtype=torch.uint8, device="cuda")
                del block
    wait_for(sink, len(sizes))
    deadline = time.monotonic() + 10
    while len(sink.memory) < len(sizes) and time.monotonic() < deadline:
        time.sleep(0.01)
    end_session(sink)
    got = [m.step for m in sink.memory]
    # step numbers are process-local and keep counting across init/shutdown sessions
    check("memory.delivered", len(got) == 3 and got == list(range(got[0], got[0] + 3)),
          f"snapshots for steps {got}")
    if len(sink.memory) != 3:
        return
    for snap, size, base in zip(sink.memory, sizes, baselines):
        extra = snap.peak_allocated_bytes - base
        ok = abs(extra - size) <= 2 * MiB and snap.peak_reserved_bytes >= snap.peak_allocated_bytes
        check(f"memory.peak_{size // MiB}MiB", ok and snap.device.startswith("cuda"),
              f"device {snap.device}: peak allocated {extra / MiB:.2f} MiB above baseline (allocated {size / MiB:.0f} MiB), "
              f"reserved {snap.peak_reserved_bytes / MiB:.0f} MiB")


def _training_job(torch, batches: int = 16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = torch.utils.data.TensorDataset(torch.randn(64 * batches, 256), torch.randn(64 * batches, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=64, pin_memory=True)
    return model, opt, loader


def check_auto_mode(torch) -> None:
    from traceml import timing

    model, opt, loader = _training_job(torch, batches=40)  # built before init, as documented
    sink = session("auto")
    steps = 0
    created = []
    for epoch in range(2):
        for x, y in loader:
            with traceml.trace_step(model):
                x, y = x.to("cuda", non_blocking=True), y.cuda(non_blocking=True)
                x = x.to("cuda")  # already on the device: not an H2D copy
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            steps += 1
        torch.cuda.synchronize()
        wait_for(sink, steps)
        created.append(timing.event_pool().created if timing.event_pool() else None)
    end_session(sink)
    check("auto.delivered", len(sink.steps) == steps, f"{len(sink.steps)} of {steps} steps")
    if not sink.steps:
        return
    expected = {RAW_DATALOADER_NEXT: 1, RAW_H2D: 2, RAW_FORWARD: 1, RAW_BACKWARD: 1, RAW_OPTIMIZER_STEP: 1,
                RAW_STEP_TIME: 1}
    bad = [(r.step, {k.split(':')[1]: v.count for k, v in r.events.items()})
           for r in sink.steps if {k: v.count for k, v in r.events.items()} != expected]
    check("auto.counts", not bad, f"every step: {dict((k.split(':')[1], n) for k, n in expected.items())}; "
          f"differing steps: {bad[:3]}")
    missing = sorted({k.split(":")[1] for r in sink.steps for k in expected if r.events[k].gpu_ms is None})
    check("auto.gpu_times", not missing,
          "GPU times on every phase of every step, step 0's input wait included (the processor "
          f"selects the GPU clock only when all are present); missing: {missing}")
    per_epoch = (steps // 2) * 12
    check("auto.event_pool_reused", None not in created and created[1] <= per_epoch + 12,
          f"CUDA events created: {created[0]} in epoch 1, {created[1] - created[0]} more in epoch 2 "
          f"({steps // 2} steps each, at most {per_epoch} events in flight per epoch): resolved events are reused")


def check_nccl_collective_wait(torch) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        print("SKIP nccl: torch.distributed NCCL is not available", flush=True)
        return
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        cycles = 20_000_000
        t = torch.ones(1024, device="cuda")
        dist.all_reduce(t)  # NCCL's communicator is built on first use: not in the checked steps
        torch.cuda.synchronize()
        ref = reference_ms(torch, lambda: torch.cuda._sleep(cycles))
        sink = session("auto")
        model = torch.nn.Linear(4, 4).cuda()
        cpu = []
        for _ in range(4):
            with traceml.trace_step(model):
                torch.cuda._sleep(cycles)  # enqueued before the all_reduce on the same stream
                t0 = time.perf_counter()
                dist.all_reduce(t)
                cpu.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        wait_for(sink, 4)
        waits = [r.events.get(RAW_COLLECTIVE_WAIT) for r in sink.steps]
        check("nccl.explicit_counted", len(waits) == 4 and all(w is not None and w.count == 1 for w in waits),
              f"one collective wait per step: {[None if w is None else w.count for w in waits]}")
        gpu = [w.gpu_ms for w in waits if w is not None]
        check("nccl.explicit_gpu_time", len(gpu) == 4 and None not in gpu,
              f"GPU times {gpu} ms (the CPU call took {[round(c, 3) for c in cpu]} ms; sleep kernel {ref:.2f} ms "
              "before it: the pair starts after the kernel was enqueued, so the GPU time is the collective's)")
        check("nccl.not_synchronised", max(cpu) < ref / 2,
              f"the training thread's all_reduce returned in {max(cpu):.3f} ms, under half the {ref:.2f} ms kernel")
        end_session(sink)

        sink = session("auto")
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256).cuda())
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        x = torch.randn(64, 256, device="cuda")
        for _ in range(6):
            with traceml.trace_step(ddp):
                ddp(x).sum().backward()
                opt.step()
                opt.zero_grad()
        torch.cuda.synchronize()
        wait_for(sink, 6)
        end_session(sink)
        rows = [(r.events.get(RAW_COLLECTIVE_WAIT), r.events.get(RAW_BACKWARD)) for r in sink.steps]
        ok = len(rows) == 6 and all(w is not None and w.count == 1 and w.gpu_ms is not None and b is not None
                                    and b.gpu_ms is not None and w.gpu_ms <= b.gpu_ms + 0.05 for w, b in rows)
        check("nccl.ddp_wait", ok, "one DDP collective wait per step with a GPU time inside backward's: "
              f"{[(None if w is None else (w.count, w.gpu_ms), None if b is None else b.gpu_ms) for w, b in rows]}")
    finally:
        dist.destroy_process_group()


def check_resources(torch) -> None:
    """The resource sampler's NVML path on a real GPU (docs/instrumentation.md, "Resource sampler")."""
    try:
        import pynvml  # noqa: F401
    except ImportError:
        print("SKIP resources: pynvml (nvidia-ml-py) is not installed", flush=True)
        return
    from traceml.resources import ResourceSampler

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    sampler = ResourceSampler(sinks=(), environ={k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES",)
                                                 if k in os.environ})
    sampler.baseline()

    busy, deadline, next_read = [], time.monotonic() + 3.0, time.monotonic() + 1.0
    while time.monotonic() < deadline:  # keep the GPU's queue full; read NVML while it runs
        for _ in range(8):
            torch.mm(a, b)
        torch.cuda.synchronize()
        if time.monotonic() >= next_read:
            for _ in range(8):
                torch.mm(a, b)  # enqueued: the GPU is busy while the sample is taken
            busy.append(sampler.sample())
            next_read = time.monotonic() + 0.5
    torch.cuda.synchronize()
    time.sleep(3.0)
    idle = sampler.sample()
    gpu_busy = [s.gpu.utilization for s in busy if s.gpu is not None and s.gpu.utilization is not None]
    check("resources.gpu_present", idle.gpu is not None and len(gpu_busy) == len(busy) > 0,
          f"NVML readings: {len(gpu_busy)} of {len(busy)} busy samples, idle {idle.gpu}")
    if idle.gpu is None or not gpu_busy:
        return
    check("resources.utilization_busy", statistics.median(gpu_busy) > 0.5,
          f"utilisation under back-to-back {n}^3 bf16 matmuls: {gpu_busy}")
    g = idle.gpu
    check("resources.utilization_idle", g.utilization is not None and g.utilization < 0.2,
          f"utilisation after 3 s asleep: {g.utilization}")
    check("resources.fields", None not in (g.memory_used_bytes, g.memory_total_bytes, g.temperature_c, g.power_w)
          and 0 < g.memory_used_bytes <= g.memory_total_bytes and 0 < g.temperature_c < 120 and g.power_w > 0
          and g.hw_id.startswith(("GPU-", "MIG-")),
          f"hw.id {g.hw_id}, memory {g.memory_used_bytes / MiB:.0f} of {(g.memory_total_bytes or 0) / MiB:.0f} MiB, "
          f"{g.temperature_c} C, {g.power_w} W")
    check("resources.allocator", idle.cuda_device is not None and (idle.cuda_allocated_bytes or 0) >= 2 * n * n * 2
          and (idle.cuda_reserved_bytes or 0) >= idle.cuda_allocated_bytes,
          f"{idle.cuda_device}: allocated {(idle.cuda_allocated_bytes or 0) / MiB:.0f} MiB, "
          f"reserved {(idle.cuda_reserved_bytes or 0) / MiB:.0f} MiB (two {n}x{n} bf16 matrices: "
          f"{2 * n * n * 2 / MiB:.0f} MiB)")
    ticks = []
    for _ in range(50):
        c0 = time.thread_time()
        sampler.sample()
        ticks.append((time.thread_time() - c0) * 1e6)
    print(f"INFO resources: one tick with NVML and the allocator (local rank 0, host included): "
          f"{statistics.median(ticks):.0f} us CPU (median of 50)", flush=True)
    sampler.stop()

    os.environ["TRACEML_RESOURCE_INTERVAL"] = "0.2"
    try:
        sink = session("manual")
        model = torch.nn.Linear(4, 4).cuda()
        with traceml.trace_step(model):
            torch.mm(a, b)
        end_wait = time.monotonic() + 10
        while len(sink.resources) < 3 and time.monotonic() < end_wait:
            time.sleep(0.05)
        end_session(sink)
    finally:
        del os.environ["TRACEML_RESOURCE_INTERVAL"]
    last = sink.resources[-1] if sink.resources else None
    check("resources.through_init", last is not None and last.gpu is not None and last.cuda_device is not None,
          f"{len(sink.resources)} snapshots from the sampler init() started; the last: "
          f"device {None if last is None else last.cuda_device}, gpu {None if last is None else last.gpu}")


def check_gpu_overhead(torch) -> None:
    """Wall time per step of a small CUDA training loop, uninstrumented vs automatic mode."""
    from traceml import patches

    model, opt, loader = _training_job(torch, batches=50)
    batches = [(x.cuda(), y.cuda()) for x, y in loader]

    def block(traced: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x, y in batches:
            if traced:
                with traceml.trace_step(model):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            else:
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / len(batches)

    sink = session("manual")  # samplers + recording; patches toggled per block below
    block(False)
    off, on = [], []
    for r in range(12):
        for traced in ((False, True) if r % 2 == 0 else (True, False)):
            if traced:
                patches.install()
                patches.instrument_model(model)
                try:
                    on.append(block(True))
                finally:
                    patches.uninstall()
            else:
                off.append(block(False))
    end_session(sink)
    base, inst = statistics.median(off), statistics.median(on)
    print(f"INFO gpu_overhead: small CUDA step {base * 1e3:.3f} ms uninstrumented, {inst * 1e3:.3f} ms automatic mode: "
          f"+{(inst - base) * 1e6:.1f} us per step, throughput ratio {base / inst:.4f}", flush=True)


def report_call_costs(torch) -> None:
    """INFO: training-thread cost of the CUDA calls a traced step makes (median of many)."""
    def cost_us(fn, n=2000) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) / n * 1e6)
        return statistics.median(times)

    cuda_event = torch.cuda.Event(enable_timing=True)
    generic = torch.Event(device=torch.device("cuda", 0), enable_timing=True)
    costs = {
        "torch.cuda.Event.record()": cost_us(cuda_event.record),
        "torch.Event.record()": cost_us(generic.record),
        "torch.cuda.max_memory_allocated()": cost_us(lambda: torch.cuda.max_memory_allocated(0), 200),
        "torch._C._cuda_memoryStats()": cost_us(lambda: torch._C._cuda_memoryStats(0), 200),
        "torch._C._cuda_resetPeakMemoryStats()": cost_us(lambda: torch._C._cuda_resetPeakMemoryStats(0)),
        "time.perf_counter_ns()": cost_us(time.perf_counter_ns),
    }
    torch.cuda.synchronize()
    print("INFO call costs (us): " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()), flush=True)


# --- deep capture (issue 33) under the real `traceml run` ------------------------------------------

CAPTURE_JOB = "harness.sort_straggler_job"  # the deep-capture job the tests and a benchmark run too
CAPTURE_EXTRA_MS = 30.0  # rank 1's extra sort time per step (the job calibrates its repeats to it)
CAPTURE_WATCH_S = 60  # the job stops its steps after this even if no capture ended
CAPTURE_LIMIT_S = 150  # the whole `traceml run`


def _launcher_missing() -> list[str]:
    """The distributions `traceml run`, its ranks and its embedded processor need that are not
    installed here: pyproject.toml's core dependencies and its `processor` and `train` extras
    (the one list), read by name; a requirement with an environment marker (an old Python's
    backport) is left out."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the processor extra's backport
        import tomli as tomllib

    from traceml.schema.version_floors import installed_version

    project = tomllib.loads((checkout.ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    wanted = [*project.get("dependencies", []), *extras.get("processor", []), *extras.get("train", [])]
    names = {re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line).group(1) for line in wanted if ";" not in line}
    return sorted(name for name in names if installed_version(name) is None)


def _importable_tree(folder: Path) -> Path:
    """A folder that makes this tree's `traceml` importable by path in a fresh interpreter (the
    launcher, the ranks torchrun starts, the embedded processor), installed or not: the package
    layout of setup.py's `PACKAGE_ROOTS` (`checkout.package_roots`) built of symbolic links to the
    tree's folders. Put first on PYTHONPATH it wins over an installed copy, so what runs is this tree.
    It links the tree's `harness` too (not installed; the ranks run the capture job from it) and
    nothing else of the root, whose other folders could shadow an installed distribution."""
    roots = checkout.package_roots()
    for name, source in sorted(roots.items(), key=lambda item: item[0].count(".")):
        dest = folder.joinpath(*name.split("."))
        inner = {other.split(".")[-1] for other in roots if other.startswith(name + ".")}
        if not inner:
            dest.symlink_to(checkout.ROOT / source, target_is_directory=True)
            continue
        dest.mkdir(parents=True)
        for entry in (checkout.ROOT / source).iterdir():
            if entry.name not in inner and entry.name != "__pycache__":
                (dest / entry.name).symlink_to(entry)
    (folder / "harness").symlink_to(checkout.ROOT / "harness", target_is_directory=True)
    return folder


def run_capture_job(workdir: Path, device: str = "cuda") -> dict:
    """`traceml run --nproc-per-node 2 -m harness.sort_straggler_job --device DEVICE` in `workdir`,
    from this tree (installed or not), with the launcher's defaults (embedded processor,
    `--capture auto`). Returns its exit status, output, run folder and what the job saw."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACEML_", "PET_", "TORCHELASTIC_"))}
    tree = _importable_tree(workdir / "importable")
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TRACEML_EXIT_AFTER_FLUSH="1")  # gloo's teardown can abort after the ranks flushed
    cwd = workdir / "job"
    cwd.mkdir()
    command = [sys.executable, "-m", "traceml.launcher.cli", "run", "--nproc-per-node", "2", "-m", CAPTURE_JOB,
               "--device", device, "--extra-ms", str(CAPTURE_EXTRA_MS), "--forward-wait-ms", "0",
               "--max-seconds", str(CAPTURE_WATCH_S), "--max-steps", "5000", "--seen-to", "capture_seen.json"]
    t0 = time.monotonic()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=CAPTURE_LIMIT_S)
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):  # the launcher ends its ranks
            try:
                os.killpg(proc.pid, sig)
                output, _ = proc.communicate(timeout=grace)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        else:
            output = b""
    runs = sorted(p for p in (cwd / "traceml_runs").glob("*") if p.is_dir())
    seen = cwd / "capture_seen.json"
    return {"returncode": proc.returncode, "timed_out": timed_out, "output": (output or b"").decode(errors="replace"),
            "wall_s": time.monotonic() - t0, "run_dir": runs[0] if len(runs) == 1 else None,
            "run_dirs": len(runs), "seen": json.loads(seen.read_text()) if seen.exists() else None}


def judge_capture_run(run: dict, device: str = "cuda") -> None:
    """PASS/FAIL lines for one run of the capture job (the reading `check_deep_capture` does)."""
    print(f"INFO capture: `traceml run` took {run['wall_s']:.1f} s, exit status {run['returncode']}", flush=True)
    summary_path = None if run["run_dir"] is None else run["run_dir"] / "final_summary.json"
    ok = run["returncode"] == 0 and summary_path is not None and summary_path.exists()
    check("capture.run", ok, f"exit status {run['returncode']}"
          + (f" (stopped after {CAPTURE_LIMIT_S} s)" if run["timed_out"] else "") + f", {run['run_dirs']} run folder(s)"
          + ("" if ok else f"; output tail:\n{run['output'][-3000:]}"))
    if not ok:
        return
    summary = json.loads(summary_path.read_text())
    straggler = next((i for i in summary["issues"] if i.get("culprit_rank") is not None), None)
    check("capture.straggler", straggler is not None and (straggler["kind"], straggler["culprit_rank"])
          == ("COMPUTE_STRAGGLER", 1), "the first finding naming a rank: "
          + ("none" if straggler is None else f"{straggler['kind']} rank {straggler['culprit_rank']}")
          + f" (issues: {[(i['kind'], i.get('culprit_rank')) for i in summary['issues']]})")
    auto = [c for c in summary.get("captures", []) if c["trigger"] != "manual"]
    capture = auto[0] if len(auto) == 1 else None
    check("capture.done", capture is not None and capture["status"] == "done"
          and (capture["culprit_rank"], capture["reference_rank"]) == (1, 0),
          f"{len(auto)} automatic capture(s): " + ("" if capture is None else
          f"{capture['trigger']} {capture['status']} ({capture['reason']}), rank {capture['culprit_rank']} "
          f"vs rank {capture['reference_rank']}"))
    if capture is None or capture["digest"] is None:
        return
    digest = capture["digest"]
    print(f"INFO capture: gap {digest['gap_ms']:.2f} ms per step; rows "
          + "; ".join(f"{r['kind']} {r['name'][:80]!r} culprit {r['culprit_ms']:.2f} reference {r['reference_ms']} "
                      f"excess {r['excess_ms']}" for r in digest["rows"][:6])
          + f"; not seen: {digest['not_seen']}", flush=True)
    want = "cuda" if device == "cuda" else "cpu"
    record = next((c for c in (run["seen"] or {}).get("captures", []) if c["capture_id"] == capture["capture_id"]),
                  None)
    activities = {} if record is None else {r["rank"]: r["activities"] for r in record["ranks"]}
    no_kernels = [n for n in digest["not_seen"] if n.startswith("no device kernels")]
    check("capture.activities", sorted(activities) == [0, 1] and all(want in a for a in activities.values())
          and (device != "cuda" or not no_kernels),
          f"each captured rank's activities as the processor's captures route gave them: {activities}; "
          f"the digest's 'no device kernels' notes: {no_kernels}")
    top = digest["rows"][0] if digest["rows"] else None
    known = top is not None and (top["excess_ms"] if top["excess_ms"] is not None else top["culprit_ms"])
    check("capture.top_row", top is not None and "sort" in top["name"].lower()
          and top["kind"] == ("kernel" if device == "cuda" else "op") and known > 5
          and (top["reference_ms"] is None or top["reference_ms"] < 0.1 * top["culprit_ms"]),
          "the top excess is the extra sort " + ("kernel, with device time" if device == "cuda" else "operator")
          + f" on rank 1 only: {top}")
    traces = capture.get("traces") or []
    kernels, sorts = {}, {}
    for name in traces:
        try:
            events = json.loads(gzip.decompress((run["run_dir"] / name).read_bytes())).get("traceEvents") or []
        except (OSError, ValueError) as exc:
            kernels[name] = f"unreadable: {type(exc).__name__}: {exc}"
            continue
        on_device = [e for e in events if isinstance(e, dict) and str(e.get("cat", "")).lower() == "kernel"]
        kernels[name] = len(on_device)
        sorts[name] = sum("sort" in str(e.get("name", "")).lower() for e in on_device)
    culprit = [n for n in traces if ".rank1." in n]
    wanted_kernels = device == "cuda"
    check("capture.traces", len(traces) == 2 and all(n.endswith(".pt.trace.json.gz") for n in traces)
          and all(isinstance(k, int) and (k > 0) == wanted_kernels for k in kernels.values())
          and (not wanted_kernels or (len(culprit) == 1 and sorts.get(culprit[0], 0) > 0)),
          f"beside final_summary.json, gzip'd Chrome traces: kernel events {kernels}, sort kernels {sorts}")


def check_deep_capture(torch) -> None:
    """Issue 33's straggler case with CUDA activities: `traceml run --nproc-per-node 2` of
    harness.sort_straggler_job (gloo, both ranks on cuda:0, rank 1's forward sorting a large CUDA
    tensor rank 0 never sorts), read from final_summary.json and the traces beside it."""
    missing = _launcher_missing()
    if missing:
        print(f"SKIP capture: `traceml run` cannot start here: not installed: {', '.join(missing)} "
              "(`pip install '.[processor]'`, or their wheels where no index can be reached)", flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="traceml-gpu-capture-") as folder:
        judge_capture_run(run_capture_job(Path(folder), "cuda"), "cuda")


def main() -> int:
    try:
        import torch
    except ImportError:
        print("SKIP gpu_check: torch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("SKIP gpu_check: no CUDA device available")
        return 0
    print(f"INFO device {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    for fn in (report_call_costs, check_sleep_kernels, check_forward_wrapper, check_matmul, check_memory,
               check_auto_mode, check_resources, check_nccl_collective_wait, check_gpu_overhead,
               check_deep_capture):
        try:
            fn(torch)
        except Exception as exc:  # report and go on with the other checks
            check(fn.__name__, False, f"raised {type(exc).__name__}: {exc}")
            traceml.shutdown(timeout_s=5)
    print(f"{'FAIL' if _failures else 'PASS'} gpu_check: {len(_failures)} failed {_failures}", flush=True)
    return 1 if _failures else 0


if __name__ == "__main__":
    sys.exit(main())
