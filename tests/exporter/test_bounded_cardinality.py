"""Bounded cardinality: 1,000 steps make no new metric series; their peak memory rides on the
step spans and still reaches SQLite exactly (None, never 0, off CUDA)."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from harness.exporter_records import identity, memory_record, step_record
from harness.stored_rows import stored_memory_values, stored_step_keys

from traceml.exporter import OtlpStepExporter, resolve_settings
from traceml.processor.decode import Decoder
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.schema import vocabulary as v

STEPS = 1000


def _series(receiver) -> set[tuple]:
    """Distinct metric series seen so far: metric name + the data point's attribute set."""
    return {(metric.name, tuple(sorted((kv.key, str(kv.value)) for kv in point.attributes)))
            for _, metric, point in receiver.metric_points()}


@pytest.mark.slow
def test_memory_series_count_stays_constant_over_1000_steps(fresh_receiver, tmp_path):
    run_id = "cardinality"
    # The periodic telemetry counters every 50 ms rather than every 10 s, so they are
    # seen at each checkpoint.
    settings = replace(resolve_settings(fresh_receiver.grpc_endpoint, "grpc", environ={}),
                       export_interval_s=0.05, telemetry_interval_s=0.05)
    exporter = OtlpStepExporter(identity(run_id), settings, instrumentation_drops=lambda: {})
    series_after = {}
    for step in range(STEPS):
        exporter.on_step_memory(memory_record(step, cuda=step % 10 != 9))  # every tenth step off CUDA
        exporter.on_step_time(step_record(step))
        if step + 1 in (10, 500):
            assert exporter.force_flush(30.0)
            assert fresh_receiver.wait_for(lambda: fresh_receiver.metric_points(), 10.0)
            series_after[step + 1] = _series(fresh_receiver)
    assert exporter.shutdown(30.0)
    series_after[STEPS] = _series(fresh_receiver)

    counts = {n: len(s) for n, s in series_after.items()}
    print(f"\ndistinct metric series after N steps: {counts}")
    assert counts[10] == counts[500] == counts[STEPS]
    assert {name for name, _ in series_after[STEPS]} <= {spec.name for spec in v.TRAINING_METRICS}
    assert not any(key == v.ATTR_STEP for _, attrs in series_after[STEPS] for key, _ in attrs)
    assert exporter.stats().memory_exported == STEPS - STEPS // 10

    decoder = Decoder()
    with StepTimeStore(tmp_path / "traceml.db") as store:
        for request in fresh_receiver.trace_requests:
            batch = decoder.decode_traces(request)
            assert batch.rejected_count == 0, batch.message()
            store.write(batch.step_records, batch.memory_records)
    assert stored_step_keys(tmp_path / "traceml.db", run_id) == {(run_id, 0, s) for s in range(STEPS)}
    assert stored_memory_values(tmp_path / "traceml.db", run_id) == {
        (0, s, "cuda:0"): (1_000_000 + s, 2_000_000 + s) for s in range(STEPS) if s % 10 != 9}


def test_processor_still_reads_the_step_keyed_gauges_of_older_exporters():
    """Older exporters sent peak memory as gauges with `traceml.step`; their rows still arrive."""
    from harness.otlp_payloads import memory_request

    batch = Decoder().decode_metrics(memory_request("legacy", 0, [3, 4]))
    assert batch.rejected_count == 0, batch.message()
    assert sorted((m.step, m.peak_allocated_bytes is not None) for m in batch.memory_records) == \
        [(3, True), (4, True)]


def test_a_malformed_peak_on_a_step_span_rejects_that_span_whole(fresh_receiver):
    settings = resolve_settings(fresh_receiver.grpc_endpoint, "grpc", environ={})
    exporter = OtlpStepExporter(identity("bad-peak"), settings, instrumentation_drops=lambda: {})
    exporter.on_step_memory(memory_record(0))
    exporter.on_step_time(step_record(0))
    exporter.on_step_time(step_record(1))
    assert exporter.shutdown(10.0)
    spans = [s for request in fresh_receiver.trace_requests
             for s in request.resource_spans[0].scope_spans[0].spans]
    (peak,) = [kv for s in spans if s.name == v.SPAN_STEP
               for kv in s.attributes if kv.key == v.ATTR_MEMORY_PEAK_ALLOCATED]
    peak.value.int_value = -5
    decoder = Decoder()
    batches = [decoder.decode_traces(request) for request in fresh_receiver.trace_requests]
    assert sum((b.rejected for b in batches), start=Counter()) == {"negative_value": 1}
    assert [r.step for b in batches for r in b.step_records] == [1]
    assert [m for b in batches for m in b.memory_records] == []
