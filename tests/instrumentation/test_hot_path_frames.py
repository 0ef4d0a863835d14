"""The hot path's shape: how many Python frames the training thread enters per step and region.

Inside a real step every Python-level call costs the training thread far more than
in a hot loop (docs/design/performance-history.md, "Training-side overhead"), so the hot path was
built to enter as few frames as it can. A benchmark notices when it grows only on a
quiet machine; these exact counts notice it in every test run. Frames are counted
with `sys.setprofile` ('call' events; C calls are not frames), in steady state
(after a warm-up call), with the garbage collector off so that no finaliser runs
inside the counted window. Where torch's own Python code runs (optimizer, DataLoader,
module call, autograd) only TraceML's frames are counted: torch's vary by version.
"""
from __future__ import annotations

import gc
import pathlib
import sys

import pytest
import torch

import traceml


EXPECTED_FRAMES = {
    "manual": {"trace_step": 5, "timed_forward": 2, "timed_region": 3, "optimizer_step": 2,
               "dataloader_next": 1, "forward": 1, "backward": 0},
    "auto": {"trace_step": 5, "timed_forward": 2, "timed_region": 3, "optimizer_step": 2,
             "dataloader_next": 1, "forward": 1, "backward": 1},
}
"""Frames per operation. `trace_step` counts every frame its `with` enters (no other
code runs there): its `__init__`, `__enter__`, `current_capture` (each step's capture
is new), `__exit__` and `complete_step_capture`, which puts on both queues inline.
The others count TraceML's frames only: a call wrapper (DataLoader `next()`, the
model's `__call__`, `Tensor.backward`) times its call in its own frame on the CPU
fast path (1); hooks are two calls (pre, post); a `with` region is `__enter__` and
`__exit__`, plus `__init__` for `timed_region(name)`. Manual mode has no backward
patch (0). Measured in a job that does not use OpenTelemetry itself. Before issue 23:
7 / 3 / 3 / 3 for trace_step / dataloader_next / forward / auto backward."""

FRAMES_WITH_USER_OTEL = {"trace_step": 7}
"""Frames a job that uses OpenTelemetry adds per `trace_step`: reading the job's current
span context (OpenTelemetry API and SDK frames; TraceML's own stay as above)."""

HOW_TO_UPDATE = (
    "Python frames entered on the training thread's hot path changed. If that is a "
    "deliberate change, measure its cost (benchmarks/bench_overhead.py, "
    "bench_cold_cache.py), update EXPECTED_FRAMES in {file} to the new counts and say "
    "why in the commit; otherwise find the frame that was added.")


def _is_traceml(frame) -> bool:
    """By module name, not file path: an editable install runs the code through links."""
    name = frame.f_globals.get("__name__", "")
    return name == "traceml" or name.startswith("traceml.")


def _frames(call) -> tuple[int, int]:
    """(TraceML frames, all frames) entered by one `call()`, not counting `call` itself."""
    ours = total = 0

    def profile(frame, event, _arg):
        nonlocal ours, total
        if event == "call":
            total += 1
            if _is_traceml(frame):
                ours += 1

    gc_was_enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
        if gc_was_enabled:
            gc.enable()
    return ours, total - 1


def _steady(call) -> tuple[int, int]:
    call()  # warm-up: first-use work (tracker selection, lazy attributes) is not the hot path
    return _frames(call)


def _measure(mode: str) -> dict[str, int]:
    traceml.init(mode=mode)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=1)
    if mode == "manual":
        traceml.wrap_forward(model)
        traceml.wrap_optimizer(optimizer)
        loader = traceml.wrap_dataloader(loader)
    batches = iter(loader)
    x = torch.randn(2, 4)
    loss = model(x).sum()

    def empty_step():
        with traceml.trace_step(model):
            pass

    def shorthand_region():
        with traceml.timed_forward():
            pass

    def named_region():
        with traceml.timed_region("custom"):
            pass

    got = {}
    ours, total = _steady(empty_step)
    assert ours == total, "only TraceML code runs inside an empty trace_step"
    got["trace_step"] = total
    step = traceml.trace_step(model)
    step.__enter__()  # the regions below run inside an open step, as in training
    try:
        got["timed_forward"] = _steady(shorthand_region)[0]
        got["timed_region"] = _steady(named_region)[0]
        got["optimizer_step"] = _steady(optimizer.step)[0]
        got["dataloader_next"] = _steady(lambda: next(batches))[0]
        got["forward"] = _steady(lambda: model(x))[0]
        got["backward"] = _steady(lambda: loss.backward(retain_graph=True))[0]
    finally:
        step.__exit__(None, None, None)
    traceml.shutdown()
    return got


@pytest.fixture
def job_without_otel(monkeypatch):
    """As in a job that never imported OpenTelemetry (other tests in this process did)."""
    monkeypatch.delitem(sys.modules, "opentelemetry.trace", raising=False)


@pytest.mark.parametrize("mode", ["manual", "auto"])
def test_frames_per_hot_path_operation_are_exactly_the_measured_counts(mode, job_without_otel):
    got, expected = _measure(mode), EXPECTED_FRAMES[mode]
    assert got == expected, f"{mode}: measured {got}, expected {expected}. " + HOW_TO_UPDATE.format(file=__file__)


def test_a_job_with_its_own_span_active_adds_only_the_api_frames_that_read_it(monkeypatch):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    traceml.init(mode="manual")
    tracer = TracerProvider().get_tracer("job")

    def step():
        with traceml.trace_step():
            pass

    with monkeypatch.context() as m:
        m.delitem(sys.modules, "opentelemetry.trace")
        base_ours, base_total = _steady(step)
    with tracer.start_as_current_span("train_epoch") as epoch:
        ours, total = _steady(step)
    traceml.shutdown()
    assert ours == base_ours, "TraceML's own frames do not change"
    assert {"trace_step": total - base_total} == FRAMES_WITH_USER_OTEL, HOW_TO_UPDATE.format(file=__file__)
    assert epoch.get_span_context().is_valid and trace.get_current_span() is not epoch


def test_the_counter_sees_an_added_frame(job_without_otel):
    """The counter itself: one extra Python call inside the step is one more frame."""
    traceml.init(mode="manual")

    def helper():
        return None

    def step_with_helper():
        with traceml.trace_step():
            helper()

    def step():
        with traceml.trace_step():
            pass

    assert _steady(step_with_helper)[1] == _steady(step)[1] + 1


INFERRED_UPDATE_FRAMES = {"update": 6, "update_at_boundary": 6}
"""TraceML frames of one `optimizer.step()` in an unmarked auto-mode loop, where every update
ends an inferred step (`step_boundary`): the timer's pre/post hooks (2), `current_capture`
(the step's capture is new), the boundary hook, `_end_step` and `complete_step_capture`
(its two queue puts inline). A marked loop spends `trace_step` (5) + `optimizer_step` (2)
on the same step. Once a `trace_step` was entered the hook is gone and `optimizer_step`
above holds."""


@pytest.mark.slow
def test_frames_of_an_update_that_ends_an_inferred_step(job_without_otel):
    traceml.init(mode="auto")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(2, 4)).sum()
    loss.backward(retain_graph=True)
    optimizer.step()  # the first update: adopts the boundary, searches the model (not the hot path)

    def update():
        loss.backward(retain_graph=True)
        optimizer.step()

    backward_frames = _steady(lambda: loss.backward(retain_graph=True))[0]
    got = {"update": _steady(update)[0] - backward_frames}
    got["update_at_boundary"] = _frames(optimizer.step)[0]
    steps = traceml.steps_completed()
    traceml.shutdown()
    assert steps >= 4  # every update above ended a step
    assert got == INFERRED_UPDATE_FRAMES, f"measured {got}. " + HOW_TO_UPDATE.format(file=__file__)


COLLECTIVE_FRAMES = {"all_reduce": 4, "async_wait": 4, "all_gather_object": 7, "ddp_backward": 5}
"""TraceML frames of collectives in auto mode (a one-rank gloo group, inside an open step):
a blocking `all_reduce` enters its wrapper and the shared timer's pre/post (3) plus the
`Work.wait` wrapper, which finds the timer busy and calls through (1); an `async_op=True`
call enters only its wrapper (1), and its `wait()` the wait wrapper and pre/post (3; the
call and the wait together: `async_wait`); `all_gather_object` (3) plus its two nested
`all_gather` calls and their `Work.wait`s, which find the timer busy and call through (4).
`ddp_backward` is a forward and backward of a DDP module minus the same of a plain one:
the `_pre_forward` wrapper, `arm` (the pre-hook on the loss's grad_fn), that pre-hook,
the final callback it queues (`_graph_done`) and `finish`: per synchronising backward,
nothing per bucket (DDP's own all-reduce path is untouched)."""


def test_frames_of_collectives(job_without_otel):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        traceml.init(mode="auto")
        torch.manual_seed(0)
        plain = torch.nn.Linear(4, 4)
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        other = torch.nn.Linear(4, 4)  # like the DDP module, not the step's model: no forward timing
        x = torch.randn(2, 4)
        ddp(x).sum().backward()  # the first forward registers the hook; the first backward builds buckets
        t = torch.ones(1)
        step = traceml.trace_step(plain)
        step.__enter__()
        try:
            got = {"all_reduce": _steady(lambda: dist.all_reduce(t))[0],
                   "async_wait": _steady(lambda: dist.all_reduce(t, async_op=True).wait())[0],
                   "all_gather_object": _steady(lambda: dist.all_gather_object([None], 1))[0]}

            def ddp_backward():
                ddp(x).sum().backward()

            def plain_backward():
                other(x).sum().backward()

            got["ddp_backward"] = _steady(ddp_backward)[0] - _steady(plain_backward)[0]
        finally:
            step.__exit__(None, None, None)
        traceml.shutdown()
    finally:
        dist.destroy_process_group()
    assert got == COLLECTIVE_FRAMES, f"measured {got}. " + HOW_TO_UPDATE.format(file=__file__)
