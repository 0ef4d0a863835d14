"""`traceml run` sees an endpoint the environment gives, per-signal variables included.

With one, the launcher only exports (the ranks inherit the variables as they are);
without, it starts the embedded processor. A job configured only with
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT used to get an embedded processor whose generic
endpoint then split the job's two signals between two destinations.
"""
from __future__ import annotations

import pytest

from traceml.launcher import run as launcher_run


@pytest.fixture
def clean_otlp_env(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "TRACEML_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_no_endpoint_variable_means_the_embedded_processor(clean_otlp_env):
    clean_otlp_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "  ")  # empty is unset
    assert launcher_run._environment_endpoint() is None


def test_the_generic_endpoint_is_named_as_it_is(clean_otlp_env):
    clean_otlp_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert launcher_run._environment_endpoint() == "http://collector:4317"


def test_a_per_signal_endpoint_alone_counts(clean_otlp_env):
    clean_otlp_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317")
    assert launcher_run._environment_endpoint() == "http://traces:4317 (traces)"
    clean_otlp_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://generic:4317")
    assert launcher_run._environment_endpoint() == "http://traces:4317 (traces), http://generic:4317 (metrics)"


def test_traceml_own_endpoint_variable_counts_first(clean_otlp_env):
    clean_otlp_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317")
    clean_otlp_env.setenv("TRACEML_OTLP_ENDPOINT", "http://ours:4317")
    assert launcher_run._environment_endpoint() == "http://ours:4317"
