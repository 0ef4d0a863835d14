"""Shared fixtures: a clean TraceML process state per test, a recording sink, a fake GPU."""
from __future__ import annotations

import pytest
from harness.sinks import RecordingSink
from tests.instrumentation.instr_fakes import FakeGpuClock

import traceml
from traceml import step_events, timing
from traceml._testing import reset_for_tests


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    monkeypatch.delenv("TRACEML_DISABLE", raising=False)
    monkeypatch.delenv("TRACEML_MODE", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    reset_for_tests()
    yield
    reset_for_tests()
    for sink in traceml.samplers.registered_sinks():
        traceml.unregister_sink(sink)


@pytest.fixture
def sink():
    s = RecordingSink()
    traceml.register_sink(s)
    yield s
    traceml.unregister_sink(s)


@pytest.fixture
def recording():
    """Low-level recording on, without init (no samplers, no patches)."""
    step_events.set_recording(True)
    yield
    step_events.set_recording(False)


@pytest.fixture
def fake_gpu():
    clock = FakeGpuClock()
    timing.configure_gpu_timing(True, timing.CudaEventPool(factory=clock.event))
    yield clock
    timing.configure_gpu_timing(False)
