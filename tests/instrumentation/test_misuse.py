"""Bad usage: each case warns once (or raises a clear error) and never corrupts a later step."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch

import traceml
from traceml import step_events as se
from traceml.samplers import StepTimeSampler
from traceml.schema.vocabulary import RAW_BACKWARD, RAW_FORWARD, RAW_STEP_TIME
from traceml.timing import timed_region

from tests.instrumentation.instr_fakes import flush_samplers


def _clean_step(model):
    with traceml.trace_step(model):
        with traceml.timed_backward():
            model(torch.ones(1, 2)).sum().backward()


_records: list = []


class _Sink:
    def on_step_time(self, record):
        _records.append(record)

    def on_step_memory(self, record):
        pass


@pytest.fixture(autouse=True)
def _collected():
    _records.clear()
    sink = _Sink()
    traceml.register_sink(sink)
    yield
    traceml.unregister_sink(sink)


def _delivered():
    """Every step record delivered in this test: a published step wakes the background
    sampler, which may have delivered some already; the rest are drained here."""
    flush_samplers()
    return list(_records)


def _counts(record):
    return {k: v.count for k, v in record.events.items()}


CLEAN = {RAW_FORWARD: 1, RAW_BACKWARD: 1, RAW_STEP_TIME: 1}


@pytest.fixture
def manual():
    traceml.init(mode="manual")
    model = traceml.wrap_forward(torch.nn.Linear(2, 1))
    yield model
    traceml.shutdown()


def test_exit_without_entry_warns_once_and_is_ignored(manual):
    region = timed_region(RAW_FORWARD)
    with pytest.warns(RuntimeWarning, match="exited without a matching entry"):
        region.__exit__(None, None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timed_region(RAW_FORWARD).__exit__(None, None, None)  # second time: silent
    _clean_step(manual)
    (record,) = _delivered()
    assert _counts(record) == CLEAN
    assert traceml.misuse_counts()["unbalanced_exit"] == 2


def test_double_exit_records_the_region_once(manual):
    with traceml.trace_step(manual):
        region = timed_region(RAW_BACKWARD)
        with region:
            manual(torch.ones(1, 2)).sum().backward()
        with pytest.warns(RuntimeWarning, match="exited without"):
            region.__exit__(None, None, None)
    _clean_step(manual)
    first, second = _delivered()
    assert _counts(first) == CLEAN and _counts(second) == CLEAN


def test_nested_trace_step_warns_once_and_keeps_the_outer_step(manual):
    with traceml.trace_step(manual):
        with pytest.warns(RuntimeWarning, match="nested"):
            with traceml.trace_step(manual):
                with traceml.timed_backward():
                    manual(torch.ones(1, 2)).sum().backward()
    _clean_step(manual)
    records = _delivered()
    assert [r.step for r in records] == [0, 1]
    assert all(_counts(r) == CLEAN for r in records)


def test_region_spanning_a_capture_boundary_is_discarded(manual):
    region = timed_region(RAW_BACKWARD).start()  # opened in the pending capture
    _clean_step(manual)  # completes the capture the region belongs to
    with pytest.warns(RuntimeWarning, match="step boundary"):
        region.stop()  # closes in the next capture: must not land there
    _clean_step(manual)
    first, second = _delivered()
    # The spanning region is never recorded, and it takes nothing with it: the step
    # it opened in keeps its own backward (the sampler drops only occurrences nested
    # in a *counted* one), and the later step is untouched.
    assert _counts(first) == CLEAN
    assert _counts(second) == CLEAN
    assert se.misuse_counts()["spanning_region"] == 1


def test_region_opened_in_a_step_and_closed_after_an_abort_is_discarded(manual):
    region = None
    with pytest.raises(KeyError):
        with traceml.trace_step(manual):
            region = timed_region(RAW_BACKWARD).start()
            raise KeyError("x")
    with pytest.warns(RuntimeWarning, match="step boundary"):
        region.stop()
    _clean_step(manual)
    (record,) = _delivered()
    assert record.step == 0 and _counts(record) == CLEAN


def test_recording_from_a_second_thread_is_ignored_and_counted(manual):
    caught = []

    def other_thread():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with traceml.trace_step(manual):
                with timed_region(RAW_BACKWARD):
                    pass
            caught.extend(str(w.message) for w in seen)

    with traceml.trace_step(manual):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        with traceml.timed_backward():
            manual(torch.ones(1, 2)).sum().backward()
    _clean_step(manual)
    records = _delivered()
    assert [r.step for r in records] == [0, 1]
    assert all(_counts(r) == CLEAN for r in records)
    assert any("thread other than the training thread" in m for m in caught)
    assert traceml.dropped_counts()["foreign_thread"] >= 1


def test_trace_step_without_init_warns_once_and_records_nothing():
    model = torch.nn.Linear(2, 1)
    with pytest.warns(RuntimeWarning, match="before traceml.init"):
        with traceml.trace_step(model):
            model(torch.ones(1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with traceml.trace_step(model):
            pass
    assert se.drain_step_time_batches() == [] and se.steps_completed() == 0
    traceml.init(mode="manual")
    traceml.wrap_forward(model)
    _clean_step(model)
    (record,) = _delivered()
    assert record.step == 0 and _counts(record) == CLEAN
    traceml.shutdown()


def test_exception_class_and_traceback_are_untouched(manual):
    class Custom(Exception):
        pass

    try:
        with traceml.trace_step(manual):
            raise Custom("payload")
    except Custom as exc:
        assert exc.args == ("payload",)
        assert exc.__traceback__ is not None
    _clean_step(manual)
    (record,) = _delivered()
    assert record.step == 0


def test_kill_switch_makes_everything_a_no_op(monkeypatch):
    from torch.utils.data import dataloader as dl

    monkeypatch.setenv("TRACEML_DISABLE", "1")
    before = (torch.Tensor.backward, dl._BaseDataLoaderIter.__next__)
    traceml.init(mode="auto")
    assert not traceml.is_initialized()
    assert (torch.Tensor.backward, dl._BaseDataLoaderIter.__next__) == before
    model = torch.nn.Linear(2, 1)
    loader = [torch.ones(1, 2)]
    assert traceml.wrap_dataloader(loader) is loader
    assert traceml.wrap_forward(model) is model
    assert traceml.forward.forward_timer(model) is None and "__call__" not in vars(torch.nn.Linear)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "before init" warning either
        with traceml.trace_step(model):
            with traceml.timed_backward():
                model(torch.ones(1, 2)).sum().backward()
    assert se.drain_step_time_batches() == [] and not se.has_active_capture()
    traceml.shutdown()


def test_kill_switch_accepts_the_documented_spellings(monkeypatch):
    from traceml.settings import kill_switch

    for value in ("1", "true", "YES", "on"):
        assert kill_switch({"TRACEML_DISABLE": value})
    for value in ("", "0", "false", "off"):
        assert not kill_switch({"TRACEML_DISABLE": value})


def test_a_trace_step_never_exited_is_superseded_once_its_capture_ends(manual):
    stuck = traceml.trace_step(manual)
    stuck.__enter__()  # e.g. a framework's end-of-step callback never ran
    traceml.abort_step_capture()  # ... and the integration discarded the group
    with pytest.warns(RuntimeWarning, match="never exited"):
        _clean_step(manual)
    stuck.__exit__(None, None, None)  # a late exit must not touch the newer steps
    _clean_step(manual)
    records = _delivered()
    assert [r.step for r in records] == [0, 1]
    assert all(_counts(r) == CLEAN for r in records)


def test_trace_step_whose_device_cannot_be_read_still_traces_the_step(sink):
    class Broken(torch.nn.Module):
        def parameters(self, recurse=True):
            raise RuntimeError("CUDA error: device-side assert")

    traceml.init(mode="manual")
    with pytest.warns(RuntimeWarning, match="could not select a device"):
        with traceml.trace_step(Broken()):
            pass
    traceml.shutdown()
    StepTimeSampler().run_once()
    assert [r.step for r in sink.steps] == [0]
    assert traceml.misuse_counts()["model_not_usable"] == 1


def test_trace_step_with_something_that_is_not_a_module_still_traces_the_step(sink):
    traceml.init(mode="auto")
    not_a_model = object()
    with pytest.warns(RuntimeWarning, match="cannot be timed as forward"):
        with traceml.trace_step(not_a_model):
            pass
    with traceml.trace_step(not_a_model):
        pass
    traceml.shutdown()
    StepTimeSampler().run_once()
    assert [r.step for r in sink.steps] == [0, 1]
