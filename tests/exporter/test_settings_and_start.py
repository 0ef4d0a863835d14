"""Settings from OTEL_* variables, OTEL_SDK_DISABLED, and the start hook's no-endpoint behaviour."""
from __future__ import annotations

import logging

import pytest

import traceml.exporter.start as start_module
from traceml.exporter import OtlpStepExporter, resolve_settings, start_from_settings


def test_standard_variables_are_honoured():
    s = resolve_settings(environ={
        "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector.example:4318",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20abc,x-tenant=ml",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        "OTEL_SERVICE_NAME": "svc",
        "OTEL_RESOURCE_ATTRIBUTES": "a=1,b=x%3Dy",
        "TRACEML_PHASE_SPANS": "false",
        "TRACEML_EXPORT_QUEUE_SIZE": "100",
    })
    assert (s.endpoint, s.protocol, s.timeout_s, s.compression, s.service_name, s.phase_spans, s.queue_size) == \
        ("https://collector.example:4318", "http/protobuf", 2.5, "gzip", "svc", False, 100)
    assert s.headers == (("authorization", "Bearer abc"), ("x-tenant", "ml"))
    assert dict(s.resource_attributes) == {"a": "1", "b": "x=y"}
    assert s.uses_tls and s.signal_url("v1/traces") == "https://collector.example:4318/v1/traces"


def test_defaults_are_grpc_plaintext_with_phase_spans():
    s = resolve_settings(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"})
    assert (s.endpoint, s.protocol, s.timeout_s, s.compression, s.phase_spans, s.uses_tls, s.grpc_target) == \
        ("http://collector:4317", "grpc", 10.0, "none", True, False, "collector:4317")
    assert resolve_settings(environ={}) is None
    assert resolve_settings("http://h:1", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:2"}).endpoint \
        == "http://h:1"


@pytest.mark.parametrize("env,needle", [
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "PROTOCOL"),
    ({"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"}, "COMPRESSION"),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "soon"}, "TIMEOUT"),
    ({"TRACEML_EXPORT_QUEUE_SIZE": "-3"}, "QUEUE_SIZE"),
])
def test_malformed_settings_are_clear_errors(env, needle):
    with pytest.raises(ValueError, match=needle):
        resolve_settings("http://127.0.0.1:4317", environ=env)


@pytest.mark.parametrize("raw", ["=x", "a=1,orphan,b=2"])
def test_malformed_resource_attributes_are_discarded_whole_with_an_error_and_export_goes_on(raw, caplog):
    with caplog.at_level(logging.ERROR, logger="traceml.exporter"):
        s = resolve_settings("http://127.0.0.1:4317", environ={"OTEL_RESOURCE_ATTRIBUTES": raw})
    assert s is not None and dict(s.resource_attributes) == {}
    [record] = caplog.records
    assert record.levelno == logging.ERROR and "OTEL_RESOURCE_ATTRIBUTES" in record.getMessage()


def test_start_hook_returns_none_and_logs_once_without_endpoint(caplog, monkeypatch):
    monkeypatch.setattr(start_module, "_hinted", False)
    with caplog.at_level(logging.WARNING, logger="traceml.exporter"):
        assert start_from_settings(environ={}) is None
        assert start_from_settings(environ={}) is None
    hints = [r for r in caplog.records if "OTEL_EXPORTER_OTLP_ENDPOINT" in r.getMessage()]
    assert len(hints) == 1


def test_otel_sdk_disabled_starts_nothing(receiver):
    assert start_from_settings(receiver.grpc_endpoint, environ={"OTEL_SDK_DISABLED": "true"}) is None
    exporter = start_from_settings(receiver.grpc_endpoint, run_id="enabled", environ={"OTEL_SDK_DISABLED": "false"})
    assert isinstance(exporter, OtlpStepExporter)
    assert exporter.shutdown(5.0)


def test_bad_setting_never_raises_from_the_start_hook(caplog):
    with caplog.at_level(logging.ERROR, logger="traceml.exporter"):
        assert start_from_settings("http://127.0.0.1:4317", environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"}) \
            is None
        assert start_from_settings("http://127.0.0.1:4317", environ={"RANK": "x", "WORLD_SIZE": "2"}) is None
    assert any("not started" in r.getMessage() for r in caplog.records)
