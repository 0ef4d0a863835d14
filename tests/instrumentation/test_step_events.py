"""StepCapture lifecycle and the bounded queues (contract, "Training-to-sampler handoff")."""
from __future__ import annotations

import pytest

from traceml import step_events as se
from traceml.memory import StepMemoryTracker
from traceml.schema.vocabulary import RAW_DATALOADER_NEXT, RAW_FORWARD, RAW_STEP_TIME
from traceml.timing import timed_region

pytestmark = pytest.mark.usefixtures("recording")


def _event(name=RAW_FORWARD, t0=0, t1=1000):
    return (name, t0, t1, None, None)


def test_complete_assigns_one_step_number_and_publishes_the_batch():
    capture = se.begin_step_capture()
    se.record_timing_event(_event())
    assert se.complete_step_capture(capture) == 0
    batches = se.drain_step_time_batches()
    assert [b.step for b in batches] == [0]
    assert batches[0].events == [_event()]


def test_steps_are_numbered_consecutively_from_zero():
    steps = []
    for _ in range(3):
        with timed_region(RAW_STEP_TIME):
            pass
        steps.append(se.complete_step_capture())
    assert steps == [0, 1, 2]
    assert se.steps_completed() == 3


def test_abort_discards_without_advancing_the_counter():
    se.record_timing_event(_event())
    se.abort_step_capture()
    se.record_timing_event(_event())
    assert se.complete_step_capture() == 0
    assert [b.step for b in se.drain_step_time_batches()] == [0]


def test_repeated_complete_on_a_detached_capture_does_nothing():
    old = se.begin_step_capture()
    se.record_timing_event(_event())
    assert se.complete_step_capture(old) == 0
    later = se.begin_step_capture()
    se.record_timing_event(_event())
    assert se.complete_step_capture(old) is None  # a stale caller cannot finalise a later step
    se.abort_step_capture(old)
    assert se.current_capture() is later and not later.detached
    assert se.complete_step_capture(later) == 1


def test_repeated_abort_on_a_detached_capture_does_nothing():
    old = se.begin_step_capture()
    se.abort_step_capture(old)
    later = se.begin_step_capture()
    se.record_timing_event(_event())
    se.abort_step_capture(old)
    assert not later.detached
    assert se.complete_step_capture() == 0


def test_disabling_recording_before_completion_discards_the_capture():
    capture = se.begin_step_capture()
    se.record_timing_event(_event())
    se.set_recording(False)
    assert capture.detached
    assert se.complete_step_capture(capture) is None
    se.set_recording(True)
    assert se.drain_step_time_batches() == []
    assert se.steps_completed() == 0


def test_nothing_is_recorded_while_recording_is_off():
    se.set_recording(False)
    with timed_region(RAW_FORWARD):
        pass
    assert not se.has_active_capture()
    se.set_recording(True)
    assert se.complete_step_capture() is None  # empty capture: nothing published


def test_input_recorded_before_a_step_opens_is_attributed_to_the_next_step():
    with timed_region(RAW_DATALOADER_NEXT):
        pass
    capture = se.begin_step_capture()
    with timed_region(RAW_STEP_TIME):
        pass
    assert se.complete_step_capture(capture) == 0
    (batch,) = se.drain_step_time_batches()
    assert [e[0] for e in batch.events] == [RAW_DATALOADER_NEXT, RAW_STEP_TIME]


def test_an_empty_capture_publishes_nothing_and_keeps_the_counter():
    assert se.complete_step_capture() is None
    assert se.steps_completed() == 0


def test_memory_snapshot_is_published_with_the_assigned_step_and_none_on_cpu():
    tracker = StepMemoryTracker("cpu")
    tracker.reset()
    with timed_region(RAW_STEP_TIME):
        pass
    tracker.read()
    tracker.read()  # record() replaces: still one snapshot per step
    assert se.complete_step_capture() == 0
    (snap,) = se.drain_step_memory_events()
    assert (snap.step, snap.device, snap.peak_allocated_bytes, snap.peak_reserved_bytes) == (0, "cpu", None, None)


def test_timing_queue_drops_new_batches_when_full_and_counts_them():
    for _ in range(se.QUEUE_CAPACITY + 5):
        se.record_timing_event(_event())
        se.complete_step_capture()
    assert se.dropped_counts()["timing"] == 5
    assert se.dropped_counts()["timing_batches"] == 5
    batches = se.drain_step_time_batches()
    assert len(batches) == se.QUEUE_CAPACITY
    assert batches[-1].step == se.QUEUE_CAPACITY - 1  # the oldest are kept, the new dropped


def test_memory_queue_drops_new_snapshots_when_full_and_counts_them():
    tracker = StepMemoryTracker(None)
    for _ in range(se.QUEUE_CAPACITY + 3):
        tracker.read()
        se.complete_step_capture()
    assert se.dropped_counts()["memory"] == 3
    assert len(se.drain_step_memory_events()) == se.QUEUE_CAPACITY
    assert se.drain_step_memory_events() == []


def test_a_full_capture_refuses_more_events_and_counts_them():
    for _ in range(se.MAX_EVENTS_PER_CAPTURE + 2):
        se.record_timing_event(_event())
    assert len(se.current_capture().events) == se.MAX_EVENTS_PER_CAPTURE
    assert se.dropped_counts()["timing_events"] == 2
    assert se.dropped_counts()["timing"] == 2


def test_queue_drops_after_drain_resume_accepting():
    q = se.BoundedDropQueue(capacity=2)
    assert q.put(1) and q.put(2) and not q.put(3)
    assert q.drain() == [1, 2]
    assert q.put(4) and q.dropped == 1


def test_a_region_hold_keeps_its_names_quiet_across_step_boundaries():
    hold = se.RegionHold([RAW_FORWARD])
    with timed_region(RAW_FORWARD):
        pass
    with timed_region(RAW_STEP_TIME):
        pass
    assert se.complete_step_capture() == 0  # no spanning-region warning for a hold
    with timed_region(RAW_FORWARD):
        pass
    hold.release()
    with timed_region(RAW_FORWARD):
        pass
    se.complete_step_capture()
    first, second = se.drain_step_time_batches()
    assert [e[0] for e in first.events] == [RAW_STEP_TIME]
    assert [e[0] for e in second.events] == [RAW_FORWARD]
    assert "spanning_region" not in se.misuse_counts()
