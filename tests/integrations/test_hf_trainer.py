"""Hugging Face Trainer integration: real Trainers on CPU, tiny in-code models, offline.

Every claim is checked on what the samplers publish to a sink: one record per
completed TraceML step with per-raw-event counts, and one memory snapshot per step.

Event counts per step, for ten single-sample microbatches and accumulation 4:
forward, backward: 4, 4, 2 (one per microbatch); optimizer: 1 per update.
Fetches are 5, 4, 1: Accelerate's loader reads one batch ahead, so the first
`next()` of the run waits for two batches and the last one for none (its read
ends the epoch and is not an input wait). Every batch is fetched exactly once.
On CPU no batch is transferred, so there is no H2D and no transfer segment: the
traced step time is the callback region alone (count 1).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest

# Each test runs a real Trainer (about 0.5-1.2 s) and the module imports transformers' Trainer
# (seconds): the fast loop leaves the whole module out, unimported (tests/conftest.py).
pytestmark = pytest.mark.slow

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from transformers import Trainer  # noqa: E402

import traceml  # noqa: E402
from traceml._testing import reset_for_tests  # noqa: E402
from traceml import step_events  # noqa: E402
from traceml.integrations import huggingface as hf  # noqa: E402
from traceml.integrations.huggingface import guard, installation  # noqa: E402
from traceml.integrations.patching import is_wrapper  # noqa: E402
from traceml.schema.vocabulary import RAW_H2D, RAW_STEP_TIME  # noqa: E402

from harness.child_python import child_env  # noqa: E402
from harness.sinks import RecordingSink  # noqa: E402
from tests.integrations import hf_helpers as h  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Traced:
    """One traced session: fresh TraceML state, HF integration installed, a sink attached."""

    def __init__(self) -> None:
        reset_for_tests()
        self.sink = RecordingSink()
        traceml.register_sink(self.sink)
        assert hf.init() is True

    def finish(self):
        """Shut TraceML down (samplers drain into the sink); return (steps, memory) by step."""
        traceml.shutdown()
        traceml.unregister_sink(self.sink)
        return (sorted(self.sink.steps, key=lambda r: r.step),
                sorted(self.sink.memory, key=lambda r: r.step))


@pytest.fixture
def traced(monkeypatch):
    monkeypatch.delenv("TRACEML_DISABLE", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    session = Traced()
    yield session
    reset_for_tests()
    traceml.unregister_sink(session.sink)


def _our_callbacks(trainer):
    kind = hf.TraceMLTrainerCallback
    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, kind)]


def _assert_fresh_ten(steps, memory, log):
    assert [r.step for r in steps] == [0, 1, 2]
    assert h.per_step(steps, "forward") == [4, 4, 2]
    assert h.per_step(steps, "backward") == [4, 4, 2]
    assert h.per_step(steps, "optimizer") == [1, 1, 1]
    assert h.per_step(steps, "fetch") == [5, 4, 1]
    assert h.per_step(steps, "step") == [1, 1, 1]
    assert all(RAW_H2D not in r.events for r in steps)
    assert [m.step for m in memory] == [0, 1, 2]
    assert all(m.device == "cpu" and m.peak_allocated_bytes is None for m in memory)
    assert log.global_steps == [1, 2, 3]


# --- accumulation groups ---------------------------------------------------------------


def test_ten_microbatches_with_accumulation_four_make_steps_of_four_four_two(traced, tmp_path):
    trainer, log, model = h.make_trainer(str(tmp_path), train_dataset=h.MapDataset(10))
    trainer.train()
    steps, memory = traced.finish()
    _assert_fresh_ten(steps, memory, log)
    assert log.substeps == 7  # HF's accumulation microbatches did not advance TraceML
    assert model.train_calls == 10
    # The guard added its own callback for the attempt and removed it afterwards.
    assert _our_callbacks(trainer) == []


def test_each_event_lies_inside_its_step(traced, tmp_path):
    trainer, _, _ = h.make_trainer(str(tmp_path), train_dataset=h.MapDataset(10))
    trainer.train()
    steps, _ = traced.finish()
    for earlier, later in zip(steps, steps[1:]):
        assert earlier.end_time_ns <= later.start_time_ns
    for record in steps:
        traced_region = [p for p in record.phases if p.raw_event == RAW_STEP_TIME]
        compute = [p for p in record.phases if h.SHORT[p.raw_event] in ("forward", "backward", "optimizer")]
        assert len(traced_region) == 1
        assert all(traced_region[0].start_time_ns <= p.start_time_ns <= p.end_time_ns
                   <= traced_region[0].end_time_ns for p in compute)
        fetches = [p for p in record.phases if h.SHORT[p.raw_event] == "fetch"]
        assert all(p.end_time_ns <= traced_region[0].start_time_ns for p in fetches)


# --- resume -----------------------------------------------------------------------------


def _checkpoint(tmp_path_factory, name, dataset):
    """Two optimizer updates of accumulation 2, saved: global step 2 = four microbatches."""
    out = str(tmp_path_factory.mktemp(name))
    trainer, _, _ = h.make_trainer(out, train_dataset=dataset, gradient_accumulation_steps=2,
                                   max_steps=2, save_strategy="steps", save_steps=2)
    trainer.train()
    path = os.path.join(out, "checkpoint-2")
    assert os.path.isdir(path)
    return out, path


@pytest.fixture(scope="module")
def map_checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "map", h.MapDataset(10))


@pytest.fixture(scope="module")
def stream_checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "stream", h.StreamDataset(10))


def test_map_style_resume_measures_the_first_resumed_group(traced, map_checkpoint):
    out, path = map_checkpoint
    trainer, log, model = h.make_trainer(out, train_dataset=h.MapDataset(10),
                                         gradient_accumulation_steps=2, max_steps=5)
    trainer.train(resume_from_checkpoint=path)
    steps, memory = traced.finish()
    assert log.global_steps == [3, 4, 5]
    # The sampler skipped four samples before any fetch: three groups, all measured.
    assert [r.step for r in steps] == [0, 1, 2]
    assert h.per_step(steps, "forward") == [2, 2, 2]
    assert h.per_step(steps, "backward") == [2, 2, 2]
    assert h.per_step(steps, "optimizer") == [1, 1, 1]
    assert h.totals(steps)["fetch"] == 6
    assert len(memory) == 3


def test_iterable_resume_omits_the_whole_first_resumed_group(traced, stream_checkpoint):
    out, path = stream_checkpoint
    trainer, log, model = h.make_trainer(out, train_dataset=h.StreamDataset(10),
                                         gradient_accumulation_steps=2, max_steps=5)
    trainer.train(resume_from_checkpoint=path)
    steps, memory = traced.finish()
    # HF still ran all three updates and their six microbatches ...
    assert log.global_steps == [3, 4, 5]
    assert model.train_calls == 6
    # ... but the group that absorbed Accelerate's lazy skip is absent from timing and
    # memory, and TraceML's counter did not advance for it.
    assert [r.step for r in steps] == [0, 1]
    assert h.per_step(steps, "forward") == [2, 2]
    assert h.per_step(steps, "backward") == [2, 2]
    assert h.per_step(steps, "optimizer") == [1, 1]
    assert h.per_step(steps, "fetch") == [2, 1]
    assert [m.step for m in memory] == [0, 1]


def test_iterable_resume_with_ignore_data_skip_is_measured_normally(traced, stream_checkpoint):
    out, path = stream_checkpoint
    trainer, log, _ = h.make_trainer(out, train_dataset=h.StreamDataset(10),
                                     gradient_accumulation_steps=2, max_steps=5,
                                     ignore_data_skip=True)
    trainer.train(resume_from_checkpoint=path)
    steps, memory = traced.finish()
    assert log.global_steps == [3, 4, 5]
    assert [r.step for r in steps] == [0, 1, 2]
    assert h.per_step(steps, "forward") == [2, 2, 2]
    assert h.per_step(steps, "fetch") == [3, 2, 2]
    assert len(memory) == 3


def test_fresh_iterable_run_is_measured_normally(traced, tmp_path):
    trainer, log, _ = h.make_trainer(str(tmp_path), train_dataset=h.StreamDataset(10),
                                     gradient_accumulation_steps=2, max_steps=3)
    trainer.train()
    steps, _ = traced.finish()
    assert log.global_steps == [1, 2, 3]
    assert h.per_step(steps, "forward") == [2, 2, 2]
    assert h.per_step(steps, "fetch") == [3, 2, 2]


# --- skipped optimizer update -----------------------------------------------------------


def _overflow_run(tmp_path, optim):
    # Accelerate creates no GradScaler on CPU; torch's real CPU GradScaler is attached
    # instead, and sample 1 carries inf inputs, so its gradients overflow for real.
    trainer, log, model = h.make_trainer(str(tmp_path), train_dataset=h.MapDataset(4, poisoned=(1,)),
                                         gradient_accumulation_steps=1, max_grad_norm=0.0,
                                         optim=optim)
    scaler = trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    trainer.train()
    assert scaler.get_scale() == 2.0 ** 7  # exactly one overflow backed the scale off
    return log


def test_amp_overflow_skips_the_optimizer_event_but_completes_the_step(traced, tmp_path):
    log = _overflow_run(tmp_path, "adamw_torch")
    steps, memory = traced.finish()
    poisoned = log.skipped.index(True)
    assert log.skipped.count(True) == 1
    assert log.global_steps == [1, 2, 3, 4]
    assert [r.step for r in steps] == [0, 1, 2, 3]
    expected = [1, 1, 1, 1]
    expected[poisoned] = 0
    assert h.per_step(steps, "optimizer") == expected
    assert h.per_step(steps, "forward") == [1, 1, 1, 1]
    assert h.per_step(steps, "backward") == [1, 1, 1, 1]
    assert len(memory) == 4


def test_fused_optimizer_overflow_still_times_its_call(traced, tmp_path):
    # A fused optimizer takes the scaler's found-inf flag and skips the update inside
    # its own call: the call ran, so it is timed; HF sees no skipped step.
    log = _overflow_run(tmp_path, "adamw_torch_fused")
    steps, _ = traced.finish()
    assert log.skipped == [False] * 4
    assert h.per_step(steps, "optimizer") == [1, 1, 1, 1]


# --- custom collection -----------------------------------------------------------------


@pytest.mark.slow  # among the fast loop's slowest (see the marker in pyproject.toml)
def test_custom_get_batch_samples_warns_once_and_records_no_input(traced, tmp_path):
    class CollectingTrainer(Trainer):
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            return super().get_batch_samples(epoch_iterator, num_batches, device)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for run in range(2):
            trainer, _, _ = h.make_trainer(str(tmp_path / str(run)), train_dataset=h.MapDataset(10),
                                           trainer_class=CollectingTrainer)
            trainer.train()
    steps, _ = traced.finish()
    ours = [w for w in caught if issubclass(w.category, hf.CustomCollectionWarning)]
    assert len(ours) == 1
    assert "CollectingTrainer" in str(ours[0].message)
    assert h.per_step(steps, "forward") == [4, 4, 2, 4, 4, 2]
    assert h.totals(steps)["fetch"] == 0
    assert h.totals(steps)["h2d"] == 0
    assert h.per_step(steps, "step") == [1] * 6


# --- failures ---------------------------------------------------------------------------


@pytest.mark.slow  # among the fast loop's slowest (see the marker in pyproject.toml)
def test_exception_mid_group_publishes_nothing_partial_and_propagates(traced, tmp_path):
    error = ValueError("boom in microbatch six")

    def fail_on_sixth(model, x):
        if model.train_calls == 6:
            raise error

    trainer, log, _ = h.make_trainer(str(tmp_path / "a"), train_dataset=h.MapDataset(10),
                                     model=h.TinyRegressor(failure=fail_on_sixth))
    with pytest.raises(ValueError) as raised:
        trainer.train()
    assert raised.value is error
    assert _our_callbacks(trainer) == []  # ownership released by the guard
    assert not step_events.has_active_capture()

    # A later run continues the counter where the last completed group left it.
    trainer2, _, _ = h.make_trainer(str(tmp_path / "b"), train_dataset=h.MapDataset(10),
                                    gradient_accumulation_steps=5)
    trainer2.train()
    steps, memory = traced.finish()
    assert log.global_steps == [1]
    assert [r.step for r in steps] == [0, 1, 2]
    assert h.per_step(steps, "forward") == [4, 5, 5]
    assert h.per_step(steps, "backward") == [4, 5, 5]
    assert [m.step for m in memory] == [0, 1, 2]


@pytest.mark.slow
def test_out_of_memory_retry_does_not_merge_the_failed_group(traced, tmp_path):
    # Accelerate retries `_inner_training_loop` with a smaller batch on this CPU OOM message.
    def oom_in_second_group(model, x):
        if x.shape[0] == 2 and model.train_calls == 3:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes.")

    trainer, log, model = h.make_trainer(str(tmp_path), train_dataset=h.MapDataset(8),
                                         model=h.TinyRegressor(failure=oom_in_second_group),
                                         per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                         auto_find_batch_size=True)
    trainer.train()
    steps, memory = traced.finish()
    assert model.batch_sizes[:3] == [2, 2, 2] and set(model.batch_sizes[3:]) == {1}
    # First attempt: one complete group; retry: four groups of two single-sample batches.
    assert [r.step for r in steps] == [0, 1, 2, 3, 4]
    assert h.per_step(steps, "forward") == [2, 2, 2, 2, 2]
    assert h.per_step(steps, "backward") == [2, 2, 2, 2, 2]
    assert h.per_step(steps, "optimizer") == [1, 1, 1, 1, 1]
    assert len(memory) == 5
    assert _our_callbacks(trainer) == []


def test_group_stopped_mid_accumulation_is_dropped_and_the_next_is_clean(traced, tmp_path):
    from transformers import TrainerCallback

    class StopFirstEpochEarly(TrainerCallback):
        fired = False

        def on_substep_end(self, args, state, control, **kwargs):
            if not self.fired:
                self.fired = True
                control.should_epoch_stop = True

    trainer, log, model = h.make_trainer(str(tmp_path), train_dataset=h.MapDataset(10),
                                         num_train_epochs=2, callbacks=[StopFirstEpochEarly()])
    trainer.train()
    steps, memory = traced.finish()
    # Epoch one stopped after the first microbatch of its first group: nothing published.
    # Epoch two is the usual 4/4/2, with its own input only.
    assert model.train_calls == 11
    assert log.global_steps == [1, 2, 3]
    assert [r.step for r in steps] == [0, 1, 2]
    assert h.per_step(steps, "forward") == [4, 4, 2]
    assert h.per_step(steps, "fetch") == [5, 4, 1]
    assert len(memory) == 3


# --- evaluation and prediction -------------------------------------------------------


def test_evaluate_and_predict_outside_training_never_reach_a_training_step(traced, tmp_path):
    trainer, log, model = h.make_trainer(str(tmp_path), train_dataset=h.MapDataset(10),
                                         eval_dataset=h.MapDataset(6))
    trainer.evaluate()
    trainer.predict(h.MapDataset(4))
    assert model.eval_calls == 5
    # Nothing is left pending for whatever step the process traces next.
    assert not step_events.has_active_capture()
    trainer.train()
    trainer.evaluate()
    assert not step_events.has_active_capture()
    steps, memory = traced.finish()
    _assert_fresh_ten(steps, memory, log)


def test_evaluation_during_training_stays_out_of_the_steps(traced, tmp_path):
    trainer, log, model = h.make_trainer(str(tmp_path), train_dataset=h.MapDataset(10),
                                         eval_dataset=h.MapDataset(6), eval_strategy="steps",
                                         eval_steps=1, eval_on_start=True)
    trainer.train()
    steps, memory = traced.finish()
    assert model.eval_calls == 3 * 4  # on start + after each of the three updates
    _assert_fresh_ten(steps, memory, log)


# --- installation ---------------------------------------------------------------------


def test_two_installs_and_a_hand_added_callback_count_each_group_once(traced, tmp_path):
    assert hf.init() is True
    assert hf.init() is True
    wrapped = Trainer.get_batch_samples
    assert is_wrapper(wrapped)
    assert not is_wrapper(wrapped.__wrapped__)
    by_hand = hf.TraceMLTrainerCallback()
    trainer, log, _ = h.make_trainer(str(tmp_path), train_dataset=h.MapDataset(10),
                                     callbacks=[by_hand, hf.TraceMLTrainerCallback()])
    trainer.train()
    steps, memory = traced.finish()
    _assert_fresh_ten(steps, memory, log)
    # The user's callbacks stay; the guard added none of its own.
    assert _our_callbacks(trainer)[0] is by_hand and len(_our_callbacks(trainer)) == 2


def test_without_the_guard_a_hand_added_callback_still_brackets_each_group(traced, tmp_path):
    class OwnLoopTrainer(Trainer):
        # A subclass whose loop does not go through the guarded parent method.
        _inner_training_loop = Trainer._inner_training_loop.__wrapped__

    callback = hf.TraceMLTrainerCallback()
    trainer, log, _ = h.make_trainer(str(tmp_path), train_dataset=h.MapDataset(10),
                                     trainer_class=OwnLoopTrainer, callbacks=[callback])
    trainer.train()
    steps, _ = traced.finish()
    assert log.global_steps == [1, 2, 3]
    assert h.per_step(steps, "forward") == [4, 4, 2]
    assert h.per_step(steps, "step") == [1, 1, 1]
    assert callback.step_cm is None


def test_disabled_traceml_records_nothing(monkeypatch, tmp_path):
    reset_for_tests()
    monkeypatch.setenv("TRACEML_DISABLE", "1")
    assert hf.init() is False
    trainer, log, _ = h.make_trainer(str(tmp_path), train_dataset=h.MapDataset(10))
    trainer.train()
    assert log.global_steps == [1, 2, 3]
    assert step_events.steps_completed() == 0


# --- transfers -----------------------------------------------------------------------


def test_each_observed_transfer_records_h2d_and_a_matching_traced_segment(traced, tmp_path):
    # CPU runs transfer nothing. Accelerate's own loader placing batches on the
    # non-host `meta` device exercises the placement call the Trainer's loader makes.
    from accelerate.data_loader import DataLoaderShard

    trainer, _, _ = h.make_trainer(str(tmp_path), train_dataset=h.MapDataset(3))
    loader = DataLoaderShard(h.MapDataset(3), device=torch.device("meta"), batch_size=1)
    attempt = guard.begin_attempt(trainer)
    try:
        batches, _ = trainer.get_batch_samples(iter(loader), 3, torch.device("meta"))
        events = list(step_events.current_capture().events)
    finally:
        guard.end_attempt(attempt, None)
    assert [b["x"].device.type for b in batches] == ["meta"] * 3
    h2d = [e for e in events if e[0] == RAW_H2D]
    segments = [e for e in events if e[0] == RAW_STEP_TIME]
    fetches = [e for e in events if h.SHORT[e[0]] == "fetch"]
    assert len(h2d) == len(segments) == 3
    assert len(fetches) == 3
    for transfer, segment in zip(h2d, segments):
        assert segment[1] <= transfer[1] <= transfer[2] <= segment[2]
    # Fetch work stays outside the transfer segments: it is Input Wait.
    for fetch in fetches:
        assert all(fetch[2] <= seg[1] or fetch[1] >= seg[2] for seg in segments)
    # Outside the collection window the same loader is not timed at all.
    assert not step_events.has_active_capture()
    list(loader)
    assert not step_events.has_active_capture() or not [
        e for e in step_events.current_capture().events if e[0] in (RAW_H2D, RAW_STEP_TIME)]


# --- automatic attach ------------------------------------------------------------------

_LAUNCHED_SCRIPT = textwrap.dedent("""
    import json, sys
    assert "transformers" not in sys.modules, "auto_attach imported transformers"
    import traceml
    from tests.integrations import hf_helpers as h
    from transformers import Trainer
    from traceml.integrations import huggingface as hf
    from harness.sinks import RecordingSink
    assert hf.is_installed()
    sink = RecordingSink()
    traceml.register_sink(sink)
    trainer, log, _ = h.make_trainer({out!r}, train_dataset=h.MapDataset(10))
    trainer.train()
    traceml.shutdown()
    steps = sorted(sink.steps, key=lambda r: r.step)
    print("RESULT", json.dumps([h.event_counts(r) for r in steps]))
""")


@pytest.mark.slow
def test_traceml_run_attaches_without_importing_transformers_early(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_LAUNCHED_SCRIPT.format(out=str(tmp_path / "out")))
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRACEML_DISABLE", "OTEL_EXPORTER_OTLP_ENDPOINT")}
    done = subprocess.run([sys.executable, "-m", "traceml.launcher.bootstrap", str(script)],
                          capture_output=True, text=True, timeout=240, env=child_env(env), cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    import json

    counts = json.loads(line[len("RESULT "):])
    assert [c["forward"] for c in counts] == [4, 4, 2]
    assert [c["fetch"] for c in counts] == [5, 4, 1]


def test_version_gate_reads_release_and_pre_release_versions():
    from traceml.schema.version_floors import release

    assert release("4.46.1") >= hf.MIN_TRANSFORMERS
    assert release("5.24.0") >= hf.MIN_TRANSFORMERS
    assert release("4.46.0") < hf.MIN_TRANSFORMERS
    assert release("4.47.0rc1") == (4, 47, 0)
    assert release("4.46.1.dev0") == (4, 46, 1)


# --- CUDA (runs only where a GPU exists; CPU runs transfer nothing) ----------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_transfers_record_h2d_and_segments_on_the_gpu_clock(traced, tmp_path):
    trainer, log, _ = h.make_trainer(str(tmp_path), train_dataset=h.MapDataset(10),
                                     eval_dataset=h.MapDataset(6), eval_strategy="steps",
                                     eval_steps=1, use_cpu=False)
    trainer.train()
    steps, memory = traced.finish()
    assert log.global_steps == [1, 2, 3]
    assert h.per_step(steps, "forward") == [4, 4, 2]
    # One placement per microbatch; evaluation's copies never reach a step.
    assert h.per_step(steps, "h2d") == [4, 4, 2]
    # The callback region plus one traced segment per transfer.
    assert h.per_step(steps, "step") == [5, 5, 3]
    assert h.per_step(steps, "fetch") == [5, 4, 1]
    for record in steps:
        for name in (RAW_H2D, RAW_STEP_TIME):
            assert record.events[name].gpu_ms is not None, (record.step, name)
        segments = [p for p in record.phases if p.raw_event == RAW_STEP_TIME]
        for transfer in (p for p in record.phases if p.raw_event == RAW_H2D):
            assert any(s.start_time_ns <= transfer.start_time_ns and transfer.end_time_ns <= s.end_time_ns
                       for s in segments)
    assert [m.device for m in memory] == ["cuda:0"] * 3
    assert all(m.peak_allocated_bytes and m.peak_allocated_bytes > 0 for m in memory)
