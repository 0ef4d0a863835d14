"""The exporter's worker is woken by work, not by a clock (issue 37).

A fake transport stands in for the network: what is asserted is when the worker runs
a round and what it sends, not the wire (the other exporter tests hold the wire).
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from harness.exporter_records import identity, step_record
from traceml.exporter import OtlpStepExporter, resolve_settings
from traceml.exporter.encoding import OtlpEncoder
from traceml.exporter.transport import ExportOutcome
from traceml.records import ResourceSnapshot
from traceml.schema import vocabulary as v


class _Transport:
    def __init__(self) -> None:
        self.sent: list[tuple[str, float]] = []
        self.lock = threading.Lock()

    def export(self, signal, request, deadline):
        with self.lock:
            self.sent.append((signal, time.monotonic()))
        return ExportOutcome(True)

    def close(self) -> None:
        pass

    released = 0

    def release(self) -> None:
        self.released += 1

    def count(self, signal) -> int:
        with self.lock:
            return sum(1 for s, _ in self.sent if s == signal)


def _until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    return predicate()


def _exporter(export_interval_s: float, telemetry_interval_s: float):
    settings = resolve_settings("http://127.0.0.1:4317", "grpc", environ={})
    settings = replace(settings, export_interval_s=export_interval_s, telemetry_interval_s=telemetry_interval_s)
    transport = _Transport()
    exporter = OtlpStepExporter(identity("wake"), settings, instrumentation_drops=lambda: {}, transport=transport)
    rounds = [0]
    drain = exporter._drain

    def counted(final=False):
        rounds[0] += 1
        return drain(final)
    exporter._drain = counted  # the worker looks it up each round
    return exporter, transport, rounds


def test_an_idle_exporter_parks_and_the_next_record_is_sent_at_once():
    exporter, transport, rounds = _exporter(export_interval_s=0.02, telemetry_interval_s=0.05)
    try:
        # Start-up: a round or two, the first counters (they changed from "never sent"), then parked.
        assert _until(lambda: exporter._parked and transport.count(v.SIGNAL_METRICS) == 1)
        before = rounds[0]
        time.sleep(0.3)  # fifteen export intervals and six counter intervals
        assert rounds[0] == before and exporter._parked
        exporter.settings = replace(exporter.settings, export_interval_s=3600.0)  # only work wakes it now
        exporter.on_step_time(step_record(0))
        assert _until(lambda: transport.count(v.SIGNAL_TRACES) == 1, 5.0)  # not 3600 s later
    finally:
        assert exporter.shutdown(5.0)
    assert exporter.stats().steps_exported == 1 and exporter.parks >= 1


def test_a_resource_snapshot_wakes_a_parked_exporter_too():
    exporter, transport, rounds = _exporter(export_interval_s=3600.0, telemetry_interval_s=3600.0)
    try:
        assert _until(lambda: exporter._parked)
        snapshot = ResourceSnapshot(time.time_ns(), 0.5, 1 << 20, None, None, None, None, None, None, None, None, None)
        exporter.on_resources(snapshot)
        assert _until(lambda: transport.count(v.SIGNAL_METRICS) == 1, 5.0)
    finally:
        exporter.shutdown(5.0)
    assert exporter.stats().resources_exported == 1


def test_records_arriving_steadily_go_out_each_interval_and_the_worker_parks_when_they_stop():
    exporter, transport, rounds = _exporter(export_interval_s=0.05, telemetry_interval_s=3600.0)
    try:
        assert _until(lambda: exporter._parked)
        records = [step_record(step) for step in range(20)]
        for record in records:  # back to back: the first wakes the worker, the rest wait for the interval
            exporter.on_step_time(record)
        assert _until(lambda: exporter.stats().steps_exported == 20, 5.0)
        # One request on the wake-up, the rest together an interval later: never one request each.
        assert 1 <= transport.count(v.SIGNAL_TRACES) <= 3
        assert _until(lambda: exporter._parked, 5.0)
        parked_rounds = rounds[0]
        time.sleep(0.25)
        assert rounds[0] == parked_rounds
    finally:
        exporter.shutdown(5.0)


@pytest.mark.slow
def test_an_exporter_idle_for_a_while_releases_its_transport_and_the_next_record_reconnects(monkeypatch):
    """An open gRPC channel keeps grpc's own threads waking: parked long enough, the worker lets it go."""
    from traceml.exporter import step_exporter

    monkeypatch.setattr(step_exporter, "TRANSPORT_IDLE_S", 0.1)
    exporter, transport, rounds = _exporter(export_interval_s=0.02, telemetry_interval_s=3600.0)
    try:
        assert _until(lambda: transport.released == 1)
        after = rounds[0]
        time.sleep(0.3)
        assert transport.released == 1 and rounds[0] == after  # released once, then no timed wake-up at all
        exporter.on_step_time(step_record(0))
        assert _until(lambda: transport.count(v.SIGNAL_TRACES) == 1, 5.0)
        assert _until(lambda: transport.released == 2)  # idle again: released again
    finally:
        exporter.shutdown(5.0)


def test_a_released_grpc_transport_connects_again_on_the_next_export(fresh_receiver):
    from traceml.exporter.transport import make_transport

    settings = resolve_settings(fresh_receiver.grpc_endpoint, "grpc", environ={})
    transport = make_transport(settings, threading.Event())
    try:
        request = OtlpEncoder(identity("regrpc"), settings).trace_request([])
        assert transport.export(v.SIGNAL_TRACES, request, time.monotonic() + 10).delivered
        transport.release()
        transport.release()  # twice is harmless
        assert transport.export(v.SIGNAL_TRACES, request, time.monotonic() + 10).delivered
    finally:
        transport.close()
