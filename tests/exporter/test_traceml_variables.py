"""TraceML's own destination variables (`TRACEML_OTLP_ENDPOINT`, `_PROTOCOL`, `_HEADERS`).

`traceml run` points TraceML's exporter at its processor with these, so the job's own
OpenTelemetry SDK, which reads only `OTEL_*`, keeps its destination. They come before
every `OTEL_*` variable for both signals; without them the specification's order holds.
"""
from __future__ import annotations

from traceml.exporter import resolve_settings
from traceml.schema import environment as env


def test_traceml_variables_win_over_every_otel_variable_for_both_signals():
    environ = {
        "TRACEML_OTLP_ENDPOINT": "http://processor:4317",
        "TRACEML_OTLP_PROTOCOL": "grpc",
        "TRACEML_OTLP_HEADERS": "authorization=Bearer%20ours",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://agent:4318",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-vendor-key=theirs",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://agent:4318/v1/traces",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "x-vendor-key=theirs-too",
    }
    settings = resolve_settings(environ=environ)
    for signal in (settings.traces, settings.metrics):
        assert (signal.endpoint, signal.protocol) == ("http://processor:4317", "grpc")
        assert signal.headers == (("authorization", "Bearer ours"),)


def test_without_them_the_specification_order_is_unchanged():
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://agent:4318",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4318/custom",
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "k=metrics",
        "OTEL_EXPORTER_OTLP_HEADERS": "k=generic",
    }
    settings = resolve_settings(environ=environ)
    assert settings.traces.endpoint == "http://traces:4318/custom"  # per-signal URL as it is
    assert settings.metrics.endpoint == "http://agent:4318/v1/metrics"  # generic base + path
    assert settings.traces.protocol == settings.metrics.protocol == "http/protobuf"
    assert settings.traces.headers == (("k", "generic"),) and settings.metrics.headers == (("k", "metrics"),)


def test_the_traceml_endpoint_is_a_base_url_over_http_and_an_argument_still_wins():
    environ = {"TRACEML_OTLP_ENDPOINT": "http://processor:4318/base/", "TRACEML_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    settings = resolve_settings(environ=environ)
    assert settings.traces.endpoint == "http://processor:4318/base/v1/traces"
    assert settings.metrics.endpoint == "http://processor:4318/base/v1/metrics"
    coded = resolve_settings(endpoint="http://coded:4317", protocol="grpc", environ=environ)
    assert coded.traces.endpoint == "http://coded:4317" and coded.traces.protocol == "grpc"


def test_a_blank_or_invalid_traceml_value_falls_through_to_the_otel_one():
    environ = {"TRACEML_OTLP_ENDPOINT": "  ", "TRACEML_OTLP_PROTOCOL": "carrier-pigeon",
               "OTEL_EXPORTER_OTLP_ENDPOINT": "http://agent:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    settings = resolve_settings(environ=environ)
    assert settings.traces.endpoint == "http://agent:4318/v1/traces"
    assert settings.traces.protocol == "http/protobuf"


def test_the_traceml_endpoint_alone_turns_export_on():
    assert resolve_settings(environ={}) is None
    settings = resolve_settings(environ={"TRACEML_OTLP_ENDPOINT": "http://processor:4317"})
    assert settings.traces.endpoint == settings.metrics.endpoint == "http://processor:4317"
    assert env.exporter_value({"TRACEML_OTLP_ENDPOINT": "x"}, "TIMEOUT", "traces") is None  # no own variable
