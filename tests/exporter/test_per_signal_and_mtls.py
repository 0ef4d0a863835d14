"""Each signal goes where its own OTEL_EXPORTER_OTLP_{TRACES,METRICS}_* variables say, mTLS included.

Real receivers started by the tests: two plain ones for traces and metrics apart,
and one that speaks TLS only and requires a client certificate signed by a test
CA (gRPC `require_client_auth`, HTTP `CERT_REQUIRED`); the processor's own TLS
does not ask for client certificates, so the mTLS peer is the test receiver. The
certificates are made here with the `openssl` command.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest
from harness.exporter_records import identity, memory_record, step_record
from harness.otlp_receiver import OtlpTestReceiver

from traceml.exporter import OtlpStepExporter, resolve_settings, start_from_settings

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A test CA, a server certificate for 127.0.0.1 / localhost and a client certificate, as paths."""
    d = tmp_path_factory.mktemp("pki")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=traceml test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    for name, usage, extra in (("server", "serverAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                               ("client", "clientAuth", "subjectAltName=DNS:traceml-client")):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=traceml {name}", cwd=d)
        (d / f"{name}.ext").write_text(f"{extra}\nextendedKeyUsage={usage}\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return {name: str(d / name) for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.fixture(scope="module")
def mtls_receiver(pki):
    with OtlpTestReceiver(tls=(pki["server.pem"], pki["server.key"], pki["ca.pem"])) as r:
        yield r


def _run(env, run_id, steps=2):
    settings = resolve_settings(environ=env)
    exporter = OtlpStepExporter(identity(run_id), settings, instrumentation_drops=lambda: {})
    for step in range(steps):
        exporter.on_step_time(step_record(step))
        exporter.on_step_memory(memory_record(step))
    exporter.shutdown(10.0)
    return exporter


def _steps(receiver, run_id):
    return sorted(k for k in receiver.step_spans() if k[0] == run_id)


def _runs_with_metrics(receiver):
    return {res.get("traceml.run.id") for res, _, _ in receiver.metric_points()}


def test_traces_and_metrics_follow_their_own_endpoint_protocol_and_headers():
    with OtlpTestReceiver() as traces_peer, OtlpTestReceiver() as metrics_peer:
        exporter = _run({
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": traces_peer.http_endpoint + "/v1/traces",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-signal=traces",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": metrics_peer.grpc_endpoint,
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "x-signal=metrics",
        }, "split")
        assert exporter.run_end_sent
        assert _steps(traces_peer, "split") == [("split", 0, 0), ("split", 0, 1)]
        assert traces_peer.metric_requests == [] and traces_peer.calls["grpc"] == 0
        assert "split" in _runs_with_metrics(metrics_peer)
        assert metrics_peer.trace_requests == [] and metrics_peer.calls["http"] == 0
        assert traces_peer.last_headers["x-signal"] == "traces"
        assert metrics_peer.last_headers["x-signal"] == "metrics"


def test_a_job_configured_only_with_a_traces_endpoint_exports_its_steps():
    with OtlpTestReceiver() as peer:
        exporter = start_from_settings(run_id="traces-only", environ={
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": peer.grpc_endpoint,
            "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "300"})  # metrics go to the spec default, localhost:4317
        assert isinstance(exporter, OtlpStepExporter)
        exporter.on_step_time(step_record(0))
        exporter.shutdown(10.0)
        assert _steps(peer, "traces-only") == [("traces-only", 0, 0)] and exporter.run_end_sent


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_mtls_with_the_generic_variables(mtls_receiver, pki, protocol):
    endpoint = mtls_receiver.grpc_endpoint if protocol == "grpc" else mtls_receiver.http_endpoint
    run_id = f"mtls-{protocol}"
    exporter = _run({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
                     "OTEL_EXPORTER_OTLP_CERTIFICATE": pki["ca.pem"],
                     "OTEL_EXPORTER_OTLP_CLIENT_KEY": pki["client.key"],
                     "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": pki["client.pem"]}, run_id)
    assert exporter.run_end_sent and exporter.stats().failures == {"traces": 0, "metrics": 0}
    assert _steps(mtls_receiver, run_id) == [(run_id, 0, 0), (run_id, 0, 1)]
    assert run_id in _runs_with_metrics(mtls_receiver)


def test_mtls_with_per_signal_variables_over_both_protocols(mtls_receiver, pki):
    exporter = _run({
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": mtls_receiver.http_endpoint + "/v1/traces",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": pki["ca.pem"],
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": pki["client.key"],
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE": pki["client.pem"],
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": mtls_receiver.grpc_endpoint,
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE": pki["ca.pem"],
        "OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY": pki["client.key"],
        "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE": pki["client.pem"],
    }, "mtls-split")
    assert exporter.run_end_sent and exporter.stats().failures == {"traces": 0, "metrics": 0}
    assert _steps(mtls_receiver, "mtls-split") == [("mtls-split", 0, 0), ("mtls-split", 0, 1)]
    assert "mtls-split" in _runs_with_metrics(mtls_receiver)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_without_a_client_certificate_the_mtls_peer_refuses_and_the_loss_is_counted(mtls_receiver, pki, protocol):
    endpoint = mtls_receiver.grpc_endpoint if protocol == "grpc" else mtls_receiver.http_endpoint
    run_id = f"no-client-cert-{protocol}"
    exporter = _run({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
                     "OTEL_EXPORTER_OTLP_CERTIFICATE": pki["ca.pem"], "OTEL_EXPORTER_OTLP_TIMEOUT": "1000"},
                    run_id, steps=1)
    assert not exporter.run_end_sent and exporter.stats().failures["traces"] >= 1
    assert _steps(mtls_receiver, run_id) == []


@pytest.mark.parametrize("env", [
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/base/"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://t:443/x"},
    {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://m:4318/v1/metrics"},
])
def test_http_urls_agree_with_the_official_python_exporters(env, monkeypatch):
    """The same variables mean the same URLs to TraceML and to the OpenTelemetry Python SDK."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    for name in [n for n in __import__("os").environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ours = resolve_settings(environ={**env, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    theirs_traces, theirs_metrics = OTLPSpanExporter(), OTLPMetricExporter()
    try:
        assert ours.traces.endpoint == theirs_traces._endpoint
        assert ours.metrics.endpoint == theirs_metrics._endpoint
    finally:
        theirs_traces.shutdown()
        theirs_metrics.shutdown()
