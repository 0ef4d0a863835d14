"""Inferred step boundaries (`traceml.step_boundary`): one step per optimizer update in auto mode.

Real torch loops in this process, the real samplers drained by hand: the step count
follows the updates (accumulation, several optimizers, none at all), an explicit
`trace_step` or an integration's claim switches inference off for good, and the
step's traced time leaves its input wait out (Step Time = Input Wait + Traced).
"""
from __future__ import annotations

import gc
import time
import warnings

import pytest
import torch
from tests.instrumentation.instr_fakes import flush_samplers

import traceml
from traceml import forward, step_boundary
from traceml.schema.vocabulary import (
    RAW_BACKWARD,
    RAW_DATALOADER_NEXT,
    RAW_FORWARD,
    RAW_OPTIMIZER_STEP,
    RAW_STEP_TIME,
    STEP_BOUNDARY_EXPLICIT,
    STEP_BOUNDARY_NONE,
    STEP_BOUNDARY_OPTIMIZER,
)


def _model(width: int = 4):
    return torch.nn.Sequential(torch.nn.Linear(width, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _loader(batches: int, width: int = 4, sleep_s: float = 0.0):
    data = torch.utils.data.TensorDataset(torch.randn(batches * 2, width), torch.randn(batches * 2, 1))

    def collate(items):
        if sleep_s:
            time.sleep(sleep_s)
        return torch.utils.data.default_collate(items)

    return torch.utils.data.DataLoader(data, batch_size=2, collate_fn=collate)


def _counts(record, name):
    totals = record.events.get(name)
    return 0 if totals is None else totals.count


def _records(sink):
    traceml.shutdown()
    flush_samplers()
    return sorted(sink.steps, key=lambda r: r.step)


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


@pytest.mark.slow
def test_one_step_per_update_with_input_wait_outside_the_traced_time(sink):
    traceml.init(mode="auto")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    time.sleep(0.05)  # "model build" after init, before the first timed event: in no step
    loop_start_ns = time.time_ns()
    for x, y in _loader(5, sleep_s=0.01):
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    assert step_boundary.boundary_kind() == STEP_BOUNDARY_OPTIMIZER
    records = _records(sink)
    assert [r.step for r in records] == [0, 1, 2, 3, 4]
    for r in records:
        assert _counts(r, RAW_OPTIMIZER_STEP) == 1 and _counts(r, RAW_BACKWARD) == 1
        assert _counts(r, RAW_DATALOADER_NEXT) == 1 and _counts(r, RAW_STEP_TIME) == 1
        wait, traced = r.events[RAW_DATALOADER_NEXT].cpu_ms, r.events[RAW_STEP_TIME].cpu_ms
        assert wait >= 9.0  # the loader's sleep
        span_ms = (r.end_time_ns - r.start_time_ns) / 1e6
        # the step is the whole interval, and wait + traced is exactly that interval
        assert wait + traced == pytest.approx(span_ms, abs=0.01)
        assert all(p.raw_event != step_boundary.INFERRED_STEP for p in r.phases)
    first = records[0]
    # the 50 ms before the loop is not in it: the first step starts when the loop does (a busy
    # machine can only start it later; 5 ms for the wall-clock offset the stamps are mapped with)
    assert first.start_time_ns >= loop_start_ns - 5_000_000
    # the model was found when its optimizer was built: forward is timed from the first step
    assert all(_counts(r, RAW_FORWARD) == 1 for r in records)
    # consecutive steps touch: one ends where the next begins
    for a, b in zip(records[1:], records[2:]):
        assert b.start_time_ns == a.end_time_ns


def _generator(batches: int, width: int = 4, sleep_s: float = 0.0):
    """A streaming reader with no DataLoader: each batch takes `sleep_s` to read."""
    for _ in range(batches):
        if sleep_s:
            time.sleep(sleep_s)
        yield torch.randn(2, width), torch.randn(2, 1)


@pytest.mark.slow
def test_without_a_dataloader_the_time_before_forward_is_the_input_wait(sink):
    # Issue 30 item 2: a generator's fetch lies between one update's end and the next forward.
    traceml.init(mode="auto")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _generator(5, sleep_s=0.02):
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    records = _records(sink)
    assert [r.step for r in records] == [0, 1, 2, 3, 4]
    for r in records[1:]:
        wait, traced = r.events[RAW_DATALOADER_NEXT], r.events[RAW_STEP_TIME]
        assert wait.count == 0  # no next() was timed: measured before forward
        assert wait.cpu_ms >= 19.0  # the reader's sleep
        assert wait.gpu_ms is None  # a CPU step
        span_ms = (r.end_time_ns - r.start_time_ns) / 1e6
        assert wait.cpu_ms + traced.cpu_ms == pytest.approx(span_ms, abs=0.01)
        assert traced.cpu_ms < wait.cpu_ms  # the tiny model's step, without the fetch
        gap = [p for p in r.phases if p.raw_event == RAW_DATALOADER_NEXT]
        assert len(gap) == 1 and gap[0].start_time_ns == r.start_time_ns
        forward = next(p for p in r.phases if p.raw_event == RAW_FORWARD)
        assert gap[0].end_time_ns == pytest.approx(forward.start_time_ns, abs=1_000)
    # The first step starts at its first timed event: nothing before forward to measure.
    assert records[0].events[RAW_DATALOADER_NEXT].cpu_ms == 0.0


@pytest.mark.slow
def test_a_dataloader_step_keeps_its_next_as_the_input_wait(sink):
    traceml.init(mode="auto")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _loader(3):
        time.sleep(0.02)  # host work after next(), before forward: in the traced step, not input
        _loss(model, x, y).backward()
        opt.step()
    records = _records(sink)
    for r in records:
        assert r.events[RAW_DATALOADER_NEXT].count == 1
        assert r.events[RAW_DATALOADER_NEXT].cpu_ms < 15.0
        assert r.events[RAW_STEP_TIME].cpu_ms >= 19.0


@pytest.mark.slow
def test_gradient_accumulation_gives_one_step_per_update(sink):
    traceml.init(mode="auto")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(_loader(14)):
        _loss(model, x, y).backward()
        if (i + 1) % 4 == 0 or i == 13:
            opt.step()
            opt.zero_grad()
    records = _records(sink)
    assert [_counts(r, RAW_BACKWARD) for r in records] == [4, 4, 4, 2]
    assert [_counts(r, RAW_OPTIMIZER_STEP) for r in records] == [1, 1, 1, 1]


@pytest.mark.slow
def test_two_optimizers_in_one_round_end_the_step_at_the_last_of_them(sink):
    traceml.init(mode="auto")
    model = _model()
    head, body = list(model.parameters())[:2], list(model.parameters())[2:]
    opt_a, opt_b = torch.optim.SGD(head, lr=0.1), torch.optim.Adam(body, lr=0.1)
    for x, y in _loader(6):
        _loss(model, x, y).backward()
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    records = _records(sink)
    # the first round ends at opt_a (not known yet), every later one at opt_b
    assert len(records) == 6
    assert [_counts(r, RAW_OPTIMIZER_STEP) for r in records] == [1, 3, 2, 2, 2, 2]
    assert [_counts(r, RAW_BACKWARD) for r in records] == [1, 1, 1, 1, 1, 1]


@pytest.mark.slow
def test_a_gan_round_is_one_step_ending_at_the_first_optimizer(sink):
    traceml.init(mode="auto")
    gen, disc = _model(), _model()
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    for x, y in _loader(5):
        _loss(disc, x, y).backward()
        opt_d.step()
        opt_d.zero_grad()
        _loss(gen, x, y).backward()
        opt_g.step()
        opt_g.zero_grad()
    # both models were found (one search per optimizer) and time their forward
    assert forward.forward_timer(gen) is not None and forward.forward_timer(disc) is not None
    records = _records(sink)
    assert len(records) == 5  # one per iteration, each ending at the discriminator's update
    assert [_counts(r, RAW_BACKWARD) for r in records] == [1, 2, 2, 2, 2]
    assert [_counts(r, RAW_FORWARD) for r in records] == [1, 2, 2, 2, 2]


@pytest.mark.slow
def test_an_optimizer_built_before_init_has_its_model_found_at_its_first_update(sink):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    traceml.init(mode="auto")
    for x, y in _loader(3):
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    records = _records(sink)
    assert [_counts(r, RAW_FORWARD) for r in records] == [0, 1, 1]


def _pending_full_collection() -> list:
    """Objects that make CPython's next automatic collection a full one, as after importing torch.

    A full pass runs when the oldest generation's count passed its threshold and the
    objects promoted since the last full pass exceed a quarter of those it kept: both
    made true here (the lists, promoted by one generation-1 collection, then enough
    generation-1 collections to pass the count), with collection held off meanwhile.
    """
    gc.collect()
    gc.disable()
    try:
        kept = [[] for _ in range(len(gc.get_objects()) // 3 + 10_000)]
        for _ in range(gc.get_threshold()[2] + 1):
            gc.collect(1)
    finally:
        gc.enable()
    return kept


@pytest.mark.slow
def test_a_pending_full_collection_is_paid_at_the_first_update_outside_every_step(sink):
    """A full collection due when the loop starts (torch 2.15 on Python 3.13 under `traceml run`)
    lands between step 0 and step 1, not inside a step's input wait (collate allocates)."""
    full: list[tuple[int, int]] = []
    started: list[int] = []

    def on_gc(phase, info):
        if info["generation"] == 2:
            if phase == "start":
                started.append(time.time_ns())
            else:
                full.append((started.pop(), time.time_ns()))

    def collate(items):
        if fetched[0]:  # from step 1 on: garbage enough to start an automatic collection
            [[] for _ in range(2 * gc.get_threshold()[0])]
        fetched[0] += 1
        return torch.utils.data.default_collate(items)

    fetched = [0]
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=2, collate_fn=collate)
    threshold = gc.get_threshold()
    traceml.init(mode="auto")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gc.set_threshold(20_000, threshold[1], threshold[2])  # step 0 alone never starts one
    kept = _pending_full_collection()
    gc.callbacks.append(on_gc)
    try:
        for x, y in loader:
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
    finally:
        gc.callbacks.remove(on_gc)
        gc.set_threshold(*threshold)
    del kept
    records = _records(sink)
    assert [r.step for r in records] == [0, 1, 2, 3]
    assert len(full) == 1  # the pending one ran, once
    middle = sum(full[0]) // 2
    assert records[0].end_time_ns < middle < records[1].start_time_ns


def test_the_optimizer_constructor_is_restored_at_shutdown():
    init = torch.optim.Optimizer.__init__
    traceml.init(mode="auto")
    assert torch.optim.Optimizer.__init__ is not init
    with pytest.warns(RuntimeWarning, match="no step was recorded"):
        traceml.shutdown()
    assert torch.optim.Optimizer.__init__ is init


def test_a_loop_without_an_optimizer_gets_no_step_and_one_warning(sink):
    traceml.init(mode="auto")
    model = _model()
    with torch.no_grad():
        for x, _ in _loader(4):
            model(x)
    with pytest.warns(RuntimeWarning, match="no optimizer.step"):
        traceml.shutdown()
    assert step_boundary.boundary_kind() == STEP_BOUNDARY_NONE
    flush_samplers()
    assert sink.steps == []
    traceml.init(mode="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        traceml.shutdown()  # said once per process


@pytest.mark.slow
def test_an_explicit_trace_step_switches_inference_off_without_double_counting(sink):
    traceml.init(mode="auto")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = list(_loader(6))
    for x, y in batches[:2]:  # an unmarked warm-up: two inferred steps
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    assert traceml.steps_completed() == 2
    for x, y in batches[2:]:
        with traceml.trace_step(model):
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
    assert not step_boundary.is_inferring()
    opt.step()  # after the claim an update outside any trace_step makes no step
    assert traceml.steps_completed() == 6
    assert step_boundary.boundary_kind() == STEP_BOUNDARY_EXPLICIT
    records = _records(sink)
    assert [_counts(r, RAW_OPTIMIZER_STEP) for r in records] == [1, 1, 1, 1, 1, 1]
    assert [_counts(r, RAW_STEP_TIME) for r in records] == [1] * 6
    # and it stays off across a shutdown/init cycle
    traceml.init(mode="auto")
    assert not step_boundary.is_inferring()


def test_a_marked_loop_never_infers_a_step(sink):
    traceml.init(mode="auto")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _loader(4):
        with traceml.trace_step(model):
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
    records = _records(sink)
    assert len(records) == 4
    assert step_boundary._state.inferred_steps == 0


def test_an_integration_claim_keeps_its_own_boundaries(sink):
    traceml.init(mode="auto")
    step_boundary.claim_explicit()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _loader(3):
        _loss(model, x, y).backward()
        opt.step()
    assert traceml.steps_completed() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        traceml.shutdown()  # no "no step" warning: someone else owns the boundaries
    assert step_boundary.boundary_kind() == STEP_BOUNDARY_EXPLICIT  # claimed, none completed (yet)


def test_manual_mode_and_recording_off_infer_nothing(sink):
    traceml.init(mode="manual")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _loss(model, torch.randn(2, 4), torch.randn(2, 1)).backward()
    opt.step()
    assert traceml.steps_completed() == 0
    traceml.shutdown()
    traceml.init(mode="auto")
    traceml.set_recording(False)
    opt.step()
    traceml.set_recording(True)
    assert traceml.steps_completed() == 0
    with pytest.warns(RuntimeWarning, match="no step was recorded"):
        traceml.shutdown()


def test_the_model_search_finds_the_outermost_wrapper():
    from traceml import model_search

    inner = _model()

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x):
            return self.module(x)

    outer = Wrapper(inner)
    param = next(inner.parameters())
    assert model_search.outermost_module_holding(param) is outer
    assert model_search.outermost_module_holding(torch.nn.Parameter(torch.zeros(1))) is None


@pytest.mark.slow
def test_an_integration_can_name_the_model_so_step_0_has_its_forward(sink):
    traceml.init(mode="auto")
    model = _model()
    step_boundary.note_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _loader(2):
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    records = _records(sink)
    assert [_counts(r, RAW_FORWARD) for r in records] == [1, 1]


def test_the_gpu_traced_time_is_the_interval_minus_the_gpu_input_wait():
    from traceml.records import EventTotals, PhaseInterval

    totals = {step_boundary.INFERRED_STEP: EventTotals(10.0, 8.0, 1),
              RAW_DATALOADER_NEXT: EventTotals(3.0, 2.5, 2), RAW_BACKWARD: EventTotals(4.0, 4.0, 1)}
    phases = (PhaseInterval(step_boundary.INFERRED_STEP, 0, 10), PhaseInterval(RAW_BACKWARD, 5, 9))
    phases = step_boundary.resolve_inferred(totals, phases)
    assert totals[RAW_STEP_TIME] == EventTotals(7.0, 5.5, 1)
    assert step_boundary.INFERRED_STEP not in totals
    assert [p.raw_event for p in phases] == [RAW_STEP_TIME, RAW_BACKWARD]
    totals = {step_boundary.INFERRED_STEP: EventTotals(10.0, None, 1), RAW_DATALOADER_NEXT: EventTotals(3.0, 2.5, 1)}
    step_boundary.resolve_inferred(totals, ())
    assert totals[RAW_STEP_TIME] == EventTotals(7.0, None, 1)  # no GPU start event: unavailable, not 0


@pytest.mark.slow
def test_on_cuda_each_update_records_the_next_steps_gpu_start(sink, fake_gpu):
    """The CUDA branch with a fake device: the event recorded at one update is the GPU start of
    the next step, so GPU traced time exists from the second inferred step on."""
    from traceml import timing

    class FakeTracker:
        _cuda = is_cuda = True
        device = "cuda:0"

        def __init__(self):
            self.reads = self.resets = 0

        def read(self):
            self.reads += 1

        def reset(self):
            self.resets += 1

    traceml.init(mode="auto")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = list(_loader(4))
    x, y = batches[0]
    _loss(model, x, y).backward()
    opt.step()  # step 0 (CPU tracker chosen from the model)
    tracker = FakeTracker()
    step_boundary._state.tracker = tracker
    timing.configure_gpu_timing(True, pool=timing.event_pool())
    for x, y in batches[1:]:
        fake_gpu.now_ms += 10.0
        _loss(model, x, y).backward()
        fake_gpu.now_ms += 5.0
        opt.step()
    fake_gpu.complete_all()
    records = _records(sink)
    assert len(records) == 4 and tracker.reads == 3 and tracker.resets == 3
    assert records[1].events[RAW_STEP_TIME].gpu_ms is None  # no GPU start before its first update
    # No DataLoader: the 10 ms before forward (GPU start at the update to forward's start event)
    # is the input wait, measured before forward (count 0), and the traced step is the rest.
    assert [r.events[RAW_DATALOADER_NEXT].gpu_ms for r in records[2:]] == [10.0, 10.0]
    assert [r.events[RAW_DATALOADER_NEXT].count for r in records[2:]] == [0, 0]
    assert [r.events[RAW_STEP_TIME].gpu_ms for r in records[2:]] == [5.0, 5.0]
