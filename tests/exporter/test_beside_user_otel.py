"""Beside the job's own OpenTelemetry: a step span is the child of the job's span that was
current when the step began, in its trace, and the resource merges with the job's.

The job's side is the real OpenTelemetry SDK in this process (TracerProvider with a
resource, InMemorySpanExporter); TraceML's side is `traceml.init` + `trace_step` with the
real samplers and exporter, sending to a real OTLP receiver.
"""
from __future__ import annotations

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from harness.exporter_records import identity, step_record

import traceml
from traceml._testing import reset_for_tests
from traceml.exporter import resolve_settings
from traceml.exporter.encoding import OtlpEncoder, resource_attributes
from traceml.schema import vocabulary as v


@pytest.fixture
def user_provider(monkeypatch):
    """The job's SDK TracerProvider, seen as the global one (without setting the process-wide
    global, which OpenTelemetry allows only once per process)."""
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "TRACEML_DISABLE", "TRACEML_MODE"):
        monkeypatch.delenv(name, raising=False)
    spans = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({
        "service.name": "my-trainer", "service.instance.id": "trainer-7",
        "deployment.environment": "prod", v.ATTR_RANK: 42}))
    provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(otel_trace, "get_tracer_provider", lambda: provider)
    reset_for_tests()
    yield provider, spans
    reset_for_tests()
    provider.shutdown()


def test_step_spans_are_children_of_the_users_active_span_in_its_trace(fresh_receiver, user_provider):
    provider, user_spans = user_provider
    run_id = "beside-user"
    traceml.init(mode="manual", endpoint=fresh_receiver.grpc_endpoint, protocol="grpc", run_id=run_id)
    try:
        tracer = provider.get_tracer("user-training-script")
        with tracer.start_as_current_span("train_epoch"):
            for _ in range(3):
                with traceml.trace_step():
                    with traceml.timed_forward():  # a phase child (the traced step itself has none)
                        pass
        with traceml.trace_step():  # no span of the job's is current: a root span, as before
            pass
    finally:
        traceml.shutdown()

    (epoch,) = [s for s in user_spans.get_finished_spans() if s.name == "train_epoch"]
    epoch_trace = epoch.context.trace_id.to_bytes(16, "big")
    epoch_span = epoch.context.span_id.to_bytes(8, "big")
    rows = {k[2]: r for k, r in fresh_receiver.step_spans().items() if k[0] == run_id}
    assert sorted(rows) == [0, 1, 2, 3]
    for step in (0, 1, 2):
        assert (rows[step]["trace_id"], rows[step]["parent_span_id"]) == (epoch_trace, epoch_span)
    assert rows[3]["parent_span_id"] == b"" and rows[3]["trace_id"] != epoch_trace
    step_span = next(s for _, s in fresh_receiver.spans()
                     if s.name == v.SPAN_STEP and s.span_id == rows[0]["span_id"])
    assert step_span.flags & 0xFF == int(epoch.context.trace_flags)  # sampled, as its parent
    children = [s for _, s in fresh_receiver.spans() if s.parent_span_id == rows[0]["span_id"]]
    assert children and all(c.trace_id == epoch_trace for c in children)

    resource = rows[0]["resource"]
    assert resource[v.RES_SERVICE_NAME] == "my-trainer"
    assert resource[v.RES_SERVICE_INSTANCE_ID] == "trainer-7"
    assert resource["deployment.environment"] == "prod"
    assert resource[v.ATTR_RANK] == 0 and resource[v.ATTR_RUN_ID] == run_id  # TraceML's identity wins
    # The job's SDK did not make these spans: telemetry.* names TraceML's encoder, never the job's SDK.
    assert resource[v.RES_TELEMETRY_SDK_NAME] == v.TELEMETRY_SDK_NAME != "opentelemetry"
    assert resource[v.RES_TELEMETRY_DISTRO_NAME] == v.TELEMETRY_DISTRO_NAME


def _settings(env):
    return resolve_settings("http://127.0.0.1:4317", "grpc", environ=env)


def test_resource_precedence_environment_then_users_resource_then_tracemls_identity():
    me = identity("prec", rank=1, world_size=2)
    env = {"OTEL_SERVICE_NAME": "env-svc",
           "OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=env-inst,team=ml,region=eu"}
    assert resource_attributes(me, _settings({}))[v.RES_SERVICE_INSTANCE_ID] == "prec-rank1"
    from_env = resource_attributes(me, _settings(env))
    assert (from_env[v.RES_SERVICE_NAME], from_env[v.RES_SERVICE_INSTANCE_ID]) == ("env-svc", "env-inst")
    merged = resource_attributes(me, _settings(env), {"region": "us", v.ATTR_RUN_ID: "theirs",
                                                       v.RES_SERVICE_NAME: "unknown_service:python"})
    assert (merged["team"], merged["region"]) == ("ml", "us")  # the job's resource over the variable
    assert merged[v.RES_SERVICE_NAME] == "env-svc"  # the SDK's placeholder name does not count
    assert merged[v.ATTR_RUN_ID] == "prec" and merged[v.ATTR_RANK] == 1


def test_a_host_name_the_job_sets_names_the_machine_and_the_detected_one_stands_in_otherwise():
    # On Kubernetes the hostname is the pod's: the node's name, set by the job (the downward API
    # into OTEL_RESOURCE_ATTRIBUTES, or its SDK resource), is what the fleet counts as one machine.
    me = identity("hosts", rank=1, world_size=2)
    detected = resource_attributes(me, _settings({}))[v.RES_HOST_NAME]
    assert detected == me.hostname
    env = {"OTEL_RESOURCE_ATTRIBUTES": "host.name=node-17"}
    assert resource_attributes(me, _settings(env))[v.RES_HOST_NAME] == "node-17"
    assert resource_attributes(me, _settings(env), {v.RES_HOST_NAME: "node-18"})[v.RES_HOST_NAME] == "node-18"
    assert resource_attributes(me, _settings({"OTEL_RESOURCE_ATTRIBUTES": "host.name=%20"}))[v.RES_HOST_NAME] \
        == detected  # a blank name names nothing


def test_an_invalid_or_foreign_parent_context_leaves_the_step_a_root_span():
    encoder = OtlpEncoder(identity("roots"), _settings({}))
    request, spans = encoder.new_trace_request()
    for step, parent in enumerate((otel_trace.INVALID_SPAN_CONTEXT, object(), None)):
        encoder.add_step_spans(spans, step_record(step, phases=False)._replace(parent=parent))
    assert [s.parent_span_id for s in spans] == [b"", b"", b""]
