"""Forward timing of the outermost model (`traceml.forward`): the class-wide call wrapper
and the module-hook fallback, with what must keep working around them: copies, pickles,
other instances of the class, FX tracing, torch.compile, TorchScript, exceptions and
garbage collection."""
from __future__ import annotations

import copy
import gc
import pickle
import warnings

import pytest
import torch
from tests.instrumentation.instr_fakes import flush_samplers

import traceml
from traceml import forward
from traceml.schema.vocabulary import RAW_FORWARD


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def forward(self, x):
        return self.body(x)


class NetWithOwnCall(Net):
    """A class that defines `__call__` itself: the wrapper must call it, then restore it."""

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs) * 2


class Failing(torch.nn.Module):
    def forward(self, x):
        raise ValueError("bad batch")


def _forwards(sink) -> list:
    flush_samplers()
    return [r.events[RAW_FORWARD].count if RAW_FORWARD in r.events else 0 for r in sink.steps]


@pytest.fixture
def manual():
    traceml.init(mode="manual")
    yield
    traceml.shutdown()


def test_copies_and_pickles_of_an_instrumented_model_carry_nothing_of_traceml(sink, manual):
    torch.manual_seed(0)
    model = traceml.wrap_forward(Net())
    assert "__call__" in vars(Net) and not model._forward_pre_hooks  # the class wrapper, no hook
    deep, shallow = copy.deepcopy(model), copy.copy(model)
    blob = pickle.dumps(model)
    assert b"traceml" not in blob  # loadable where TraceML is not installed
    loaded = pickle.loads(blob)
    x = torch.randn(3, 4)
    with traceml.trace_step(model):
        expected = model(x)
        outputs = [deep(x), shallow(x), loaded(x)]
    for out in outputs:
        assert torch.equal(out, expected)
    assert _forwards(sink) == [1]  # only the instrumented instance is timed


def test_other_instances_and_subclasses_of_the_class_pass_through(sink, manual):
    class Wider(Net):
        pass

    model, other, sub = traceml.wrap_forward(Net()), Net(), Wider()
    x = torch.randn(2, 4)
    with traceml.trace_step(model):
        other(x), sub(x)
    with traceml.trace_step(model):
        model(x), other(x), model(x)
    assert _forwards(sink) == [0, 2]


def test_a_class_with_its_own_call_keeps_it_and_gets_it_back(sink, manual):
    own = vars(NetWithOwnCall)["__call__"]
    model = traceml.wrap_forward(NetWithOwnCall())
    assert vars(NetWithOwnCall)["__call__"] is not own
    x = torch.randn(2, 4)
    with traceml.trace_step(model):
        out = model(x)
    assert torch.equal(out, model.body(x) * 2)
    assert _forwards(sink) == [1]
    forward.remove_forward_instrumentation(model)
    assert vars(NetWithOwnCall)["__call__"] is own


def test_a_model_holding_its_own_class_gets_module_hooks(sink, manual):
    # Every inner Sequential call would pass through a class-wide wrapper: hooks instead.
    model = traceml.wrap_forward(torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.nn.ReLU()))
    assert "__call__" not in vars(torch.nn.Sequential)
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    with traceml.trace_step(model):
        model(torch.randn(2, 4))
    assert _forwards(sink) == [1]
    forward.remove_forward_instrumentation(model)
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.slow
def test_the_class_wrapper_goes_with_the_last_instrumented_instance(sink, manual):
    first, second = traceml.wrap_forward(Net()), traceml.wrap_forward(Net())
    forward.remove_forward_instrumentation(first)
    assert "__call__" in vars(Net)  # `second` still uses it
    x = torch.randn(2, 4)
    with traceml.trace_step():  # no model: trace_step keeps no reference to `second`
        first(x), second(x)
    assert _forwards(sink) == [1]
    del second
    gc.collect()  # a collected module is forgotten, and with it the class wrapper
    assert "__call__" not in vars(Net)
    assert not forward._timers and Net not in forward._patched


def test_fx_tracing_still_sees_an_instrumented_leaf_module(manual):
    linear = traceml.wrap_forward(torch.nn.Linear(4, 4))
    assert "__call__" in vars(torch.nn.Linear)
    traced = torch.fx.symbolic_trace(torch.nn.Sequential(linear, torch.nn.ReLU()))
    # the wrapper defers to Module.__call__ as patched by the tracer: Linear stays a leaf
    assert [n.op for n in traced.graph.nodes if n.target == "0"] == ["call_module"]
    x = torch.randn(2, 4)
    assert torch.equal(traced(x), torch.relu(linear(x)))
    forward.remove_forward_instrumentation(linear)
    assert "__call__" not in vars(torch.nn.Linear)


def test_a_forward_that_raises_closes_its_region(sink, manual):
    model = traceml.wrap_forward(Failing())
    with pytest.raises(ValueError, match="bad batch"):
        with traceml.trace_step(model):
            model(torch.randn(1))
    good = traceml.wrap_forward(Net())
    with traceml.trace_step(good):
        good(torch.randn(2, 4))
    assert _forwards(sink) == [1]  # the aborted step is not published; nothing leaked into the next
    assert forward.forward_timer(model)._depth == 0


@pytest.mark.slow
def test_torch_compile_around_or_inside_the_model(sink, manual):
    x = torch.randn(2, 4)
    net = Net()
    compiled = traceml.wrap_forward(torch.compile(net, backend="eager"))
    plain = traceml.wrap_forward(Net())
    twice = torch.compile(lambda module, batch: module(batch) * 2, backend="eager")
    in_place = traceml.wrap_forward(Net())
    in_place.compile(backend="eager")  # Module.compile after instrumenting: its own call path
    with warnings.catch_warnings():
        # dynamo graph-breaks on the clock and thread reads of any Python-level timer
        warnings.simplefilter("ignore", UserWarning)
        with traceml.trace_step(compiled):
            out = compiled(x)
        with traceml.trace_step(plain):
            doubled = twice(plain, x)
        with traceml.trace_step(in_place):
            again = in_place(x)
    assert torch.equal(out, net(x)) and torch.equal(doubled, plain(x) * 2)
    assert torch.equal(again, in_place.forward(x))
    assert _forwards(sink) == [1, 1, 1]


def test_a_module_that_cannot_be_timed_warns_and_the_step_goes_on(sink):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script in torch 2.13
        scripted = torch.jit.script(Net())  # TorchScript modules take no forward hooks
    traceml.init(mode="manual")
    with pytest.warns(RuntimeWarning, match="cannot be timed as forward"):
        assert traceml.wrap_forward(scripted) is scripted
    with traceml.trace_step(scripted):
        scripted(torch.randn(2, 4))
    traceml.shutdown()
    traceml.init(mode="auto")  # trace_step(model) instruments it: the same, once per process
    with traceml.trace_step(scripted):
        scripted(torch.randn(2, 4))
    traceml.shutdown()
    assert traceml.misuse_counts()["forward_not_timed"] == 2
    assert _forwards(sink) == [0, 0]
