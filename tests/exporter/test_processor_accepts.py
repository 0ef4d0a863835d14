"""The processor's own OTLP decoder accepts everything the exporter sends, with nothing rejected."""
from __future__ import annotations

from harness.exporter_records import identity, memory_record, step_record

from traceml.exporter import OtlpStepExporter, resolve_settings
from traceml.processor.decode import Decoder


def test_processor_decodes_exported_steps_memory_drops_and_run_end(fresh_receiver):
    settings = resolve_settings(fresh_receiver.grpc_endpoint, "grpc", environ={})
    exporter = OtlpStepExporter(identity("compat", rank=1, world_size=2), settings,
                                instrumentation_drops=lambda: {"timing": 4, "memory": 0})
    records = [step_record(s, gpu=s % 2 == 0, zero_forward=s == 2) for s in range(5)]
    exporter.on_step_memory(memory_record(0))
    exporter.on_step_memory(memory_record(1, cuda=False))
    for rec in records:
        exporter.on_step_time(rec)
    assert exporter.shutdown(10.0)

    decoder = Decoder()
    steps, memory, ends, drops = [], [], [], []
    for request in fresh_receiver.trace_requests:
        batch = decoder.decode_traces(request)
        assert batch.rejected_count == 0, batch.message()
        steps += batch.step_records
        memory += batch.memory_records  # peak memory rides on the step span
        ends += batch.run_ends
    for request in fresh_receiver.metric_requests:
        batch = decoder.decode_metrics(request)
        assert batch.rejected_count == 0, batch.message()
        assert batch.memory_records == []
        drops += batch.drops
    by_step = {r.step: r for r in steps}
    assert sorted(by_step) == [0, 1, 2, 3, 4]
    for rec in records:
        got = by_step[rec.step]
        assert (got.run_id, got.identity.global_rank) == ("compat", 1)
        assert {k: (e.cpu_ms, e.gpu_ms, e.count) for k, e in got.events.items()} == \
            {k: (t.cpu_ms, t.gpu_ms, t.count) for k, t in rec.events.items()}
    assert [(m.step, m.device, m.peak_allocated_bytes, m.peak_reserved_bytes) for m in memory] == \
        [(0, "cuda:0", 1_000_000, 2_000_000)]  # the CPU step (1) has no memory row: None, never 0
    assert memory[0].sample_time == records[0].end_time_ns / 1e9
    assert [(e.run_id, e.global_rank, e.steps_completed) for e in ends] == [("compat", 1, 5)]
    assert {d.queue: d.dropped for d in drops}["timing"] == 4


def test_the_strategy_recognised_from_the_model_rides_on_the_step_span_and_wins():
    """The resource's strategy is fixed before the model exists (`ddp` for two ranks); a step
    whose record says `fsdp` (recognised from the model, `traceml.sharding`) carries it on its
    span and the processor stores that; a step saying nothing, or the resource's own, adds nothing."""
    from traceml.exporter.encoding import OtlpEncoder
    from traceml.schema import vocabulary as v

    encoder = OtlpEncoder(identity("s", rank=1, world_size=2), resolve_settings("localhost:4317", "grpc", environ={}))
    request, spans = encoder.new_trace_request()
    encoder.add_step_spans(spans, step_record(0))
    encoder.add_step_spans(spans, step_record(1)._replace(strategy="ddp"))
    encoder.add_step_spans(spans, step_record(2)._replace(strategy="fsdp"))
    step_spans = [s for s in spans if s.name == v.SPAN_STEP]
    on_span = [[kv.value.string_value for kv in s.attributes if kv.key == v.ATTR_TRAINING_STRATEGY]
               for s in step_spans]
    assert on_span == [[], [], ["fsdp"]]
    batch = Decoder().decode_traces(request)
    assert batch.rejected_count == 0, batch.message()
    assert {r.step: r.training_strategy for r in batch.step_records} == {0: "ddp", 1: "ddp", 2: "fsdp"}
