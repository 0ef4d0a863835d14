"""Timing and memory samplers: FIFO hold-back, per-event summing, no merging, draining."""
from __future__ import annotations

import pytest

from traceml import step_events as se
from traceml.samplers import StepMemorySampler, StepTimeSampler
from traceml.schema.vocabulary import RAW_BACKWARD, RAW_FORWARD, RAW_H2D, RAW_STEP_TIME
from traceml.timing import CudaEventPool, timed_region

from harness.sinks import RecordingSink
from tests.instrumentation.instr_fakes import FakeCudaEvent, FakeGpuClock


def _gpu_event(clock, name, start_ms, end_ms, t0=0, t1=1_000_000):
    return (name, t0, t1, FakeCudaEvent(clock, start_ms), FakeCudaEvent(clock, end_ms))


def _sampler(batches, sink, pool=None):
    queue = list(batches)

    def drain():
        out = list(queue)
        queue.clear()
        return out

    return StepTimeSampler(sinks=(sink,), drain=drain, pool=pool or CudaEventPool(factory=lambda: None))


def test_unresolved_earlier_batch_holds_back_later_ones():
    clock = FakeGpuClock()
    early = se.StepTimeBatch(0, [_gpu_event(clock, RAW_FORWARD, 0.0, 2.0)])
    late = se.StepTimeBatch(1, [_gpu_event(clock, RAW_FORWARD, 5.0, 6.0)])
    late.events[0][3].done = late.events[0][4].done = True  # the later batch is already done
    sink = RecordingSink()
    sampler = _sampler([early, late], sink)
    assert sampler.run_once() == 0
    assert sink.steps == [] and len(sampler.pending) == 2
    early.events[0][3].done = early.events[0][4].done = True
    assert sampler.run_once() == 2
    assert [r.step for r in sink.steps] == [0, 1]
    assert sink.steps[0].events[RAW_FORWARD].gpu_ms == 2.0


def test_resolution_uses_only_query_and_elapsed_time():
    """Fake events have no synchronize(): any call to it would raise AttributeError."""
    clock = FakeGpuClock()
    batch = se.StepTimeBatch(0, [_gpu_event(clock, RAW_FORWARD, 1.0, 4.0)])
    for ev in batch.events[0][3:]:
        ev.done = True
    sink = RecordingSink()
    _sampler([batch], sink).run_once()
    assert sink.steps[0].events[RAW_FORWARD].gpu_ms == 3.0
    assert batch.events[0][4].queries >= 1


def test_repeated_events_are_summed_per_event_with_cpu_and_gpu_separate():
    clock = FakeGpuClock()
    events = [
        _gpu_event(clock, RAW_FORWARD, 0.0, 2.0, t0=0, t1=3_000_000),
        _gpu_event(clock, RAW_FORWARD, 10.0, 11.5, t0=5_000_000, t1=6_000_000),
        _gpu_event(clock, RAW_BACKWARD, 3.0, 7.0, t0=3_000_000, t1=5_000_000),
        (RAW_H2D, 6_000_000, 6_500_000, None, None),
    ]
    for e in events:
        for g in e[3:]:
            if g is not None:
                g.done = True
    sink = RecordingSink()
    _sampler([se.StepTimeBatch(7, events)], sink).run_once()
    (record,) = sink.steps
    fwd, bwd, h2d = record.events[RAW_FORWARD], record.events[RAW_BACKWARD], record.events[RAW_H2D]
    assert (fwd.cpu_ms, fwd.gpu_ms, fwd.count) == (4.0, 3.5, 2)
    assert (bwd.cpu_ms, bwd.gpu_ms, bwd.count) == (2.0, 4.0, 1)
    assert (h2d.cpu_ms, h2d.gpu_ms, h2d.count) == (0.5, None, 1)  # missing GPU time is None, not 0
    assert record.end_time_ns - record.start_time_ns == 6_500_000
    assert [p.raw_event for p in record.phases] == [RAW_FORWARD, RAW_BACKWARD, RAW_FORWARD, RAW_H2D]


def test_only_the_outermost_occurrence_of_a_name_counts():
    clock = FakeGpuClock()
    outer = _gpu_event(clock, RAW_FORWARD, 0.0, 9.0, t0=1_000, t1=9_000)
    inner = _gpu_event(clock, RAW_FORWARD, 1.0, 2.0, t0=2_000, t1=3_000)  # a wrapper inside a patch
    inner2 = _gpu_event(clock, RAW_FORWARD, 4.0, 5.0, t0=4_000, t1=5_000)
    later = (RAW_FORWARD, 10_000, 12_000, None, None)  # after the outer one: counted
    backward = (RAW_BACKWARD, 2_500, 2_600, None, None)  # other names are independent
    for e in (outer, inner, inner2):
        for g in e[3:]:
            g.done = True
    pool = CudaEventPool(factory=lambda: None)
    sink = RecordingSink()
    # Regions are appended as they close: inner ones before their outer one.
    _sampler([se.StepTimeBatch(0, [inner, backward, inner2, outer, later])], sink, pool).run_once()
    (record,) = sink.steps
    fwd = record.events[RAW_FORWARD]
    assert (fwd.cpu_ms, fwd.count, fwd.gpu_ms) == ((8_000 + 2_000) / 1e6, 2, None)  # `later` has no GPU time
    assert record.events[RAW_BACKWARD].count == 1
    offset = record.start_time_ns - 1_000  # the wall-clock offset added to every stamp
    assert [(p.raw_event, p.start_time_ns - offset) for p in record.phases] == [
        (RAW_FORWARD, 1_000), (RAW_BACKWARD, 2_500), (RAW_FORWARD, 10_000)]
    assert pool.free_count() == 6  # the dropped occurrences' CUDA events are returned too


def test_an_occurrence_with_the_same_start_and_a_later_end_is_the_outer_one():
    from traceml.samplers import outermost_events

    inner = (RAW_FORWARD, 100, 200, None, None)
    outer = (RAW_FORWARD, 100, 300, None, None)
    assert outermost_events([inner, outer]) == [outer]
    assert outermost_events([outer, inner]) == [outer]


def test_batches_with_the_same_step_number_are_not_merged():
    sink = RecordingSink()
    a = se.StepTimeBatch(3, [(RAW_STEP_TIME, 0, 1_000_000, None, None)])
    b = se.StepTimeBatch(3, [(RAW_STEP_TIME, 2_000_000, 4_000_000, None, None)])
    _sampler([a, b], sink).run_once()
    assert [(r.step, r.events[RAW_STEP_TIME].cpu_ms, r.events[RAW_STEP_TIME].count)
            for r in sink.steps] == [(3, 1.0, 1), (3, 2.0, 1)]


def test_partially_resolved_gpu_occurrences_make_the_event_gpu_unavailable():
    clock = FakeGpuClock()
    good = _gpu_event(clock, RAW_FORWARD, 0.0, 1.0)
    for g in good[3:]:
        g.done = True
    sink = RecordingSink()
    later = (RAW_FORWARD, 2_000_000, 2_000_010, None, None)  # follows `good` (0 .. 1_000_000 ns)
    _sampler([se.StepTimeBatch(0, [good, later])], sink).run_once()
    assert sink.steps[0].events[RAW_FORWARD].gpu_ms is None
    assert sink.steps[0].events[RAW_FORWARD].count == 2


def test_stop_delivers_never_resolving_batches_with_gpu_unavailable():
    clock = FakeGpuClock()
    stuck = se.StepTimeBatch(0, [_gpu_event(clock, RAW_FORWARD, 0.0, 1.0)])
    sink = RecordingSink()
    sampler = _sampler([stuck], sink)
    sampler.stop(timeout_s=0.05)
    assert [r.step for r in sink.steps] == [0]
    assert sink.steps[0].events[RAW_FORWARD].gpu_ms is None


def test_timed_regions_on_the_fake_gpu_resolve_through_the_real_sampler(recording, fake_gpu, sink):
    with timed_region(RAW_FORWARD):
        fake_gpu.now_ms = 2.5
    with timed_region(RAW_FORWARD):
        fake_gpu.now_ms = 4.0
    se.complete_step_capture()
    sampler = StepTimeSampler()
    assert sampler.run_once() == 0  # nothing completed on the "device" yet
    fake_gpu.complete_all()
    assert sampler.run_once() == 1
    assert sink.steps[0].events[RAW_FORWARD].gpu_ms == 4.0
    assert sink.steps[0].events[RAW_FORWARD].count == 2
    from traceml import timing
    assert timing.event_pool().free_count() == 4  # events went back to the pool


def test_samplers_keep_draining_after_recording_stops(recording, sink):
    from traceml.memory import StepMemoryTracker
    with timed_region(RAW_STEP_TIME):
        pass
    StepMemoryTracker("cpu").read()
    se.complete_step_capture()
    se.set_recording(False)
    assert StepTimeSampler().run_once() == 1
    assert StepMemorySampler().run_once() == 1
    assert [r.step for r in sink.steps] == [0] and [m.step for m in sink.memory] == [0]


def test_a_failing_sink_does_not_stop_delivery_to_others(recording):
    class Broken:
        def on_step_time(self, record):
            raise RuntimeError("boom")

        def on_step_memory(self, record):
            raise RuntimeError("boom")

    good = RecordingSink()
    with timed_region(RAW_STEP_TIME):
        pass
    se.complete_step_capture()
    StepTimeSampler(sinks=(Broken(), good)).run_once()
    assert [r.step for r in good.steps] == [0]


def test_a_sink_failing_on_one_record_still_gets_the_next_and_a_sink_without_the_method_is_skipped(recording):
    class FailsOnFirst:
        def __init__(self):
            self.steps = []

        def on_step_time(self, record):
            if record.step == 0:
                raise RuntimeError("boom")
            self.steps.append(record.step)

    class MemoryOnly:
        def on_step_memory(self, record):
            pass

    flaky, good = FailsOnFirst(), RecordingSink()
    for _ in range(3):
        with timed_region(RAW_STEP_TIME):
            pass
        se.complete_step_capture()
    assert StepTimeSampler(sinks=(MemoryOnly(), flaky, good)).run_once() == 3
    assert flaky.steps == [1, 2] and [r.step for r in good.steps] == [0, 1, 2]


def test_sampler_threads_are_daemons_and_deliver_in_the_background(recording, sink):
    sampler = StepTimeSampler(interval_s=0.01)
    sampler.start()
    try:
        assert sampler._thread.daemon
        with timed_region(RAW_STEP_TIME):
            pass
        se.complete_step_capture()
        import time
        deadline = time.monotonic() + 10
        while not sink.steps and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sampler.stop()
    assert [r.step for r in sink.steps] == [0]


def test_input_wait_gets_gpu_events_on_the_gpu_path(recording, fake_gpu, sink):
    import torch
    import traceml
    from traceml.schema.vocabulary import RAW_DATALOADER_NEXT

    loader = traceml.wrap_dataloader(torch.utils.data.DataLoader(torch.arange(4.0), batch_size=2))
    for _ in loader:
        fake_gpu.now_ms += 1.5  # the stream sits idle while the host waits
    se.complete_step_capture()
    fake_gpu.complete_all()
    StepTimeSampler().run_once()
    totals = sink.steps[0].events[RAW_DATALOADER_NEXT]
    assert totals.count == 2 and totals.gpu_ms is not None


def test_before_the_first_step_regions_use_cuda_events_only_once_cuda_is_in_use(recording, monkeypatch):
    from traceml import timing

    clock = FakeGpuClock()
    timing.prepare_gpu_timing()
    timing.event_pool()._factory = clock.event
    ready = {"value": False}
    monkeypatch.setattr(timing, "cuda_in_use", lambda: ready["value"])
    with timed_region(RAW_H2D):
        pass  # the job has not touched CUDA: no events, no CUDA context from TraceML
    ready["value"] = True
    with timed_region(RAW_H2D):
        pass
    events = se.current_capture().events
    assert [e[3] is not None for e in events] == [False, True]
    assert len(clock.created) == 2
    timing.configure_gpu_timing(False)  # the first step decided: CPU
    with timed_region(RAW_H2D):
        pass
    assert se.current_capture().events[-1][3] is None


def test_a_failing_cuda_event_never_breaks_the_step(recording, sink):
    from traceml import timing

    class BrokenEvent:
        def record(self):
            raise RuntimeError("Event device does not match stream device")

    timing.configure_gpu_timing(True, timing.CudaEventPool(factory=BrokenEvent))
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with timed_region(RAW_FORWARD):
            pass
    se.complete_step_capture()
    StepTimeSampler().run_once()
    totals = sink.steps[0].events[RAW_FORWARD]
    assert totals.count == 1 and totals.gpu_ms is None and totals.cpu_ms >= 0
    assert any("CUDA timing event failed" in str(w.message) for w in seen)


def test_a_queue_filling_to_a_quarter_wakes_a_sleeping_sampler(recording, sink):
    """Samplers poll rarely; on fast steps the fill mark, not the interval, bounds the queue."""
    import time

    sampler = StepTimeSampler(interval_s=3600.0)  # would never poll within the test
    memory_sampler = StepMemorySampler(interval_s=3600.0)
    sampler.start()
    memory_sampler.start()
    try:
        wake_at = se.QUEUE_CAPACITY // 4
        for _ in range(wake_at):
            with timed_region(RAW_STEP_TIME):
                pass
            se.current_capture().record(se.MemoryReading("cpu", None, None, 0))
            se.complete_step_capture()
        deadline = time.monotonic() + 30
        while (len(sink.steps) < wake_at or len(sink.memory) < wake_at) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(sink.steps) == wake_at and len(sink.memory) == wake_at
        assert se.dropped_counts()["timing"] == 0
    finally:
        sampler.stop()
        memory_sampler.stop()
    assert se.queue_wakeup("timing") is None and se.queue_wakeup("memory") is None


def _until(predicate, timeout_s: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    return predicate()


def test_a_parked_sampler_is_woken_by_the_next_step_not_by_a_clock(recording, sink):
    """Work wakes the samplers: with nothing queued they park (no timed wake-up at all), and the
    first step published wakes them at once, long before their interval; then they park again."""
    from traceml import samplers

    resumed = []

    def listener():
        resumed.append(1)
    samplers.on_steps_resumed(listener)
    sampler = StepTimeSampler(interval_s=0.05)
    memory_sampler = StepMemorySampler(interval_s=0.05)
    calls = {"time": 0, "memory": 0}
    for key, s in (("time", sampler), ("memory", memory_sampler)):
        def counted(run=s.run_once, key=key):
            calls[key] += 1
            return run()
        s.run_once = counted
        s.start()
    try:
        assert _until(lambda: sampler.parked and memory_sampler.parked)
        before = dict(calls)
        import time
        time.sleep(0.3)  # six intervals: a clock-driven sampler would have drained six times
        assert calls == before and sampler.parked and memory_sampler.parked
        assert se.queue_wakeup("timing") is not None
        sampler.interval_s = memory_sampler.interval_s = 3600.0  # from here only work can wake them
        with timed_region(RAW_STEP_TIME):
            pass
        se.current_capture().record(se.MemoryReading("cpu", None, None, 0))
        se.complete_step_capture()
        assert _until(lambda: len(sink.steps) == 1 and len(sink.memory) == 1, 5.0)
        assert resumed == [1]
    finally:
        samplers.on_steps_resumed(listener, add=False)
        sampler.stop()
        memory_sampler.stop()
    assert se.queue_wakeup("timing") is None and se._timing_queue.wake_at == se.QUEUE_CAPACITY // 4


def test_a_sampler_holding_unresolved_cuda_batches_keeps_polling(recording, fake_gpu, sink):
    """Only query() tells when a CUDA batch completes: the timing sampler does not park on one."""
    sampler = StepTimeSampler(interval_s=0.02)
    sampler.start()
    try:
        with timed_region(RAW_FORWARD):
            pass
        se.complete_step_capture()
        assert _until(lambda: len(sampler.pending) == 1)
        assert not sampler.parked
        fake_gpu.complete_all()  # no step published: only its own polling can deliver it
        assert _until(lambda: len(sink.steps) == 1, 5.0)
        assert _until(lambda: sampler.parked)
    finally:
        sampler.stop()


def test_a_sampler_with_its_own_drain_leaves_the_queue_wakeup_alone(recording):
    sampler = StepTimeSampler(drain=lambda: [])
    sampler.start()
    try:
        assert se.queue_wakeup("timing") is None
    finally:
        sampler.stop()


def test_hook_timed_forward_and_optimizer_get_gpu_times_on_the_gpu_path(recording, fake_gpu, sink):
    """The hooks' inline CPU fast path hands GPU regions to the general path (event pairs)."""
    import torch
    import traceml
    from traceml.schema.vocabulary import RAW_OPTIMIZER_STEP

    model = traceml.wrap_forward(torch.nn.Linear(2, 1))
    opt = traceml.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(1, 2)).sum().backward()
    fake_gpu.now_ms += 2.0
    opt.step()
    se.complete_step_capture()
    fake_gpu.complete_all()
    StepTimeSampler().run_once()
    events = sink.steps[0].events
    assert events[RAW_FORWARD].count == 1 and events[RAW_FORWARD].gpu_ms is not None
    assert events[RAW_OPTIMIZER_STEP].count == 1 and events[RAW_OPTIMIZER_STEP].gpu_ms is not None


def test_hook_timed_forward_on_the_cpu_path_records_cpu_time_only(recording, sink):
    import torch
    import traceml

    model = traceml.wrap_forward(torch.nn.Linear(2, 1))
    model(torch.ones(1, 2))
    model(torch.ones(1, 2))
    se.complete_step_capture()
    StepTimeSampler().run_once()
    totals = sink.steps[0].events[RAW_FORWARD]
    assert totals.count == 2 and totals.cpu_ms > 0 and totals.gpu_ms is None
    assert RAW_FORWARD not in se.held
