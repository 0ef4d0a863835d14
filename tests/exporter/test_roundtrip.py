"""What the samplers publish arrives at a real OTLP receiver exactly, over gRPC and HTTP."""
from __future__ import annotations

import pytest
from harness.exporter_records import BASE_NS, identity, memory_record, step_record

from traceml.exporter import OtlpStepExporter, resolve_settings
from traceml.schema import vocabulary as v
from traceml.schema.resources import RES_PROCESS_PID

PROTOCOLS = ["grpc", "http/protobuf"]


def _endpoint(receiver, protocol):
    return receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint


def _export(receiver, protocol, records, memory=(), *, run_id, env=None, rank=0, world_size=2, **kw):
    settings = resolve_settings(_endpoint(receiver, protocol), protocol, environ=env or {}, **kw)
    exporter = OtlpStepExporter(identity(run_id, rank, world_size), settings,
                                instrumentation_drops=lambda: {"timing": 3, "memory": 1})
    for record in memory:  # first, as on CUDA, where the step's timing resolves later
        exporter.on_step_memory(record)
    for record in records:
        exporter.on_step_time(record)
    assert exporter.shutdown(10.0)
    return exporter


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_step_arrives_with_exact_values_counts_and_nulls(receiver, protocol):
    run_id = f"exact-{protocol}"
    records = [step_record(s, gpu=s % 2 == 0, zero_forward=s == 3) for s in range(8)]
    _export(receiver, protocol, records, run_id=run_id)
    rows = {k: r for k, r in receiver.step_spans().items() if k[0] == run_id}
    assert sorted(rows) == [(run_id, 0, s) for s in range(8)]
    for record in records:
        row = rows[(run_id, 0, record.step)]
        assert row["start"] == record.start_time_ns and row["end"] == record.end_time_ns
        attrs = row["attributes"]
        for raw_event, totals in record.events.items():
            # Seconds on the wire (the samplers' milliseconds / 1000, correctly rounded).
            assert attrs[v.event_attribute(raw_event, v.EVENT_FIELD_CPU)] == totals.cpu_ms / 1000.0
            assert attrs[v.event_attribute(raw_event, v.EVENT_FIELD_COUNT)] == totals.count
            gpu_key = v.event_attribute(raw_event, v.EVENT_FIELD_GPU)
            if totals.gpu_ms is None:
                assert gpu_key not in attrs  # unmeasured stays absent, never 0
            else:
                assert attrs[gpu_key] == totals.gpu_ms / 1000.0
        expected_keys = {v.ATTR_RUN_ID, v.ATTR_RANK, v.ATTR_STEP} | {
            v.event_attribute(e, f) for e, t in record.events.items() for f in v.EVENT_FIELDS
            if not (f == v.EVENT_FIELD_GPU and t.gpu_ms is None)}
        assert set(attrs) == expected_keys
        # No internal raw name reaches a user: keys name the canonical phases.
        assert not [k for k in attrs if v.RAW_EVENT_PREFIX in k]
        assert {k.split(".")[2] for k in attrs if k.startswith(v.EVENT_ATTR_PREFIX)} == {
            v.RAW_EVENT_TO_METRIC[e] for e in record.events}
    assert v.event_attribute(v.RAW_FORWARD, v.EVENT_FIELD_CPU) in rows[(run_id, 0, 0)]["attributes"]
    assert "traceml.phase.forward.cpu.duration" in rows[(run_id, 0, 0)]["attributes"]
    # A measured zero is a zero, typed as a double.
    zero = rows[(run_id, 0, 3)]["attributes"]
    assert zero[v.event_attribute(v.RAW_FORWARD, v.EVENT_FIELD_CPU)] == 0.0
    assert isinstance(zero[v.event_attribute(v.RAW_FORWARD, v.EVENT_FIELD_CPU)], float)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_resource_carries_identity_service_and_merged_resource_attributes(receiver, protocol):
    run_id = f"res-{protocol}"
    env = {"OTEL_SERVICE_NAME": "trainer-svc",
           "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test,team=ml%20infra,traceml.rank=99"}
    _export(receiver, protocol, [step_record(0)], run_id=run_id, env=env, rank=1, world_size=2)
    (row,) = [r for k, r in receiver.step_spans().items() if k[0] == run_id]
    res = row["resource"]
    assert res[v.RES_SERVICE_NAME] == "trainer-svc"
    assert res[v.RES_SERVICE_INSTANCE_ID] == f"{run_id}-rank1"
    assert res[v.RES_HOST_NAME] == "host-a"
    assert res["deployment.environment"] == "test" and res["team"] == "ml infra"
    assert res[v.ATTR_RANK] == 1  # TraceML's identity wins over OTEL_RESOURCE_ATTRIBUTES
    assert (res[v.ATTR_RUN_ID], res[v.ATTR_LOCAL_RANK], res[v.ATTR_NODE_RANK], res[v.ATTR_WORLD_SIZE],
            res[v.ATTR_LOCAL_WORLD_SIZE], res[v.ATTR_TRAINING_STRATEGY]) == (run_id, 1, 0, 2, 2, "ddp")


def test_scope_and_telemetry_resource_say_what_made_the_spans(receiver):
    from importlib.metadata import version

    run_id = "made-by"
    env = {"OTEL_RESOURCE_ATTRIBUTES": "telemetry.sdk.name=opentelemetry,telemetry.distro.name=other"}
    _export(receiver, "grpc", [step_record(0)], run_id=run_id, env=env)
    package = version("traceml-otel")
    (res, span) = next((r, s) for r, s in receiver.spans()
                       if r.get(v.ATTR_RUN_ID) == run_id and s.name == v.SPAN_STEP)
    # Hand-built spans: not the OpenTelemetry SDK's reserved name, whatever the environment says.
    assert {k: res[k] for k in res if k.startswith("telemetry.")} == {
        "telemetry.sdk.name": "traceml.exporter", "telemetry.sdk.language": "python",
        "telemetry.sdk.version": package, "telemetry.distro.name": "traceml-otel",
        "telemetry.distro.version": package}
    scopes = {(ss.scope.name, ss.scope.version) for request in receiver.trace_requests
              for rs in request.resource_spans for ss in rs.scope_spans
              if any(kv.key == v.ATTR_RUN_ID and kv.value.string_value == run_id for kv in rs.resource.attributes)}
    assert scopes == {(v.INSTRUMENTATION_SCOPE, package)} and package != "1"


def test_default_service_name_without_otel_service_name(receiver):
    _export(receiver, "grpc", [step_record(0)], run_id="svc-default")
    (row,) = [r for k, r in receiver.step_spans().items() if k[0] == "svc-default"]
    assert row["resource"][v.RES_SERVICE_NAME] == v.DEFAULT_SERVICE_NAME


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_phase_children_hang_under_their_step_span(receiver, protocol):
    run_id = f"phases-{protocol}"
    record = step_record(4)
    _export(receiver, protocol, [record], run_id=run_id)
    step = receiver.step_spans()[(run_id, 0, 4)]
    children = [s for _, s in receiver.spans()
                if s.name.startswith(v.SPAN_PHASE_PREFIX) and s.trace_id == step["trace_id"]
                and s.parent_span_id == step["span_id"]]
    assert [(c.name, c.start_time_unix_nano, c.end_time_unix_nano) for c in children] == [
        (v.SPAN_PHASE_PREFIX + v.phase_name(p.raw_event), p.start_time_ns, p.end_time_ns)
        for p in record.phases]
    assert len({c.span_id for c in children}) == len(children)
    # Users see phase names, never the internal raw event names.
    assert [{kv.key: kv.value.string_value for kv in c.attributes}[v.ATTR_PHASE] for c in children] == [
        "input_wait", "h2d", "h2d", "forward", "backward", "optimizer_step"]
    assert not [c for c in children if v.RAW_EVENT_PREFIX in c.name
                or any(v.RAW_EVENT_PREFIX in kv.value.string_value for kv in c.attributes)]


def test_the_traced_step_has_no_child_repeating_the_step_span(receiver):
    run_id = "no-step-child"
    record = step_record(2)
    whole = type(record.phases[0])(v.RAW_STEP_TIME, record.start_time_ns, record.end_time_ns)
    record = record._replace(phases=(whole, *record.phases))  # as the samplers publish it
    _export(receiver, "grpc", [record], run_id=run_id)
    step = receiver.step_spans()[(run_id, 0, 2)]
    children = [s.name for _, s in receiver.spans() if s.parent_span_id == step["span_id"]]
    assert len(children) == len(record.phases) - 1
    assert v.SPAN_PHASE_PREFIX + v.phase_name(v.RAW_STEP_TIME) not in children
    # ... while the step span still carries the traced step's own timing.
    assert step["attributes"][v.event_attribute(v.RAW_STEP_TIME, v.EVENT_FIELD_CPU)] == 0.192


def test_phase_spans_can_be_switched_off(receiver):
    run_id = "no-phases"
    _export(receiver, "grpc", [step_record(0), step_record(1)], run_id=run_id,
            env={"TRACEML_PHASE_SPANS": "0"})
    run_spans = [s for r, s in receiver.spans() if r.get(v.ATTR_RUN_ID) == run_id]
    assert sorted(s.name for s in run_spans) == [v.SPAN_RUN_END, v.SPAN_STEP, v.SPAN_STEP]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_peak_memory_rides_on_the_step_span_exact_and_absent_off_cuda(receiver, protocol):
    run_id = f"mem-{protocol}"
    memory = [memory_record(0), memory_record(1, cuda=False), memory_record(2),
              type(memory_record(3))(3, "cuda:1", 0, None, BASE_NS + 7)]
    _export(receiver, protocol, [step_record(s) for s in range(4)], memory, run_id=run_id)
    rows = {k[2]: r["attributes"] for k, r in receiver.step_spans().items() if k[0] == run_id}
    mem_keys = (v.ATTR_DEVICE, v.ATTR_MEMORY_PEAK_ALLOCATED, v.ATTR_MEMORY_PEAK_RESERVED)
    assert {step: tuple(attrs.get(k) for k in mem_keys) for step, attrs in rows.items()} == {
        0: ("cuda:0", 1_000_000, 2_000_000),
        1: (None, None, None),  # non-CUDA: nothing at all (stored as null, never 0)
        2: ("cuda:0", 1_000_002, 2_000_002),
        3: ("cuda:1", 0, None),  # a measured zero is sent; an unmeasured peak is absent
    }
    # No memory metric exists any more: nothing per step can become a metric series.
    assert not [m for res, m, _ in receiver.metric_points()
                if res.get(v.ATTR_RUN_ID) == run_id and m.name.startswith("traceml.memory.")]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_run_end_marker_and_telemetry_counters_carry_final_counts(receiver, protocol):
    run_id = f"end-{protocol}"
    exporter = _export(receiver, protocol, [step_record(s) for s in range(3)], run_id=run_id)
    assert exporter.run_end_sent
    (end,) = [r for k, r in receiver.step_spans(v.SPAN_RUN_END).items() if k[0] == run_id]
    attrs = end["attributes"]
    assert attrs[v.ATTR_STEPS_COMPLETED] == 3 and attrs[v.ATTR_STEP] == 2
    assert attrs[v.run_end_dropped_attribute("timing")] == 3
    assert attrs[v.run_end_dropped_attribute("memory")] == 1
    assert attrs[v.run_end_dropped_attribute("spans")] == 0
    assert attrs[v.ATTR_RUN_END_EXPORT_FAILURES] == 0 and attrs[v.ATTR_RUN_END_EXPORT_RETRIES] == 0
    counters = {}
    for res, metric, point in receiver.metric_points():
        if res.get(v.ATTR_RUN_ID) == run_id and metric.name.startswith("traceml.telemetry."):
            assert metric.WhichOneof("data") == "sum" and metric.sum.is_monotonic
            label = {kv.key: kv.value.string_value for kv in point.attributes
                     if kv.key in (v.ATTR_QUEUE, v.ATTR_SIGNAL)}
            counters[(metric.name, *label.values())] = point.as_int
    assert counters[(v.METRIC_TELEMETRY_DROPPED, "timing")] == 3
    assert counters[(v.METRIC_TELEMETRY_DROPPED, "memory")] == 1
    assert counters[(v.METRIC_TELEMETRY_DROPPED, "spans")] == 0
    assert counters[(v.METRIC_EXPORT_FAILURES, "traces")] == 0
    assert counters[(v.METRIC_EXPORT_RETRIES, "metrics")] == 0


def test_on_run_end_counts_from_the_instrumentation_win(receiver):
    settings = resolve_settings(receiver.grpc_endpoint, "grpc", environ={})
    exporter = OtlpStepExporter(identity("end-final"), settings, instrumentation_drops=lambda: {})
    exporter.on_step_time(step_record(0))
    exporter.on_run_end(7, {"timing": 2, "memory": 0})
    assert exporter.shutdown(10.0)
    (end,) = [r for k, r in receiver.step_spans(v.SPAN_RUN_END).items() if k[0] == "end-final"]
    assert end["attributes"][v.ATTR_STEPS_COMPLETED] == 7
    assert end["attributes"][v.run_end_dropped_attribute("timing")] == 2


def test_gzip_compression_over_both_protocols(receiver):
    for protocol in PROTOCOLS:
        run_id = f"gzip-{protocol}"
        _export(receiver, protocol, [step_record(1)], [memory_record(1)], run_id=run_id,
                env={"OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"})
        assert (run_id, 0, 1) in receiver.step_spans()


def test_emitted_names_are_exactly_the_schema_vocabulary(receiver):
    run_id = "vocab"
    _export(receiver, "grpc", [step_record(s) for s in range(2)], [memory_record(0)], run_id=run_id)
    span_names = {s.name for r, s in receiver.spans() if r.get(v.ATTR_RUN_ID) == run_id}
    allowed_spans = {v.SPAN_STEP, v.SPAN_RUN_END} | {v.SPAN_PHASE_PREFIX + v.phase_name(e) for e in v.RAW_EVENTS
                                                     if e != v.RAW_STEP_TIME}
    assert span_names <= allowed_spans and {v.SPAN_STEP, v.SPAN_RUN_END} <= span_names
    specs = {spec.name: spec for spec in v.TRAINING_METRICS}
    seen = set()
    for res, metric, point in receiver.metric_points():
        if res.get(v.ATTR_RUN_ID) != run_id:
            continue
        spec = specs[metric.name]
        assert (metric.unit, metric.description) == (spec.unit, spec.description)
        assert {kv.key for kv in point.attributes} == set(spec.attributes)
        seen.add(metric.name)
    assert seen == set(specs)
    resource_keys = {v.RES_SERVICE_NAME, v.RES_SERVICE_INSTANCE_ID, v.RES_HOST_NAME, v.ATTR_RUN_ID, v.ATTR_RANK,
                     v.ATTR_LOCAL_RANK, v.ATTR_NODE_RANK, v.ATTR_WORLD_SIZE, v.ATTR_LOCAL_WORLD_SIZE,
                     v.ATTR_TRAINING_STRATEGY, v.ATTR_RUN_ATTEMPT, v.RES_TELEMETRY_SDK_NAME, v.RES_TELEMETRY_SDK_LANGUAGE,
                     v.RES_TELEMETRY_SDK_VERSION, v.RES_TELEMETRY_DISTRO_NAME, v.RES_TELEMETRY_DISTRO_VERSION,
                     RES_PROCESS_PID}
    for res, span in receiver.spans():
        if res.get(v.ATTR_RUN_ID) == run_id:
            assert set(res) == resource_keys
            for kv in span.attributes:
                assert (kv.key in {v.ATTR_RUN_ID, v.ATTR_RANK, v.ATTR_STEP, v.ATTR_PHASE, v.ATTR_STEPS_COMPLETED,
                                   v.ATTR_RUN_END_EXPORT_FAILURES, v.ATTR_RUN_END_EXPORT_RETRIES,
                                   v.ATTR_DEVICE, v.ATTR_MEMORY_PEAK_ALLOCATED, v.ATTR_MEMORY_PEAK_RESERVED,
                                   v.ATTR_STEP_BOUNDARY, v.ATTR_RUN_END_OUTCOME, v.ATTR_RUN_END_EXIT_CODE}
                        or v.parse_event_attribute(kv.key) is not None
                        or kv.key.startswith(v.RUN_END_DROPPED_PREFIX)), kv.key


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_otlp_headers_reach_the_receiver(fresh_receiver, protocol):
    _export(fresh_receiver, protocol, [step_record(0)], run_id=f"headers-{protocol}",
            env={"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20s3cret,x-tenant=ml"})
    assert fresh_receiver.last_headers["authorization"] == "Bearer s3cret"
    assert fresh_receiver.last_headers["x-tenant"] == "ml"
