"""OTLP re-export of summary metrics, TLS, standard OTel SDK clients, CLI configuration."""
from __future__ import annotations

import http.client
import ssl
from importlib.metadata import version
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from tests.processor.test_runs import send_straggler_run

from harness import wait_until
from harness.otlp_receiver import OtlpTestReceiver, attributes
from harness.certificates import self_signed
from harness.processor_service import make_service
from harness.stored_rows import count_rows
from harness.otlp_payloads import steps_request
from traceml.processor.cli import config_from_args
from traceml.processor.summary_export import SummaryExportConfig
from traceml.processor.security import TlsConfig
from traceml.schema import vocabulary as v


def _diagnosis_points(receiver: OtlpTestReceiver, run_id: str):
    return [(metric, attributes(point.attributes), point) for _, metric, point in receiver.metric_points()
            if metric.name == "traceml.diagnosis.active" and attributes(point.attributes).get(v.ATTR_RUN_ID) == run_id]


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_summary_metrics_are_pushed_over_otlp(tmp_path, protocol):
    with OtlpTestReceiver() as receiver:
        endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
        svc = make_service(tmp_path, prometheus=None,
                           export=SummaryExportConfig(endpoint, protocol=protocol, interval_s=0.3, timeout_s=5))
        try:
            send_straggler_run(svc.grpc_port, "push-run", end_markers=())
            assert receiver.wait_for(lambda: any(
                a.get(v.ATTR_DIAGNOSIS_KIND) == "INPUT_STRAGGLER" for _, a, _ in _diagnosis_points(receiver, "push-run")))
        finally:
            svc.stop()
        points = receiver.metric_points()
        specs = {s.name: s for s in (*v.SUMMARY_METRICS, *v.PROCESSOR_METRICS)}
        for resource, metric, point in points:
            assert metric.name in specs
            assert metric.description == specs[metric.name].description
            assert metric.unit == specs[metric.name].unit
            assert v.ATTR_STEP not in attributes(point.attributes)
            assert resource[v.RES_SERVICE_NAME] == "traceml-processor"
            assert resource[v.RES_SERVICE_INSTANCE_ID] == svc.pusher.resource.attributes[v.RES_SERVICE_INSTANCE_ID]
            assert resource["service.version"] == version("traceml-otel")
            assert resource["telemetry.sdk.name"] == "opentelemetry"  # the SDK's resource, not a hand-built one
        kinds = {m.WhichOneof("data") for _, m, _ in points if m.name == "traceml.rank.telemetry.dropped"}
        assert kinds == {"sum"}
        scopes = {(sm.scope.name, sm.scope.version) for request in receiver.metric_requests
                  for rm in request.resource_metrics for sm in rm.scope_metrics}
        assert scopes == {("traceml.processor", version("traceml-otel"))}


def test_two_processors_pushing_to_one_receiver_carry_distinct_instance_ids(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    with OtlpTestReceiver() as receiver:
        services = [make_service(tmp_path / name, prometheus=None,
                                 export=SummaryExportConfig(receiver.grpc_endpoint, interval_s=0.2, timeout_s=5))
                    for name in ("a", "b")]
        try:
            def instances():
                return {res.get(v.RES_SERVICE_INSTANCE_ID) for res, _m, _p in receiver.metric_points()}

            assert receiver.wait_for(lambda: len(instances()) == 2)
        finally:
            for svc in services:
                svc.stop()
    assert instances() == {svc.pusher.resource.attributes[v.RES_SERVICE_INSTANCE_ID] for svc in services}
    assert None not in instances()


def test_otel_service_name_and_resource_attributes_win_over_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "processor-eu")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod")
    with OtlpTestReceiver() as receiver:
        svc = make_service(tmp_path, prometheus=None,
                           export=SummaryExportConfig(receiver.grpc_endpoint, interval_s=0.2, timeout_s=5))
        try:
            assert receiver.wait_for(lambda: receiver.metric_points())
        finally:
            svc.stop()
        resource = receiver.metric_points()[0][0]
    assert resource[v.RES_SERVICE_NAME] == "processor-eu"
    assert resource["deployment.environment"] == "prod"
    assert resource[v.RES_SERVICE_INSTANCE_ID]


def _runs_pushed(receiver: OtlpTestReceiver) -> set:
    return {attributes(p.attributes).get(v.ATTR_RUN_ID) for _r, m, p in receiver.metric_points()
            if m.name == "traceml.window.steps"}


@pytest.mark.parametrize("variable, path", [
    ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "/v1/metrics"),  # per signal: used as is
    ("OTEL_EXPORTER_OTLP_ENDPOINT", ""),  # generic: /v1/metrics appended for HTTP
])
@pytest.mark.slow
def test_the_spec_endpoint_variables_reach_the_receiver_over_http(tmp_path, monkeypatch, variable, path):
    for name in ("TRACEML_PROCESSOR_EXPORT_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    with OtlpTestReceiver() as receiver:
        monkeypatch.setenv(variable, receiver.http_endpoint + path)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        config, _ = config_from_args(["--db", str(tmp_path / "x.db"), "--export-interval", "0.2"])
        assert config.export.endpoint is None  # left to the exporter, which reads the variable by the spec
        svc = make_service(tmp_path, prometheus=None, export=config.export)
        try:
            send_straggler_run(svc.grpc_port, "env-run", end_markers=())
            assert receiver.wait_for(lambda: "env-run" in _runs_pushed(receiver))
        finally:
            svc.stop()
    assert svc.pusher.failed == 0


@pytest.mark.slow
def test_a_per_signal_endpoint_is_not_given_a_second_path(tmp_path, monkeypatch):
    """`OTEL_EXPORTER_OTLP_METRICS_ENDPOINT=http://host:port` posts to `/`, as the spec says (here: 404)."""
    with OtlpTestReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", receiver.http_endpoint)
        svc = make_service(tmp_path, prometheus=None,
                           export=SummaryExportConfig(None, protocol="http/protobuf", interval_s=0.2, timeout_s=1))
        try:
            assert wait_until(lambda: svc.pusher.failed >= 1, 30)
        finally:
            svc.stop()
        assert receiver.metric_points() == [] and receiver.calls["http"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_tls_destination_is_trusted_through_otel_exporter_otlp_certificate(tmp_path, monkeypatch, certificate,
                                                                             protocol):
    cert, key = certificate
    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):  # requests lets these override the exporter's CA
        monkeypatch.delenv(name, raising=False)
    for name in ("untrusted", "trusted"):
        (tmp_path / name).mkdir()
    with OtlpTestReceiver(tls=(cert, key)) as receiver:
        endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
        assert endpoint.startswith("https://")
        # Without the CA the self-signed destination is refused: pushes fail, nothing arrives.
        untrusted = make_service(tmp_path / "untrusted", prometheus=None,
                                 export=SummaryExportConfig(endpoint, protocol=protocol, interval_s=0.2, timeout_s=1))
        try:
            assert wait_until(lambda: untrusted.pusher.failed >= 1, 30)
        finally:
            untrusted.stop()
        assert receiver.metric_points() == []
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(cert))
        trusted = make_service(tmp_path / "trusted", prometheus=None,
                               export=SummaryExportConfig(endpoint, protocol=protocol, interval_s=0.2, timeout_s=5))
        try:
            send_straggler_run(trusted.grpc_port, "tls-run", end_markers=())
            assert receiver.wait_for(lambda: "tls-run" in _runs_pushed(receiver))
        finally:
            trusted.stop()


@pytest.mark.slow
def test_unreachable_export_destination_never_blocks_ingest(tmp_path):
    from harness import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    svc = make_service(tmp_path, prometheus=None, export=SummaryExportConfig(dead, interval_s=0.1, timeout_s=0.5))
    try:
        send_straggler_run(svc.grpc_port, "push-dead", end_markers=())
        assert count_rows(svc.config.db, run_id="push-dead") == 48
        assert wait_until(lambda: svc.pusher.failed >= 1, 30)
        send_straggler_run(svc.grpc_port, "push-dead-2", end_markers=())
        assert count_rows(svc.config.db, run_id="push-dead-2") == 48
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("tls"))


def test_tls_on_both_receivers(tmp_path, certificate):
    cert, key = certificate
    svc = make_service(tmp_path, prometheus=None, tls=TlsConfig(str(cert), str(key)))
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"localhost:{svc.grpc_port}", credentials) as channel:
            trace_service_pb2_grpc.TraceServiceStub(channel).Export(steps_request("tls", 0, range(3)), timeout=10)
        with grpc.insecure_channel(f"127.0.0.1:{svc.grpc_port}") as channel:
            with pytest.raises(grpc.RpcError):  # plaintext is refused
                trace_service_pb2_grpc.TraceServiceStub(channel).Export(steps_request("tls", 0, range(3, 6)),
                                                                        timeout=5)
        context = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("localhost", svc.http_port, context=context, timeout=10)
        conn.request("POST", "/v1/traces", body=steps_request("tls", 1, range(3)).SerializeToString(),
                     headers={"Content-Type": "application/x-protobuf"})
        assert conn.getresponse().status == 200
        conn.close()
        assert count_rows(svc.config.db, run_id="tls") == 6
    finally:
        svc.stop()


def test_opentelemetry_sdk_exporters_drive_both_receivers(service):
    """A plain OTel SDK client (resource from OTEL_RESOURCE_ATTRIBUTES-style strings) is understood."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    exporters = {0: GrpcExporter(endpoint=f"127.0.0.1:{service.grpc_port}", insecure=True),
                 1: HttpExporter(endpoint=f"http://127.0.0.1:{service.http_port}/v1/traces")}
    for rank, exporter in exporters.items():
        # Strings, as OTEL_RESOURCE_ATTRIBUTES would produce them.
        resource = Resource.create({v.ATTR_RUN_ID: "sdk-run", v.ATTR_RANK: str(rank), v.ATTR_WORLD_SIZE: "2"})
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer(v.INSTRUMENTATION_SCOPE)
        for step in range(4):
            start = 1_800_000_000_000_000_000 + step * 100_000_000
            span = tracer.start_span(v.SPAN_STEP, start_time=start, attributes={
                v.ATTR_STEP: step, v.ATTR_RANK: rank,
                v.legacy_event_attribute(v.RAW_FORWARD, "cpu_ms"): 30.0,
                v.legacy_event_attribute(v.RAW_FORWARD, "count"): 1,
                v.legacy_event_attribute(v.RAW_STEP_TIME, "cpu_ms"): 95.0})
            span.end(end_time=start + 95_000_000)
        provider.shutdown()
    assert count_rows(service.config.db, run_id="sdk-run") == 8


def test_cli_reads_flags_then_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACEML_PROCESSOR_DB", str(tmp_path / "env.db"))
    monkeypatch.setenv("TRACEML_PROCESSOR_OTLP_GRPC", "off")
    monkeypatch.setenv("TRACEML_PROCESSOR_PROMETHEUS", "127.0.0.1:9464")
    monkeypatch.setenv("TRACEML_PROCESSOR_IDLE_TIMEOUT", "42")
    monkeypatch.setenv("TRACEML_PROCESSOR_AUTH_TOKEN", "tok")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://collector:4318/v1/metrics")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=a%20b")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2500")  # milliseconds, by the spec
    config, _ = config_from_args(["--otlp-http", "0.0.0.0:5318"])
    assert config.db == tmp_path / "env.db"
    assert config.otlp_grpc is None
    assert config.otlp_http == ("0.0.0.0", 5318)
    assert config.prometheus == ("127.0.0.1", 9464)
    assert config.idle_timeout_s == 42.0
    assert config.auth.allows("Bearer tok") and not config.auth.allows(None)
    assert config.export.protocol == "http/protobuf"  # the URL ends in /v1/metrics
    assert config.export.endpoint is None  # the exporter reads OTEL_EXPORTER_OTLP_METRICS_ENDPOINT itself
    assert config.export.headers == {"x-tenant": "a b"}
    assert config.export.timeout_s == 2.5
    config, _ = config_from_args(["--export-endpoint", "http://c:4318", "--export-protocol", "http/protobuf"])
    assert config.export.exporter_endpoint() == "http://c:4318/v1/metrics"  # our flag is a base URL
    config, _ = config_from_args(["--export-endpoint", "http://c:4317"])
    assert (config.export.protocol, config.export.exporter_endpoint()) == ("grpc", "http://c:4317")
    config, _ = config_from_args(["--db", "x.db"])
    assert config.db == Path("x.db")


def test_cli_defaults_are_loopback_and_off(monkeypatch):
    for name in ("TRACEML_PROCESSOR_OTLP_GRPC", "TRACEML_PROCESSOR_OTLP_HTTP", "TRACEML_PROCESSOR_PROMETHEUS",
                 "TRACEML_PROCESSOR_EXPORT_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "TRACEML_PROCESSOR_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    config, _ = config_from_args([])
    assert config.otlp_grpc == ("127.0.0.1", 4317)
    assert config.otlp_http == ("127.0.0.1", 4318)
    assert config.prometheus is None and config.export is None and not config.auth.enabled


@pytest.mark.slow
def test_cli_rejects_bad_settings_with_exit_code_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "traceml.processor.cli", "--db", str(tmp_path / "x.db"),
                          "--otlp-grpc", "nonsense"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "expected HOST:PORT" in out.stderr
    out = subprocess.run([sys.executable, "-m", "traceml.processor.cli", "--db", str(tmp_path / "x.db"),
                          "--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(tmp_path / "k.pem"),
                          "--otlp-grpc", "127.0.0.1:0", "--otlp-http", "127.0.0.1:0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "TLS file not found" in out.stderr
