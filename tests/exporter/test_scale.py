"""5,000 steps with peak memory: every step its own span carrying its memory, no overflow series, flat exporter memory."""
from __future__ import annotations

import fnmatch
import pathlib
import tracemalloc

import pytest

from harness.exporter_records import identity, memory_record, step_record

import traceml.exporter
from traceml.exporter import OtlpStepExporter, resolve_settings
from traceml.schema import vocabulary as v

STEPS = 5000


EXPORTER_FILES = str(pathlib.Path(traceml.exporter.__file__).resolve().parent / "*")


def _exporter_bytes() -> int:
    """Python memory allocated with the exporter package's code on the stack, still alive.

    (CPython free lists keep freed tuples counted for a while: warm up before comparing.) Each
    file name is matched once: `Snapshot.filter_traces` matches every frame of every trace again.
    """
    matches: dict[str, bool] = {}

    def exporter_code(filename: str) -> bool:
        if filename not in matches:
            matches[filename] = fnmatch.fnmatch(filename, EXPORTER_FILES)
        return matches[filename]

    return sum(trace.size for trace in tracemalloc.take_snapshot().traces
               if any(exporter_code(frame.filename) for frame in trace.traceback))


@pytest.mark.slow
def test_five_thousand_steps_no_overflow_and_flat_memory(fresh_receiver):
    run_id = "scale"
    settings = resolve_settings(fresh_receiver.grpc_endpoint, "grpc", environ={})
    exporter = OtlpStepExporter(identity(run_id), settings, instrumentation_drops=lambda: {})
    # Built before tracing starts: the training side allocates them, not the exporter, and tracing
    # their construction would be most of this test's time.
    records = [(step_record(step), memory_record(step)) for step in range(STEPS)]
    tracemalloc.start(30)
    try:
        samples = {}
        for step, (step_time, memory) in enumerate(records):
            exporter.on_step_time(step_time)
            exporter.on_step_memory(memory)
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
    assert stats.steps_exported == STEPS and stats.memory_exported == STEPS

    for res, metric, point in fresh_receiver.metric_points():
        assert "otel.metric.overflow" not in {kv.key for kv in point.attributes}
        assert not metric.name.startswith("traceml.memory.")
    rows = {k[2]: r["attributes"] for k, r in fresh_receiver.step_spans().items() if k[0] == run_id}
    assert set(rows) == set(range(STEPS))
    assert all((a[v.ATTR_MEMORY_PEAK_ALLOCATED], a[v.ATTR_MEMORY_PEAK_RESERVED]) ==
               (1_000_000 + step, 2_000_000 + step) for step, a in rows.items())
