"""Lightning steps (contract, "Lightning steps"), checked on real CPU Trainers.

Every test runs a real `Trainer.fit` from `lightning.pytorch` or `pytorch_lightning`
and asserts on what the TraceML samplers publish to a test sink: the number of
steps, their ids, and the per-step count of each raw event.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest

# Importing lightning (and pytorch_lightning) costs seconds: the fast loop leaves the whole
# module out, unimported (tests/conftest.py).
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")
pytest.importorskip("pytorch_lightning")

from harness.child_python import child_env  # noqa: E402
import traceml  # noqa: E402
from traceml._testing import reset_for_tests  # noqa: E402
from traceml.integrations import lightning as tl  # noqa: E402
from traceml.integrations.lightning import accumulation, reporting  # noqa: E402
from traceml.schema.environment import TRACEML_DISABLE  # noqa: E402
from traceml.schema.vocabulary import (  # noqa: E402
    RAW_BACKWARD,
    RAW_DATALOADER_NEXT,
    RAW_FORWARD,
    RAW_H2D,
    RAW_OPTIMIZER_STEP,
    RAW_STEP_TIME,
)

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
FETCH, H2D, FWD, BWD, OPT, STEP = (RAW_DATALOADER_NEXT, RAW_H2D, RAW_FORWARD, RAW_BACKWARD,
                                   RAW_OPTIMIZER_STEP, RAW_STEP_TIME)


# --- A sink standing in for the exporter ------------------------------------------------


class ListSink:
    """Collects what the samplers deliver, exactly as the exporter would receive it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = []
        self.memory = []

    def on_step_time(self, record) -> None:
        with self._lock:
            self.steps.append(record)

    def on_step_memory(self, record) -> None:
        with self._lock:
            self.memory.append(record)

    def ids(self) -> list[int]:
        return [r.step for r in self.steps]

    def counts(self, raw_event: str) -> list[int]:
        return [r.events[raw_event].count if raw_event in r.events else 0 for r in self.steps]


@pytest.fixture
def traced(request):
    """A fresh TraceML process state in `auto` mode (what `traceml run` sets up),
    with automatic Lightning attach on; `finish()` drains the samplers into the sink."""
    mode = getattr(request, "param", "auto")
    reset_for_tests()
    traceml.init(mode=mode)
    sink = ListSink()
    traceml.register_sink(sink)
    tl.auto_attach()

    def finish() -> ListSink:
        traceml.shutdown()
        return sink

    sink.finish = finish
    yield sink
    tl.remove_auto_attach()
    traceml.unregister_sink(sink)
    reset_for_tests()


# --- Tiny models, one set of classes per namespace -------------------------------------


def _pl(namespace: str):
    return importlib.import_module(namespace)


class FailingBackward(torch.autograd.Function):
    """Identity forward; its backward raises (a failure in the middle of a backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


class Block(torch.nn.Module):
    """Counts its own forward executions (real calls plus checkpoint recomputation)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.linear(x))


_MODULES: dict[str, dict[str, type]] = {}


def modules(namespace: str) -> dict[str, type]:
    """LightningModule classes built on `namespace`'s base class (built once each)."""
    if namespace in _MODULES:
        return _MODULES[namespace]
    pl = _pl(namespace)

    class Regression(pl.LightningModule):
        """Automatic optimisation: training_step calls self(x) once."""

        def __init__(self, fail_at: int | None = None, fail_in: str = "training_step") -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
            self.fail_at = fail_at
            self.fail_in = fail_in
            self.global_steps_seen: list[int] = []

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            if batch_idx == self.fail_at and self.fail_in == "training_step":
                raise RuntimeError("boom in training_step")
            self.global_steps_seen.append(self.trainer.global_step)
            x, y = batch
            out = self(x)
            if batch_idx == self.fail_at and self.fail_in == "backward":
                out = FailingBackward.apply(out)
            return torch.nn.functional.mse_loss(out, y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

        def predict_step(self, batch, batch_idx):
            return self(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Checkpointed(pl.LightningModule):
        """self(x) calls the encoder (a nested call of a direct child) under activation
        checkpointing; training_step also calls the head directly: two forwards per batch."""

        def __init__(self, manual: bool = False) -> None:
            super().__init__()
            self.encoder = Block(4)
            self.head = torch.nn.Linear(4, 1)
            self.automatic_optimization = not manual

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.encoder, x, use_reentrant=False)

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.automatic_optimization:
                return torch.nn.functional.mse_loss(self.head(self(x)), y)
            x = x.requires_grad_(True)
            h = self(x)
            # an input-gradient penalty: autograd.grad recomputes the checkpointed
            # encoder inside training_step, outside Lightning's backward hooks
            (grad,) = torch.autograd.grad(h.sum(), x, create_graph=True)
            loss = torch.nn.functional.mse_loss(self.head(h), y) + grad.pow(2).mean()
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)  # recomputes the encoder again, inside training_step
            opt.step()
            return None

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class TwoOptimizers(pl.LightningModule):
        """Manual optimisation with a generator and a critic, GAN style."""

        def __init__(self) -> None:
            super().__init__()
            self.generator = torch.nn.Linear(4, 4)
            self.critic = torch.nn.Linear(4, 1)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            x, _ = batch
            opt_g, opt_c = self.optimizers()
            loss_g = -self.critic(self.generator(x)).mean()
            opt_g.zero_grad()
            self.manual_backward(loss_g)
            opt_g.step()
            loss_c = self.critic(x).mean() - self.critic(self.generator(x).detach()).mean()
            opt_c.zero_grad()
            self.manual_backward(loss_c)
            opt_c.step()

        def configure_optimizers(self):
            return (torch.optim.SGD(self.generator.parameters(), lr=0.01),
                    torch.optim.SGD(self.critic.parameters(), lr=0.01))

    _MODULES[namespace] = dict(Regression=Regression, Checkpointed=Checkpointed,
                               TwoOptimizers=TwoOptimizers)
    return _MODULES[namespace]


def loader(batches: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batches, 4, generator=gen)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_size=1)


def trainer(namespace: str = "lightning.pytorch", **kwargs):
    options = dict(accelerator="cpu", devices=1, max_epochs=1, enable_progress_bar=False,
                   logger=False, enable_checkpointing=False, enable_model_summary=False,
                   num_sanity_val_steps=0)
    options.update(kwargs)
    return _pl(namespace).Trainer(**options)


def traceml_callbacks(t) -> list:
    return [cb for cb in t.callbacks if isinstance(cb, tl.TraceMLCallback)]


def assert_uninstalled(t, module) -> None:
    """No wrapper left on the strategy or loop, no hook left on the module or its children."""
    for name in ("training_step", "batch_to_device", "optimizer_step"):
        assert name not in vars(t.strategy), name
    for name in ("_on_before_fetch", "_on_after_fetch"):
        assert name not in vars(t.fit_loop.epoch_loop), name
    for m in (module, *module.children()):
        assert not m._forward_hooks and not m._forward_pre_hooks, m


# --- Automatic optimisation: one step per accumulation group ----------------------------


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_ten_batches_accumulating_four_publish_groups_of_four_four_two(traced, namespace):
    model = modules(namespace)["Regression"]()
    t = trainer(namespace, accumulate_grad_batches=4, max_epochs=2)
    t.fit(model, loader(10))
    sink = traced.finish()

    assert t.global_step == 6
    assert len(traceml_callbacks(t)) == 1
    assert type(traceml_callbacks(t)[0]).namespace == namespace
    assert sink.ids() == [0, 1, 2, 3, 4, 5]
    per_epoch = [4, 4, 2]
    assert sink.counts(FETCH) == per_epoch * 2
    assert sink.counts(H2D) == per_epoch * 2
    assert sink.counts(FWD) == per_epoch * 2
    assert sink.counts(BWD) == per_epoch * 2
    assert sink.counts(OPT) == [1] * 6
    # each micro-batch opens and closes its own traced region
    assert sink.counts(STEP) == per_epoch * 2
    assert [m.step for m in sink.memory] == [0, 1, 2, 3, 4, 5]
    assert all(m.device == "cpu" and m.peak_allocated_bytes is None for m in sink.memory)
    for record in sink.steps:
        assert record.start_time_ns <= record.end_time_ns
        assert all(totals.cpu_ms >= 0 and totals.gpu_ms is None for totals in record.events.values())
        # optimizer.step() runs the closure first; its timed region starts after the last
        # backward, even with auto mode's global optimizer hooks installed
        last_backward_end = max(p.end_time_ns for p in record.phases if p.raw_event == BWD)
        (optimizer,) = [p for p in record.phases if p.raw_event == OPT]
        assert optimizer.start_time_ns >= last_backward_end
        # each transfer lies inside its micro-batch's traced region
        regions = [p for p in record.phases if p.raw_event == STEP]
        for h2d in (p for p in record.phases if p.raw_event == H2D):
            assert any(r.start_time_ns <= h2d.start_time_ns and h2d.end_time_ns <= r.end_time_ns
                       for r in regions)
    assert_uninstalled(t, model)
    assert traceml.misuse_counts() == {}


def test_fallback_rule_when_should_accumulate_is_missing(traced, monkeypatch):
    monkeypatch.setattr(accumulation, "_SHOULD_ACCUMULATE", "_no_such_method")
    monkeypatch.setattr(reporting.warn_once, "seen", set())
    model = modules("lightning.pytorch")["Regression"]()
    t = trainer(accumulate_grad_batches=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model, loader(10))
    sink = traced.finish()
    assert any("accumulate_grad_batches" in str(w.message) for w in caught)
    assert sink.counts(FWD) == [4, 4, 2]
    assert sink.counts(OPT) == [1, 1, 1]


def test_strategy_owning_accumulation_publishes_only_updated_groups(traced):
    pl = _pl("lightning.pytorch")

    class OwnsAccumulation(pl.strategies.SingleDeviceStrategy):
        """Steps the optimizer itself every `every` micro-batches (as DeepSpeed does)."""

        every = 4
        micro = 0

        @property
        def handles_gradient_accumulation(self) -> bool:
            return True

        def optimizer_step(self, optimizer, closure, model=None, **kwargs):
            self.micro += 1
            if self.micro % self.every:
                return closure()
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    model = modules("lightning.pytorch")["Regression"]()
    t = trainer(accumulate_grad_batches=4, strategy=OwnsAccumulation(device=torch.device("cpu")),
                devices=1)
    t.fit(model, loader(10))
    assert traceml.current_capture().events == []
    sink = traced.finish()
    # the last two micro-batches never reached an update: discarded, not published
    assert sink.ids() == [0, 1]
    assert sink.counts(FWD) == [4, 4]
    assert sink.counts(OPT) == [1, 1]
    assert traceml.steps_completed() == 2


# --- Manual optimisation: one step per batch ---------------------------------------------


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_manual_optimisation_with_two_optimizers_is_batch_scoped(traced, namespace):
    model = modules(namespace)["TwoOptimizers"]()
    t = trainer(namespace)
    t.fit(model, loader(3))
    sink = traced.finish()
    assert sink.ids() == [0, 1, 2]
    assert sink.counts(FETCH) == [1, 1, 1]
    # five top-level calls of direct children: generator, critic, critic, generator, critic
    assert sink.counts(FWD) == [5, 5, 5]
    assert sink.counts(BWD) == [2, 2, 2]
    assert sink.counts(OPT) == [2, 2, 2]
    assert_uninstalled(t, model)


# --- Forward: direct children, nesting and activation checkpointing -----------------------


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_nested_calls_and_checkpoint_recomputation_are_not_counted_twice(traced, manual):
    model = modules("lightning.pytorch")["Checkpointed"](manual=manual)
    t = trainer(accumulate_grad_batches=1 if manual else 2)
    t.fit(model, loader(4))
    sink = traced.finish()
    # the encoder really ran again during backward (recomputation), every batch
    assert model.encoder.calls >= (12 if manual else 8)
    if manual:
        assert sink.counts(FWD) == [2, 2, 2, 2]
        assert sink.counts(BWD) == [1, 1, 1, 1]
    else:
        assert sink.counts(FWD) == [4, 4]
        assert sink.counts(BWD) == [2, 2]


def test_hooks_go_in_after_the_weight_averaging_copy(traced):
    pl = _pl("lightning.pytorch")
    averaging = pl.callbacks.WeightAveraging()
    model = modules("lightning.pytorch")["Regression"]()
    # TraceML's callback first: its setup() runs before the averaging copy is made
    t = trainer(accumulate_grad_batches=2, callbacks=[tl.TraceMLCallback(), averaging])
    t.fit(model, loader(4))
    sink = traced.finish()
    assert sink.counts(FWD) == [2, 2]
    # the averaged copy was made in setup(), before the hooks: it never carried them
    copies = list(averaging._average_model.modules())
    assert len(copies) > 1
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in copies)


# --- Failures, validation, resume -----------------------------------------------------------


@pytest.mark.parametrize("fail_in", ["training_step", "backward"])
def test_exception_mid_group_aborts_the_whole_group(traced, fail_in):
    module_cls = modules("lightning.pytorch")["Regression"]
    model = module_cls(fail_at=6, fail_in=fail_in)  # third micro-batch of the second group
    t = trainer(accumulate_grad_batches=4)
    with pytest.raises(RuntimeError, match=f"boom in {fail_in}"):
        t.fit(model, loader(10))
    assert_uninstalled(t, model)
    assert traceml.steps_completed() == 1
    assert traceml.current_capture().events == []  # the partial group is gone

    # A later fit in the same process starts clean: nothing of the aborted group leaks.
    model2 = module_cls()
    t2 = trainer(accumulate_grad_batches=4)
    t2.fit(model2, loader(4))
    sink = traced.finish()
    assert sink.ids() == [0, 1]
    assert sink.counts(FWD) == [4, 4]
    assert sink.counts(FETCH) == [4, 4]
    assert sink.counts(BWD) == [4, 4]
    # every region the failure left open was closed before the abort, none spanned it
    assert traceml.misuse_counts() == {}


def test_validation_between_and_inside_groups_never_leaks(traced):
    model = modules("lightning.pytorch")["Regression"]()
    # a compatible manual set-up on top: the core times every call of the module,
    # validation included, unless the integration keeps validation out
    traceml.wrap_forward(model)
    # validation after batches 3 and 6: inside group 2 and at the end of group 3
    t = trainer(accumulate_grad_batches=2, val_check_interval=3, limit_val_batches=3,
                num_sanity_val_steps=2)
    t.fit(model, loader(8), loader(5))
    assert t.fit_loop.epoch_loop.val_loop.batch_progress.total.completed > 0
    sink = traced.finish()
    assert sink.ids() == [0, 1, 2, 3]
    assert sink.counts(FETCH) == [2, 2, 2, 2]
    assert sink.counts(H2D) == [2, 2, 2, 2]
    assert sink.counts(FWD) == [2, 2, 2, 2]
    assert sink.counts(BWD) == [2, 2, 2, 2]
    assert sink.counts(OPT) == [1, 1, 1, 1]
    assert sink.counts(STEP) == [2, 2, 2, 2]


def test_validate_and_predict_outside_fit_publish_nothing(traced):
    model = traceml.wrap_forward(modules("lightning.pytorch")["Regression"]())
    t = trainer()
    t.validate(model, loader(3), verbose=False)
    t.predict(model, loader(3))
    assert traceml.current_capture().events == []
    sink = traced.finish()
    assert sink.steps == []


_RESUME = textwrap.dedent("""
    import json, sys
    import traceml
    from traceml.integrations import lightning as tl

    # as `traceml run` does: attach before the script imports Lightning
    traceml.init(mode="auto")
    tl.auto_attach()
    assert "lightning.pytorch" not in sys.modules
    from tests.integrations import test_lightning_trainer as h  # imports torch and both Lightning namespaces

    sink = h.ListSink()
    traceml.register_sink(sink)
    model = h.modules("lightning.pytorch")["Regression"]()
    t = h.trainer(accumulate_grad_batches=2, max_epochs=2)
    t.fit(model, h.loader(8), ckpt_path={ckpt!r})
    traceml.shutdown()
    print(json.dumps({{"ids": sink.ids(), "fwd": sink.counts(h.FWD),
                      "global_steps": model.global_steps_seen,
                      "attached": len(h.traceml_callbacks(t))}}))
""")


@pytest.mark.slow
def test_resume_from_checkpoint_keeps_step_ids_process_local(traced, tmp_path):
    model = modules("lightning.pytorch")["Regression"]()
    t = trainer(accumulate_grad_batches=2)
    t.fit(model, loader(8))
    ckpt = str(tmp_path / "epoch1.ckpt")
    t.save_checkpoint(ckpt)
    assert traced.finish().ids() == [0, 1, 2, 3]

    script = _RESUME.format(ckpt=ckpt)
    env = child_env(PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=150, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # attached through the import hook, since Lightning was imported after auto_attach()
    assert result["attached"] == 1
    # Lightning resumes its own counter at 4; TraceML ids start over in the new process
    assert result["global_steps"][0] == 4
    assert result["ids"] == [0, 1, 2, 3]
    assert result["fwd"] == [2, 2, 2, 2]


@pytest.mark.parametrize("broken", [FETCH, H2D, FWD, BWD, OPT, STEP, "install"],
                         ids=lambda raw: raw.rsplit(":", 1)[-1])
@pytest.mark.slow
def test_a_failing_telemetry_call_never_breaks_training(traced, monkeypatch, broken):
    from traceml import timing

    real_region = timing.timed_region

    def region(raw_event, **kwargs):
        if raw_event == broken:
            raise RuntimeError("telemetry broke")
        return real_region(raw_event, **kwargs)

    def no_forward_hooks(*args, **kwargs):
        raise RuntimeError("hook registration broke")

    if broken == "install":  # fails half-way through installing the hooks
        monkeypatch.setattr(torch.nn.Module, "register_forward_hook", no_forward_hooks)
    else:
        monkeypatch.setattr(timing, "timed_region", region)
    monkeypatch.setattr(reporting.warn_once, "seen", set())
    model = modules("lightning.pytorch")["Regression"]()
    t = trainer(accumulate_grad_batches=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model, loader(6))
    assert model.global_steps_seen == [0, 0, 1, 1, 2, 2]  # training ran to the end
    assert any("stops recording" in str(w.message) for w in caught)
    assert_uninstalled(t, model)
    assert traced.finish().steps == []  # the broken fit published nothing
    assert traceml.misuse_counts() == {}


# --- Attaching ------------------------------------------------------------------------------


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_manual_callback_is_reused_not_duplicated(traced, namespace):
    mine = tl.TraceMLCallback(namespace=namespace)
    t = trainer(namespace, callbacks=[mine])
    assert tl.attach(t) is mine
    model = modules(namespace)["Regression"]()
    t.fit(model, loader(2))
    assert traceml_callbacks(t) == [mine]
    assert traced.finish().ids() == [0, 1]


def test_callback_added_without_init_starts_traceml_in_manual_mode():
    reset_for_tests()
    sink = ListSink()
    traceml.register_sink(sink)
    try:
        t = trainer(callbacks=[tl.TraceMLCallback()], accumulate_grad_batches=2)
        t.fit(modules("lightning.pytorch")["Regression"](), loader(4))
        assert traceml.is_initialized() and traceml.mode() == "manual"
        traceml.shutdown()
        assert sink.ids() == [0, 1]
        assert sink.counts(FWD) == [2, 2]
    finally:
        traceml.unregister_sink(sink)
        reset_for_tests()


def test_callback_goes_before_checkpoint_callbacks(traced, tmp_path):
    t = trainer(enable_checkpointing=True, default_root_dir=str(tmp_path))
    callback = tl.attach(t)
    names = [type(cb).__name__ for cb in t.callbacks]
    assert names.index("TraceMLCallback") < names.index("ModelCheckpoint")
    assert tl.attach(t) is callback


def test_disabled_launch_installs_nothing(traced, monkeypatch):
    monkeypatch.setenv(TRACEML_DISABLE, "1")
    # As a disabled launch starts: init() is a no-op (without this the auto-mode session the
    # fixture started would still infer steps from the optimizer updates).
    reset_for_tests()
    traceml.init()
    assert not traceml.is_initialized()
    tl.remove_auto_attach()
    assert tl.auto_attach() is False
    model = modules("lightning.pytorch")["Regression"]()
    t = trainer()
    assert tl.attach(t) is None
    t.fit(model, loader(2))
    assert traceml_callbacks(t) == []
    assert_uninstalled(t, model)
    assert traced.finish().steps == []


def test_auto_attach_imports_no_lightning():
    probe = textwrap.dedent("""
        import sys
        for name in ("torch", "lightning", "pytorch_lightning"):
            sys.modules[name] = None  # importing any of them now fails
        from traceml.integrations import lightning as tl
        assert tl.auto_attach() is True
        tl.remove_auto_attach()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_namespace_is_taken_from_the_trainer():
    assert tl.trainer_namespace(trainer("pytorch_lightning")) == "pytorch_lightning"
    assert tl.trainer_namespace(trainer("lightning.pytorch")) == "lightning.pytorch"
    with pytest.raises(TypeError):
        tl.trainer_namespace(object())
    with pytest.raises(ValueError):
        tl.callback_class("lightning")


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_callback_survives_pickling_for_spawned_processes(namespace):
    import pickle

    callback = pickle.loads(pickle.dumps(tl.TraceMLCallback(namespace=namespace)))
    assert isinstance(callback, tl.TraceMLCallback)
    assert isinstance(callback, _pl(namespace).Callback)
    assert type(callback).namespace == namespace


# --- CUDA: event timing and the group-wide peak-memory window ------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_groups_resolve_gpu_time_and_peak_memory_spans_the_group(traced):
    pl = _pl("lightning.pytorch")
    spike_bytes = 256 * 2**20

    class Spiky(modules("lightning.pytorch")["Regression"]):
        """Allocates a 256 MiB temporary in the first micro-batch of the second group."""

        def training_step(self, batch, batch_idx):
            if batch_idx == 4:
                spike = torch.ones(spike_bytes // 4, device=self.device)
                del spike
            return super().training_step(batch, batch_idx)

    model = Spiky()
    t = pl.Trainer(accelerator="cuda", devices=1, max_epochs=1, accumulate_grad_batches=4,
                   enable_progress_bar=False, logger=False, enable_checkpointing=False,
                   enable_model_summary=False, num_sanity_val_steps=0)
    t.fit(model, loader(10))
    sink = traced.finish()

    assert sink.ids() == [0, 1, 2]
    # auto mode's Tensor.to patch sits inside the integration's transfer region: no double count
    assert sink.counts(H2D) == [4, 4, 2]
    assert sink.counts(FWD) == [4, 4, 2]
    assert sink.counts(OPT) == [1, 1, 1]
    for record in sink.steps:
        # every phase has a GPU time, input wait included: the processor needs all of
        # them to select the GPU clock
        for raw in (FETCH, H2D, FWD, BWD, OPT, STEP):
            assert record.events[raw].gpu_ms is not None, raw
        # every forward and backward runs inside a traced micro-batch region on one stream
        inner = record.events[FWD].gpu_ms + record.events[BWD].gpu_ms
        assert record.events[STEP].gpu_ms >= inner
    peaks = [m.peak_allocated_bytes for m in sink.memory]
    assert [m.device for m in sink.memory] == ["cuda:0"] * 3
    assert all(p is not None for p in peaks)
    # one reset at the group's start, one read at its end: the spike of micro-batch 1 counts
    assert peaks[1] >= spike_bytes
    assert peaks[0] < spike_bytes and peaks[2] < spike_bytes
