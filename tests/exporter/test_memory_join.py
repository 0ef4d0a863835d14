"""The exporter joins a step's memory snapshot to its step span by step number.

A step waits for its snapshot while snapshots carry measured peaks; these tests hold
what that wait may and may not do. `MEMORY_JOIN_WAIT_S` is raised to an hour, so a step
that waits when it should not never leaves before the flush at shutdown, and a fake
transport records what leaves and when (the wire is held by test_roundtrip).
"""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from harness.exporter_records import identity, memory_record, step_record
from harness.waiting import wait_until
from traceml.exporter import OtlpStepExporter, resolve_settings, step_exporter
from traceml.exporter.transport import ExportOutcome
from traceml.schema import vocabulary as v


class _Transport:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.trace_requests = 0

    def export(self, signal, request, deadline):
        if signal == v.SIGNAL_TRACES:
            with self.lock:
                self.trace_requests += 1
        return ExportOutcome(True)

    def close(self) -> None:
        pass


@pytest.fixture
def exporter(monkeypatch):
    monkeypatch.setattr(step_exporter, "MEMORY_JOIN_WAIT_S", 3600.0)
    settings = replace(resolve_settings("http://127.0.0.1:4317", "grpc", environ={}), export_interval_s=0.02)
    exp = OtlpStepExporter(identity("memory-join"), settings, instrumentation_drops=lambda: {},
                           transport=_Transport())
    yield exp
    exp.shutdown(5.0)


def test_steps_whose_snapshots_will_not_come_leave_once_a_later_snapshot_has_arrived(exporter):
    # Step 0 measured (steps now wait for their snapshots); steps 1-3 lost theirs in the
    # instrumentation; step 4's arrives. Snapshots arrive in step order, so 1-3 can leave at once:
    # before, each waited MEMORY_JOIN_WAIT_S in turn (2 s a step by default: a run of them
    # filled the queue and steps were dropped).
    exporter.on_step_memory(memory_record(0))
    for step in range(4):
        exporter.on_step_time(step_record(step))
    exporter.on_step_memory(memory_record(4))
    exporter.on_step_time(step_record(4))
    assert wait_until(lambda: exporter.stats().steps_exported == 5, 10.0), exporter.stats()
    stats = exporter.stats()
    assert stats.memory_exported == 2
    assert stats.dropped["metrics"] == 0 and stats.dropped["spans"] == 0


def test_a_step_still_waits_for_its_own_snapshot_when_none_later_has_arrived(exporter):
    exporter.on_step_memory(memory_record(0))
    exporter.on_step_time(step_record(0))
    assert wait_until(lambda: exporter.stats().steps_exported == 1, 10.0)
    exporter.on_step_time(step_record(1))  # its timing first, as when the memory sampler runs late
    assert not wait_until(lambda: exporter.stats().steps_exported == 2, 0.3)  # waits (an hour here)
    exporter.on_step_memory(memory_record(1))
    assert wait_until(lambda: exporter.stats().steps_exported == 2, 10.0)
    stats = exporter.stats()
    assert stats.memory_exported == 2 and stats.dropped["metrics"] == 0


def test_a_snapshot_for_a_step_already_sent_is_counted_as_dropped(exporter):
    exporter.on_step_memory(memory_record(0))
    exporter.on_step_time(step_record(0))
    assert wait_until(lambda: exporter.stats().steps_exported == 1, 10.0)
    exporter.on_step_memory(memory_record(0))  # a second snapshot numbered 0: its span has left
    exporter.on_step_memory(memory_record(1))
    exporter.on_step_time(step_record(1))
    assert wait_until(lambda: exporter.stats().steps_exported == 2, 10.0)
    stats = exporter.stats()
    assert stats.memory_exported == 2 and stats.dropped["metrics"] == 1
