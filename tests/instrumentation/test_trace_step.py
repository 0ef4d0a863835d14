"""Public API: init, trace_step, manual and automatic modes on a tiny CPU model."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from tests.instrumentation.instr_fakes import flush_samplers
from harness.child_python import python_output

import traceml
from traceml import forward, patches, step_events as se
from traceml.schema.vocabulary import (
    RAW_BACKWARD,
    RAW_DATALOADER_NEXT,
    RAW_FORWARD,
    RAW_H2D,
    RAW_OPTIMIZER_STEP,
    RAW_STEP_TIME,
)


EVERY_REGION_ONCE = {RAW_DATALOADER_NEXT: 1, RAW_FORWARD: 1, RAW_BACKWARD: 1, RAW_OPTIMIZER_STEP: 1,
                     RAW_STEP_TIME: 1}


def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(12, 8), torch.randn(12, 1))
    return model, opt, torch.utils.data.DataLoader(data, batch_size=4)


def _counts(record):
    return {name: totals.count for name, totals in record.events.items()}


def test_auto_mode_times_every_region_once_per_step(sink):
    traceml.init(mode="auto")
    model, opt, loader = _tiny()
    for x, y in loader:
        with traceml.trace_step(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    traceml.shutdown()
    flush_samplers()
    assert [r.step for r in sink.steps] == [0, 1, 2]
    for record in sink.steps:
        assert _counts(record) == EVERY_REGION_ONCE
        assert all(t.gpu_ms is None for t in record.events.values())  # CPU run
        assert record.events[RAW_STEP_TIME].cpu_ms >= record.events[RAW_FORWARD].cpu_ms
    assert [(m.step, m.peak_allocated_bytes) for m in sink.memory] == [(0, None), (1, None), (2, None)]


def test_auto_mode_counts_no_h2d_on_cpu_and_no_submodule_forwards(sink):
    traceml.init(mode="auto")
    model, opt, _ = _tiny()
    x = torch.randn(4, 8)
    with traceml.trace_step(model):
        x = x.to("cpu").to(torch.float32)
        model(x).sum().backward()
    traceml.shutdown()
    flush_samplers()
    (record,) = sink.steps
    assert RAW_H2D not in record.events
    assert record.events[RAW_FORWARD].count == 1


def test_auto_mode_patches_host_to_device_copies_only_where_cuda_is_available(sink, monkeypatch):
    from traceml import hooks

    # No CUDA: no .to() can be a host-to-device copy, so Tensor.to/.cuda are left alone.
    traceml.init(mode="auto")
    assert patches.is_installed()
    assert "to" not in torch.Tensor.__dict__ and "cuda" not in torch.Tensor.__dict__
    traceml.shutdown()

    # CUDA available (faked: this machine has no GPU, and the detection is told that a
    # .to("cpu") is the copy), so each such copy inside a step is one H2D region.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hooks, "moves_host_to_device", lambda tensor, args, kwargs: args == ("cpu",))
    traceml.init(mode="auto")
    assert "to" in torch.Tensor.__dict__ and "cuda" in torch.Tensor.__dict__
    model, _, _ = _tiny()
    x = torch.randn(4, 8)
    with traceml.trace_step(model):
        x = x.to("cpu").to(torch.float32)
        model(x)
    traceml.shutdown()
    assert "to" not in torch.Tensor.__dict__ and "cuda" not in torch.Tensor.__dict__
    flush_samplers()
    (record,) = sink.steps
    assert record.events[RAW_H2D].count == 1
    assert record.events[RAW_H2D].gpu_ms is None  # CUDA was never initialised: CPU clock


def test_h2d_detection_only_for_cpu_to_cuda_copies():
    from traceml.hooks import moves_host_to_device

    cpu = torch.zeros(1)
    assert moves_host_to_device(cpu, ("cuda",), {})
    assert moves_host_to_device(cpu, (), {"device": torch.device("cuda", 0)})
    assert moves_host_to_device(cpu, (0,), {})
    assert not moves_host_to_device(cpu, ("cpu",), {})
    assert not moves_host_to_device(cpu, (torch.float16,), {})
    assert not moves_host_to_device(cpu, (), {"dtype": torch.float16})
    assert not moves_host_to_device(torch.zeros(1, device="meta"), ("cuda",), {})
    assert not moves_host_to_device(cpu, (cpu,), {})  # .to(other_cpu_tensor)


def test_uninstall_restores_the_originals():
    from torch.utils.data import dataloader as dl

    before = (torch.Tensor.backward, torch.Tensor.to, torch.Tensor.cuda, dl._BaseDataLoaderIter.__next__)
    traceml.init(mode="auto")
    model, opt, _ = _tiny()
    with traceml.trace_step(model):
        pass
    assert patches.is_installed()
    assert torch.Tensor.backward is not before[0]
    assert forward.forward_timer(model) is not None
    assert "__call__" in vars(torch.nn.Sequential)  # the class-wide forward wrapper
    assert patches.install() is False  # installed once
    traceml.shutdown()
    after = (torch.Tensor.backward, torch.Tensor.to, torch.Tensor.cuda, dl._BaseDataLoaderIter.__next__)
    assert after == before
    assert "to" not in torch.Tensor.__dict__
    assert forward.forward_timer(model) is None and "__call__" not in vars(torch.nn.Sequential)
    assert len(model._forward_pre_hooks) == 0 and len(model._forward_hooks) == 0
    from torch.optim import optimizer as optmod
    assert len(optmod._global_optimizer_pre_hooks) == 0
    assert len(optmod._global_optimizer_post_hooks) == 0


def test_manual_mode_installs_no_patches_and_wrappers_time_each_region(sink):
    from torch.utils.data import dataloader as dl

    original_next = dl._BaseDataLoaderIter.__next__
    traceml.init(mode="manual")
    assert dl._BaseDataLoaderIter.__next__ is original_next and not patches.is_installed()
    model, opt, loader = _tiny()
    model = traceml.wrap_forward(model)
    opt = traceml.wrap_optimizer(opt)
    for x, y in traceml.wrap_dataloader(loader):
        with traceml.trace_step(model):
            with traceml.timed_h2d():
                x, y = x.to("cpu"), y.to("cpu")
            loss = torch.nn.functional.mse_loss(model(x), y)
            with traceml.timed_backward():
                loss.backward()
            opt.step()
    traceml.shutdown()
    flush_samplers()
    assert len(sink.steps) == 3
    for record in sink.steps:
        assert _counts(record) == {RAW_DATALOADER_NEXT: 1, RAW_H2D: 1, RAW_FORWARD: 1, RAW_BACKWARD: 1,
                                   RAW_OPTIMIZER_STEP: 1, RAW_STEP_TIME: 1}


def test_manual_wrappers_in_auto_mode_do_not_double_count(sink):
    """Auto patches and hooks inside manual regions of the same names: the outermost counts."""
    traceml.init(mode="auto")
    model, opt, loader = _tiny()
    traceml.wrap_optimizer(opt)  # optimizer hooks on top of the global ones
    traceml.wrap_forward(model)  # the same forward timing auto mode adds: installed once
    for x, y in traceml.wrap_dataloader(loader):  # the patched __next__ runs inside this wrapper
        with traceml.trace_step(model):
            with traceml.timed_forward():
                out = model(x)  # forward timing inside
            with traceml.timed_backward():
                with traceml.timed_backward():  # a manual region nested in itself
                    torch.nn.functional.mse_loss(out, y).backward()  # Tensor.backward patch inside
            with traceml.timed_optimizer_step():
                opt.step()  # global and per-optimizer step hooks inside
            opt.zero_grad()
    traceml.shutdown()
    flush_samplers()
    assert [r.step for r in sink.steps] == [0, 1, 2]
    for record in sink.steps:
        assert _counts(record) == EVERY_REGION_ONCE
        assert [p.raw_event for p in record.phases].count(RAW_BACKWARD) == 1


def test_exception_in_trace_step_aborts_and_propagates_unchanged(sink):
    traceml.init(mode="manual")
    error = ValueError("user code failed")
    with pytest.raises(ValueError) as caught:
        with traceml.trace_step():
            raise error
    assert caught.value is error
    with traceml.trace_step():
        pass
    traceml.shutdown()
    flush_samplers()
    assert [r.step for r in sink.steps] == [0]  # the aborted step did not advance the counter


def test_forward_exception_does_not_leak_an_open_region(sink):
    traceml.init(mode="auto")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError):
        with traceml.trace_step(model):
            model(torch.zeros(3, 5))  # wrong shape
    with traceml.trace_step(model):
        model(torch.zeros(3, 2))
    traceml.shutdown()
    flush_samplers()
    (record,) = sink.steps
    assert record.events[RAW_FORWARD].count == 1


def test_dataloader_timing_scope_disables_and_restores(sink):
    traceml.init(mode="auto")
    model, opt, loader = _tiny()
    it = iter(loader)
    with traceml.dataloader_timing_scope(False):
        next(it)
        with traceml.dataloader_timing_scope(True):
            next(it)
        next(it)
    from traceml import timing
    assert timing.dataloader_timing_enabled()
    with traceml.trace_step(model):
        pass
    traceml.shutdown()
    flush_samplers()
    assert sink.steps[0].events[RAW_DATALOADER_NEXT].count == 1


def test_epoch_end_stop_iteration_is_not_recorded(sink):
    traceml.init(mode="auto")
    model, _, loader = _tiny()
    batches = list(loader)  # three nexts plus the StopIteration
    assert len(batches) == 3
    with traceml.trace_step(model):
        pass
    traceml.shutdown()
    flush_samplers()
    assert sink.steps[0].events[RAW_DATALOADER_NEXT].count == 3


def test_init_is_idempotent_and_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        traceml.init(mode="sometimes")
    assert not traceml.is_initialized()
    traceml.init(mode="manual")
    traceml.init(mode="auto")  # already initialised: unchanged
    assert traceml.mode() == "manual" and not patches.is_installed()


def test_trace_step_mode_from_environment(monkeypatch):
    monkeypatch.setenv("TRACEML_MODE", "manual")
    traceml.init()
    assert traceml.mode() == "manual"


def test_optimizer_step_that_raises_does_not_leak_into_later_steps(sink):
    traceml.init(mode="manual")
    model = torch.nn.Linear(2, 1)
    opt = traceml.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def failing_closure():
        raise RuntimeError("closure failed")

    with pytest.raises(RuntimeError):
        with traceml.trace_step(model):
            opt.step(failing_closure)  # the pre-hook ran, the post-hook never will
    for _ in range(2):
        with traceml.trace_step(model):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
    traceml.shutdown()
    flush_samplers()
    assert [r.step for r in sink.steps] == [0, 1]
    assert all(r.events[RAW_OPTIMIZER_STEP].count == 1 for r in sink.steps)


def test_reentrant_forward_of_the_outermost_module_is_timed_once(sink):
    class Recursive(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x, depth=2):
            return self.lin(x) if depth == 0 else self(x, depth - 1)

    traceml.init(mode="manual")
    model = traceml.wrap_forward(Recursive())
    for _ in range(2):
        with traceml.trace_step(model):
            model(torch.ones(1, 2))
    traceml.shutdown()
    flush_samplers()
    assert [r.events[RAW_FORWARD].count for r in sink.steps] == [1, 1]


def test_a_failing_exporter_start_never_breaks_training(sink, caplog):
    traceml.init(mode="manual", endpoint="ftp://not-an-otlp-endpoint")  # rejected by the exporter
    assert traceml.is_initialized()
    model = torch.nn.Linear(2, 1)
    with traceml.trace_step(model):
        model(torch.ones(1, 2))
    traceml.shutdown()
    flush_samplers()
    assert [r.step for r in sink.steps] == [0]
    from traceml import samplers
    assert samplers.registered_sinks() == (sink,)  # no half-started exporter left registered


def test_shutdown_drains_both_samplers_and_is_idempotent(sink):
    traceml.init(mode="manual")
    for _ in range(5):
        with traceml.trace_step():
            pass
    traceml.shutdown()  # no flush: shutdown itself must have delivered everything
    assert [r.step for r in sink.steps] == [0, 1, 2, 3, 4]
    assert [m.step for m in sink.memory] == [0, 1, 2, 3, 4]
    traceml.shutdown()
    assert not traceml.is_initialized()


def test_dataloader_workers_forked_from_the_training_process_record_nothing(sink):
    """Worker processes inherit the patches; the at-fork hook keeps them from recording."""

    class Probe(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            from traceml import step_events
            return torch.tensor([float(step_events.is_recording())])

    traceml.init(mode="auto")
    loader = torch.utils.data.DataLoader(Probe(), batch_size=2, num_workers=1,
                                         multiprocessing_context="fork")
    seen = torch.cat([b for b in loader]).flatten().tolist()
    with traceml.trace_step():
        pass
    traceml.shutdown()
    flush_samplers()
    assert seen == [0.0, 0.0, 0.0, 0.0]  # inside the worker recording was off
    assert sink.steps[0].events[RAW_DATALOADER_NEXT].count == 2  # the parent still timed its waits


def test_shutdown_then_init_again_keeps_counting_and_re_hooks_the_model(sink):
    model, opt, loader = _tiny()
    for _ in range(2):
        traceml.init(mode="auto")
        for x, y in loader:
            with traceml.trace_step(model):
                model(x).sum().backward()
                opt.step()
            break
        traceml.shutdown()
    flush_samplers()
    assert [r.step for r in sink.steps] == [0, 1]
    assert all(r.events[RAW_FORWARD].count == 1 for r in sink.steps)
    assert forward.forward_timer(model) is None  # removed again by the last shutdown
    assert "__call__" not in vars(torch.nn.Sequential)


@pytest.mark.parametrize("mode", ["manual", "auto"])
@pytest.mark.slow
def test_a_model_the_job_drops_is_freed_while_traceml_runs(sink, mode):
    """trace_step remembers the last model's memory tracker without keeping the model
    (and its device memory) alive: a sweep that drops one model before building the
    next must get the memory back."""
    traceml.init(mode=mode)
    model, opt, loader = _tiny()
    x, y = next(iter(loader))
    for _ in range(2):
        with traceml.trace_step(model):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    dropped = weakref.ref(model)
    del model, opt
    gc.collect()
    assert dropped() is None
    # The next model, and a step without a model, are traced as usual.
    second, opt, _ = _tiny()
    with traceml.trace_step(second):
        torch.nn.functional.mse_loss(second(x), y).backward()
        opt.step()
    with traceml.trace_step():
        pass
    traceml.shutdown()
    flush_samplers()
    assert [r.step for r in sink.steps] == [0, 1, 2, 3]
    forwards = [RAW_FORWARD in r.events for r in sink.steps]
    assert forwards == ([True, True, True, False] if mode == "auto" else [False] * 4)
    assert [m.device for m in sink.memory] == ["cpu"] * 4


def test_auto_mode_without_torch_falls_back_to_manual(tmp_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "import traceml\n"
            "traceml.init(mode='auto')\n"
            "assert traceml.mode() == 'manual', traceml.mode()\n"
            "with traceml.trace_step():\n"
            "    pass\n"
            "traceml.shutdown()\n"
            "print('ok', traceml.steps_completed())\n")
    assert python_output(code, timeout=60).split() == ["ok", "1"]


def test_auto_mode_dataloader_on_another_thread_leaves_the_training_threads_input_wait_intact(sink):
    """The patched `next()` reuses one timer on the training thread; another thread's
    concurrent `next()` must neither hold back nor close the training thread's region."""
    import threading

    traceml.init(mode="auto")
    inside, release = threading.Event(), threading.Event()

    class Blocking(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, index):
            inside.set()
            release.wait(30)
            return torch.zeros(1)

    foreign_loader = torch.utils.data.DataLoader(Blocking())
    foreign = threading.Thread(target=lambda: next(iter(foreign_loader)))

    class StartsTheOtherThread(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, index):
            foreign.start()
            if not inside.wait(30):
                raise RuntimeError("the other thread never reached its next()")
            return torch.zeros(1)

    try:
        next(iter(torch.utils.data.DataLoader(StartsTheOtherThread())))
        # Recorded as soon as the training thread's next() returned, while the other
        # thread's next() is still open.
        assert [event[0] for event in se.current_capture().events] == [RAW_DATALOADER_NEXT]
    finally:
        release.set()
        foreign.join(30)
    model = _tiny()[0]
    with traceml.trace_step(model):
        pass
    traceml.shutdown()
    flush_samplers()
    assert _counts(sink.steps[0]) == {RAW_DATALOADER_NEXT: 1, RAW_STEP_TIME: 1}
    assert traceml.dropped_counts()["foreign_thread"] == 1


def test_a_hold_quiets_hooks_patches_and_the_timed_loader(sink):
    traceml.init(mode="auto")
    model, opt, loader = _tiny()
    batches = iter(traceml.wrap_dataloader(loader))
    hold = se.RegionHold([RAW_DATALOADER_NEXT, RAW_FORWARD, RAW_BACKWARD, RAW_OPTIMIZER_STEP])
    x, y = next(batches)
    with traceml.trace_step(model):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    hold.release()
    x, y = next(batches)
    with traceml.trace_step(model):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    traceml.shutdown()
    flush_samplers()
    held_step, free_step = sink.steps
    assert _counts(held_step) == {RAW_STEP_TIME: 1}
    assert _counts(free_step) == EVERY_REGION_ONCE


def test_cpu_memory_snapshot_is_stamped_on_the_wall_clock_at_the_step_end(sink):
    import time

    traceml.init(mode="manual")
    model, _, _ = _tiny()
    before = time.time_ns()
    with traceml.trace_step(model):
        model(torch.ones(1, 8))
    after = time.time_ns()
    traceml.shutdown()
    flush_samplers()
    (snapshot,) = sink.memory
    (record,) = sink.steps
    assert (snapshot.step, snapshot.device, snapshot.peak_allocated_bytes, snapshot.peak_reserved_bytes) == \
        (0, "cpu", None, None)
    # Wall clock at the step's end: within the step's bounds (up to the clock mapping's rounding).
    assert before <= snapshot.time_ns <= after + 1_000_000
    assert abs(snapshot.time_ns - record.end_time_ns) < 1_000_000
