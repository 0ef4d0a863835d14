"""Settings from OTEL_* variables by the SDK configuration specification, and the start hook.

Per-signal variables over generic ones, the OTLP/HTTP path rules, the Boolean and
numeric rules (a bad value is warned about once and ignored, never a reason not
to export), OTEL_BSP_* / OTEL_METRIC_* mapped onto the exporter, and the start
hook's no-endpoint and disabled behaviour.
"""
from __future__ import annotations

import logging

import pytest

import traceml.exporter.start as start_module
from traceml.exporter import OtlpStepExporter, resolve_settings, start_from_settings
from traceml.exporter.settings import sdk_disabled
from traceml.schema import env_values
from traceml.settings import kill_switch

LOCAL = "http://127.0.0.1:4317"


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees its own first warnings (they are logged once per variable and value)."""
    monkeypatch.setattr(env_values, "_warned", set())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_generic_variables_configure_both_signals():
    s = resolve_settings(environ={
        "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector.example:4318",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20abc,x-tenant=ml",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        "OTEL_EXPORTER_OTLP_CERTIFICATE": "/ca.pem",
        "OTEL_EXPORTER_OTLP_CLIENT_KEY": "/client.key",
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": "/client.pem",
        "OTEL_SERVICE_NAME": "svc",
        "OTEL_RESOURCE_ATTRIBUTES": "a=1,b=x%3Dy",
        "TRACEML_PHASE_SPANS": "false",
        "TRACEML_EXPORT_QUEUE_SIZE": "100",
    })
    for signal, path in (("traces", "/v1/traces"), ("metrics", "/v1/metrics")):
        t = s.signal(signal)
        assert t.endpoint == "https://collector.example:4318" + path
        assert (t.protocol, t.timeout_s, t.compression, t.uses_tls) == ("http/protobuf", 2.5, "gzip", True)
        assert t.headers == (("authorization", "Bearer abc"), ("x-tenant", "ml"))
        assert (t.certificate_file, t.client_key_file, t.client_certificate_file) == \
            ("/ca.pem", "/client.key", "/client.pem")
    assert (s.service_name, s.phase_spans, s.queue_size) == ("svc", False, 100)
    assert dict(s.resource_attributes) == {"a": "1", "b": "x=y"}


def test_per_signal_variables_win_and_each_signal_keeps_its_own():
    s = resolve_settings(environ={
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://generic:4318/base/",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-which=generic",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "https://metrics.example:4317",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "x-which=metrics",
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "700",
        "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION": "gzip",
        "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE": "/metrics-ca.pem",
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": "/t.key",
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE": "/t.pem",
    })
    assert (s.traces.endpoint, s.traces.protocol, s.traces.headers, s.traces.timeout_s, s.traces.compression) == \
        ("http://generic:4318/base/v1/traces", "http/protobuf", (("x-which", "generic"),), 10.0, "none")
    assert (s.traces.client_key_file, s.traces.client_certificate_file) == ("/t.key", "/t.pem")
    assert (s.metrics.endpoint, s.metrics.protocol, s.metrics.headers, s.metrics.timeout_s,
            s.metrics.compression, s.metrics.certificate_file, s.metrics.client_key_file) == \
        ("https://metrics.example:4317", "grpc", (("x-which", "metrics"),), 0.7, "gzip", "/metrics-ca.pem", None)
    assert s.metrics.grpc_target == "metrics.example:4317" and s.metrics.uses_tls


@pytest.mark.parametrize("raw,url", [
    ("http://c:4318/v1/traces", "http://c:4318/v1/traces"),   # used as it is
    ("http://c:4318/custom", "http://c:4318/custom"),         # no /v1/traces appended
    ("http://c:4318", "http://c:4318/"),                      # only an empty path becomes /
])
def test_a_per_signal_http_endpoint_is_used_as_is(raw, url):
    s = resolve_settings(environ={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": raw,
                                  "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert s.traces.endpoint == url


def test_only_a_traces_endpoint_starts_export_and_metrics_take_the_spec_default():
    grpc_only = resolve_settings(environ={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317"})
    assert grpc_only.traces.endpoint == "http://t:4317"
    assert grpc_only.metrics.endpoint == "http://localhost:4317"
    http_only = resolve_settings(environ={"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://m:4318/v1/metrics",
                                          "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert http_only.traces.endpoint == "http://localhost:4318/v1/traces"
    assert http_only.metrics.endpoint == "http://m:4318/v1/metrics"


def test_no_endpoint_anywhere_is_no_export_and_the_argument_wins_over_the_environment():
    assert resolve_settings(environ={}) is None
    assert resolve_settings(environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) is None
    s = resolve_settings("http://h:1", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:2",
                                                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://other:3"})
    assert (s.traces.endpoint, s.metrics.endpoint) == ("http://h:1", "http://h:1")


def test_defaults_are_grpc_plaintext_for_http_urls_with_phase_spans():
    s = resolve_settings(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    t = s.traces
    assert (t.endpoint, t.protocol, t.timeout_s, t.compression, t.uses_tls, t.grpc_target) == \
        ("http://collector:4317", "grpc", 10.0, "none", False, "collector:4317")
    assert s.metrics == t and s.phase_spans
    assert (s.queue_size, s.max_batch, s.export_interval_s, s.telemetry_interval_s) == (8192, 512, 1.0, 10.0)


def test_the_scheme_decides_tls_and_insecure_only_decides_a_scheme_less_grpc_endpoint():
    # The spec: https is secure and http insecure whatever OTEL_EXPORTER_OTLP_INSECURE says;
    # a scheme-less gRPC endpoint is secure unless INSECURE is true. (TraceML used to prefix
    # http:// to a scheme-less endpoint, i.e. plaintext, and let INSECURE override the scheme.)
    def tls(endpoint, **env):
        return resolve_settings(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **env}).traces.uses_tls
    assert tls("https://c:4317", OTEL_EXPORTER_OTLP_INSECURE="true")
    assert not tls("http://c:4317", OTEL_EXPORTER_OTLP_INSECURE="false")
    assert tls("collector:4317")
    assert not tls("collector:4317", OTEL_EXPORTER_OTLP_INSECURE="true")
    assert tls("collector:4317", OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_EXPORTER_OTLP_TRACES_INSECURE="false")
    s = resolve_settings(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"})
    assert s.traces.grpc_target == "collector:4317"


@pytest.mark.parametrize("variable,raw,read", [
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon", lambda s: s.traces.protocol == "grpc"),
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd", lambda s: s.traces.compression == "none"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "soon", lambda s: s.traces.timeout_s == 10.0),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "-5", lambda s: s.traces.timeout_s == 10.0),
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "1.5", lambda s: s.metrics.timeout_s == 10.0),
    ("OTEL_EXPORTER_OTLP_INSECURE", "yes", lambda s: s.traces.insecure is False),
    ("TRACEML_EXPORT_QUEUE_SIZE", "-3", lambda s: s.queue_size == 8192),
    ("OTEL_BSP_MAX_QUEUE_SIZE", "0", lambda s: s.queue_size == 8192),
    ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "many", lambda s: s.max_batch == 512),
    ("OTEL_BSP_SCHEDULE_DELAY", "-1", lambda s: s.export_interval_s == 1.0),
    ("OTEL_METRIC_EXPORT_INTERVAL", "1m", lambda s: s.telemetry_interval_s == 10.0),
    ("OTEL_BSP_EXPORT_TIMEOUT", "x", lambda s: s.traces.timeout_s == 10.0),
])
def test_an_invalid_value_is_warned_about_once_and_ignored(variable, raw, read, caplog):
    # The old behaviour (ValueError, so no export for the run) broke the spec's rule:
    # a value that cannot be parsed is warned about and treated as unset.
    env = {variable: raw}
    with caplog.at_level(logging.WARNING):
        first = resolve_settings(LOCAL, environ=env)
        second = resolve_settings(LOCAL, environ=env)
    assert first is not None and read(first) and first == second
    [message] = _warnings(caplog)
    assert variable in message and "ignored" in message


def test_an_invalid_per_signal_value_falls_back_to_the_generic_one(caplog):
    with caplog.at_level(logging.WARNING):
        s = resolve_settings(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://generic:4317",
                                      "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "ftp://nope",
                                      "OTEL_EXPORTER_OTLP_TIMEOUT": "3000",
                                      "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "later"})
    assert (s.traces.endpoint, s.traces.timeout_s) == ("http://generic:4317", 3.0)
    assert len(_warnings(caplog)) == 2


def test_an_invalid_only_endpoint_is_no_export_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve_settings(environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318",
                                         "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) is None
    assert any("OTEL_EXPORTER_OTLP_ENDPOINT" in m for m in _warnings(caplog))


def test_http_json_is_sent_as_http_protobuf_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        s = resolve_settings("http://c:4318", environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "HTTP/JSON"})
    assert (s.traces.protocol, s.traces.endpoint) == ("http/protobuf", "http://c:4318/v1/traces")
    assert len(_warnings(caplog)) == 1


def test_batch_processor_and_metric_reader_variables_map_onto_the_exporter():
    s = resolve_settings(LOCAL, environ={
        "OTEL_BSP_MAX_QUEUE_SIZE": "4096", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "64",
        "OTEL_BSP_SCHEDULE_DELAY": "250", "OTEL_METRIC_EXPORT_INTERVAL": "30000",
        "OTEL_BSP_EXPORT_TIMEOUT": "2000", "OTEL_METRIC_EXPORT_TIMEOUT": "60000",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "5000"})
    assert (s.queue_size, s.max_batch, s.export_interval_s, s.telemetry_interval_s) == (4096, 64, 0.25, 30.0)
    # Each export stops at the shorter of the exporter's and the processor's / reader's timeout.
    assert (s.traces.timeout_s, s.metrics.timeout_s, s.timeout_s) == (2.0, 5.0, 5.0)


def test_traceml_queue_size_wins_over_the_batch_processor_and_a_batch_above_the_queue_is_ignored(caplog):
    with caplog.at_level(logging.WARNING):
        s = resolve_settings(LOCAL, environ={"TRACEML_EXPORT_QUEUE_SIZE": "100", "OTEL_BSP_MAX_QUEUE_SIZE": "4096",
                                             "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "200"})
    assert (s.queue_size, s.max_batch) == (100, 100)
    [message] = _warnings(caplog)
    assert "OTEL_BSP_MAX_EXPORT_BATCH_SIZE" in message


def test_a_zero_timeout_means_no_limit_and_a_zero_delay_does_not_spin():
    s = resolve_settings(LOCAL, environ={"OTEL_EXPORTER_OTLP_TIMEOUT": "0", "OTEL_BSP_EXPORT_TIMEOUT": "0",
                                         "OTEL_BSP_SCHEDULE_DELAY": "0"})
    assert s.traces.timeout_s == env_values.NO_LIMIT_MS / 1000.0
    assert s.metrics.timeout_s == 30.0  # the metric reader's default still bounds metrics
    assert s.export_interval_s > 0


@pytest.mark.parametrize("raw", ["true", "TRUE", "True", " true "])
def test_otel_sdk_disabled_is_true_only_for_true(raw):
    assert sdk_disabled({"OTEL_SDK_DISABLED": raw})


@pytest.mark.parametrize("raw,warns", [("1", True), ("yes", True), ("on", True), ("false", False),
                                       ("FALSE", False), ("", False)])
def test_any_other_otel_sdk_disabled_value_leaves_export_on(raw, warns, caplog):
    # TraceML used to read 1/yes/on as true; the spec's Boolean rule forbids extending "true".
    with caplog.at_level(logging.WARNING):
        assert not sdk_disabled({"OTEL_SDK_DISABLED": raw})
    assert bool(_warnings(caplog)) is warns


def test_traceml_disable_keeps_its_own_looser_rule():
    assert all(kill_switch({"TRACEML_DISABLE": raw}) for raw in ("1", "true", "yes", "on", "ON"))
    assert not kill_switch({"TRACEML_DISABLE": "0"})


def test_start_hook_returns_none_and_logs_once_without_endpoint(caplog, monkeypatch):
    monkeypatch.setattr(start_module, "_hinted", False)
    with caplog.at_level(logging.WARNING, logger="traceml.exporter"):
        assert start_from_settings(environ={}) is None
        assert start_from_settings(environ={}) is None
    hints = [r for r in caplog.records if "OTEL_EXPORTER_OTLP_ENDPOINT" in r.getMessage()]
    assert len(hints) == 1


def test_otel_sdk_disabled_starts_nothing(receiver):
    assert start_from_settings(receiver.grpc_endpoint, environ={"OTEL_SDK_DISABLED": "true"}) is None
    exporter = start_from_settings(receiver.grpc_endpoint, run_id="enabled", environ={"OTEL_SDK_DISABLED": "1"})
    assert isinstance(exporter, OtlpStepExporter)
    assert exporter.shutdown(5.0)


def test_a_bad_setting_is_ignored_and_export_starts(receiver):
    exporter = start_from_settings(receiver.grpc_endpoint, run_id="bad-protocol",
                                   environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"})
    assert isinstance(exporter, OtlpStepExporter) and exporter.settings.traces.protocol == "grpc"
    assert exporter.shutdown(5.0) and exporter.run_end_sent


def test_a_failing_identity_never_raises_from_the_start_hook(caplog):
    with caplog.at_level(logging.ERROR, logger="traceml.exporter"):
        assert start_from_settings("http://127.0.0.1:4317", environ={"RANK": "x", "WORLD_SIZE": "2"}) is None
    assert any("not started" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("raw", ["=x", "a=1,orphan,b=2"])
def test_malformed_resource_attributes_are_discarded_whole_with_an_error_and_export_goes_on(raw, caplog):
    with caplog.at_level(logging.ERROR, logger="traceml.exporter"):
        s = resolve_settings("http://127.0.0.1:4317", environ={"OTEL_RESOURCE_ATTRIBUTES": raw})
    assert s is not None and dict(s.resource_attributes) == {}
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "OTEL_RESOURCE_ATTRIBUTES" in record.getMessage()
