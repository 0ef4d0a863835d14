"""5,000 step-keyed points: no overflow series, every step its own point, flat exporter memory."""
from __future__ import annotations

import pathlib
import tracemalloc

import pytest

from tests.exporter.exporter_records import identity, memory_record, step_record

import traceml.exporter
from traceml.exporter import OtlpStepExporter, resolve_settings
from traceml.schema import vocabulary as v

STEPS = 5000


EXPORTER_FILES = str(pathlib.Path(traceml.exporter.__file__).resolve().parent / "*")


def _exporter_bytes() -> int:
    """Python memory allocated with the exporter package's code on the stack, still alive.

    (CPython free lists keep freed tuples counted for a while: warm up before comparing.)
    """
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, EXPORTER_FILES, all_frames=True)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


@pytest.mark.slow
def test_five_thousand_steps_no_overflow_and_flat_memory(fresh_receiver):
    run_id = "scale"
    settings = resolve_settings(fresh_receiver.grpc_endpoint, "grpc", environ={})
    exporter = OtlpStepExporter(identity(run_id), settings, instrumentation_drops=lambda: {})
    tracemalloc.start(30)
    try:
        samples = {}
        for step in range(STEPS):
            exporter.on_step_time(step_record(step))
            exporter.on_step_memory(memory_record(step))
            if step + 1 in (2000, 3500, STEPS):
                assert exporter.force_flush(60.0)
                samples[step + 1] = _exporter_bytes()
    finally:
        tracemalloc.stop()
    assert exporter.shutdown(30.0)
    print(f"\nexporter-held Python memory after flush: {samples}")
    # Flat: nothing is kept per step (a 100-byte leak per step would add ~400 kB here).
    assert samples[STEPS] - samples[2000] < 64 * 1024

    stats = exporter.stats()
    assert stats.dropped["spans"] == stats.dropped["metrics"] == 0
    assert stats.steps_exported == STEPS and stats.memory_points_exported == 2 * STEPS

    series = {v.METRIC_MEMORY_PEAK_ALLOCATED: set(), v.METRIC_MEMORY_PEAK_RESERVED: set()}
    for res, metric, point in fresh_receiver.metric_points():
        attrs = {kv.key: kv.value for kv in point.attributes}
        assert "otel.metric.overflow" not in attrs
        if metric.name in series:
            key = tuple(sorted((k, str(val)) for k, val in attrs.items()))
            assert key not in series[metric.name], "a step's point arrived twice"
            series[metric.name].add(key)
            assert point.as_int == (1_000_000 if metric.name == v.METRIC_MEMORY_PEAK_ALLOCATED else 2_000_000) \
                + attrs[v.ATTR_STEP].int_value
    assert {name: len(keys) for name, keys in series.items()} == {name: STEPS for name in series}
    steps = {k[2] for k in fresh_receiver.step_spans() if k[0] == run_id}
    assert steps == set(range(STEPS))
