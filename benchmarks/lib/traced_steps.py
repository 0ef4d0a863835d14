"""bench_overhead's step loop under each TraceML mode, the empty traced step, the sampler drain.

The modes (MODES) time the same five regions (input wait, H2D, forward, backward,
optimizer step) in `trace_step`:

- "manual": the explicit wrappers: the timed loader and a `with` block per region;
- "manual_hooks": the timed loader, `timed_h2d`/`timed_backward`, and the model and
  optimizer instrumented once with `wrap_forward`/`wrap_optimizer`;
- "auto": the automatic patches (plus `timed_h2d`: on CPU no copy goes to a device);
- "auto_unmarked": as "auto" without `trace_step` (steps inferred from `opt.step()`).
"""
from __future__ import annotations

import torch

import traceml
from traceml import forward, hooks, patches, step_boundary
from traceml.schema.vocabulary import RAW_DATALOADER_NEXT

from benchmarks.lib.workload import Batches, Job, block_plain

MODES = ("manual", "manual_hooks", "auto", "auto_unmarked")

CPU_MODULE = torch.nn.Linear(1, 1)  # selects the CPU for trace_step even where CUDA exists


def with_timed_loader(job: Job, tm=traceml) -> Job:
    """`job` with `timed_batches` over `tm.wrap_dataloader` of its loader (the manual modes')."""
    job.timed_batches = Batches(tm.wrap_dataloader(job.loader))
    return job


def block_traced(job: Job, steps: int, clock, out: list, mode: str, tm=traceml) -> None:
    """One block of traced steps; `mode` (one of MODES) says who times the five regions.

    `tm` is the traceml API to time with (bench_cold_cache passes another checkout's).
    """
    model, opt = job.model, job.opt
    next_batch = job.plain_batches.next if mode.startswith("auto") else job.timed_batches.next
    if mode == "manual":
        forward_, optimizer_step = tm.timed_forward, tm.timed_optimizer_step
        for _ in range(steps):
            t0 = clock()
            x, y = next_batch()
            with tm.trace_step(model):
                with tm.timed_h2d():
                    x = x.to("cpu")
                with forward_():
                    out_ = model(x)
                loss = torch.nn.functional.mse_loss(out_, y)
                with tm.timed_backward():
                    loss.backward()
                with optimizer_step():
                    opt.step()
                opt.zero_grad(set_to_none=True)
            out.append(clock() - t0)
        return
    if mode == "auto_unmarked":
        # The same loop without trace_step: steps inferred from the optimizer updates.
        for _ in range(steps):
            t0 = clock()
            x, y = next_batch()
            with tm.timed_h2d():
                x = x.to("cpu")
            out_ = model(x)
            loss = torch.nn.functional.mse_loss(out_, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(clock() - t0)
        return
    hooked = mode == "manual_hooks"
    for _ in range(steps):
        t0 = clock()
        x, y = next_batch()
        with tm.trace_step(model):
            with tm.timed_h2d():
                x = x.to("cpu")
            out_ = model(x)
            loss = torch.nn.functional.mse_loss(out_, y)
            if hooked:
                with tm.timed_backward():
                    loss.backward()
            else:
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out.append(clock() - t0)


def mode_runner(job: Job, mode: str | None):
    """A runner of `steps` steps: uninstrumented (mode None), or one of MODES.

    TraceML stays initialised for the whole run; only what touches the step is added
    before the steps and removed after them: the forward and optimizer timing, or the
    automatic patches. Starting and stopping TraceML around every block made the
    following steps measurably slower, an artefact no real job has.
    """
    def run(steps, clock, out, warmup=0):
        if mode is None:
            if warmup:
                block_plain(job, warmup, clock, [])
            block_plain(job, steps, clock, out)
            return
        if mode == "manual_hooks":
            traceml.wrap_forward(job.model)
            traceml.wrap_optimizer(job.opt)
        elif mode == "auto":
            patches.install()
            patches.instrument_model(job.model)
        elif mode == "auto_unmarked":
            patches.install()
            patches.instrument_model(job.model)  # what the optimizer's model search does once
            step_boundary.arm()
        try:
            if warmup:
                block_traced(job, warmup, clock, [], mode)
            block_traced(job, steps, clock, out, mode)
        finally:
            if mode == "manual_hooks":
                forward.remove_forward_instrumentation(job.model)
                hooks.remove_optimizer_instrumentation(job.opt)
            elif mode == "auto":
                patches.uninstall()
            elif mode == "auto_unmarked":
                step_boundary.disarm()
                patches.uninstall()
    return run


def drain_samplers() -> None:
    """Resolve and deliver everything the steps so far published, on this thread, now.

    The throughput phases call this every 0.5 s of steps, timed, in place of the
    sampler threads: left to them, that work (which holds the GIL) lands in whichever
    step runs when they wake, uninstrumented ones included, flattering the ratio.
    """
    for sampler in (traceml._time_sampler, traceml._memory_sampler):
        if sampler is not None:
            sampler.run_once()


def empty_block(steps: int, clock, out: list, traced: bool) -> None:
    """`steps` empty steps: with `traced`, an input-wait region then `trace_step` around four
    empty regions (the instrumentation alone, no work)."""
    region = traceml.timed_region
    model = CPU_MODULE
    for _ in range(steps):
        t0 = clock()
        if traced:
            with region(RAW_DATALOADER_NEXT, device="cpu"):
                pass
            with traceml.trace_step(model):
                with traceml.timed_h2d():
                    pass
                with traceml.timed_forward():
                    pass
                with traceml.timed_backward():
                    pass
                with traceml.timed_optimizer_step():
                    pass
        out.append(clock() - t0)
