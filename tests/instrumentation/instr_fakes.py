"""Test helpers for the instrumentation tests: a sampler flush and fake CUDA events.

The recording sink is shared with the other suites: `harness.sinks.RecordingSink`.

Only the GPU is faked: `FakeCudaEvent` has the two methods the timing sampler may
call on a real `torch.cuda.Event` (`query()`, `elapsed_time()`) plus `record()`.
"""
from __future__ import annotations


def flush_samplers() -> None:
    """Deliver everything queued now (the background samplers may already have some: a step
    published wakes a parked sampler). Through the live samplers when `init()` started them,
    so a drain here and one on their thread take turns under one lock and keep step order."""
    from traceml import lifecycle
    from traceml.samplers import StepMemorySampler, StepTimeSampler

    (lifecycle._time_sampler or StepTimeSampler()).run_once()
    (lifecycle._memory_sampler or StepMemorySampler()).run_once()


class FakeGpuClock:
    """The fake device: events record the clock's current time (ms) and complete on demand."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.created = []

    def event(self) -> "FakeCudaEvent":
        event = FakeCudaEvent(self)
        self.created.append(event)
        return event

    def complete_all(self) -> None:
        for event in self.created:
            event.done = True


class FakeCudaEvent:
    def __init__(self, clock: FakeGpuClock, at_ms: float | None = None, done: bool = False) -> None:
        self.clock = clock
        self.at_ms = at_ms
        self.done = done
        self.queries = 0

    def record(self) -> None:
        self.at_ms = self.clock.now_ms
        self.done = False

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def elapsed_time(self, end: "FakeCudaEvent") -> float:
        if not (self.done and end.done):
            raise RuntimeError("elapsed_time on an incomplete event (a real CUDA event raises too)")
        return end.at_ms - self.at_ms
