"""OTEL_EXPORTER_OTLP_HEADERS: one parser, the W3C Baggage format, the same reading on both sides."""
from __future__ import annotations

import logging

import pytest

from traceml.exporter import resolve_settings
from traceml.processor.cli import config_from_args
from traceml.schema.otlp_headers import parse_otlp_headers


def test_entries_are_trimmed_lower_cased_and_percent_decoded():
    assert parse_otlp_headers(" Authorization = Bearer%20abc ,x-tenant=ml,") == \
        (("authorization", "Bearer abc"), ("x-tenant", "ml"))


@pytest.mark.parametrize("raw", [None, "", " ", ",,"])
def test_nothing_given_is_no_headers(raw):
    assert parse_otlp_headers(raw) == ()


def test_a_value_may_be_empty_and_may_hold_an_encoded_comma_or_equals():
    assert parse_otlp_headers("a=,b=x%3Dy%2Cz") == (("a", ""), ("b", "x=y,z"))


def test_a_key_given_twice_is_kept_twice_in_order():
    assert parse_otlp_headers("k=1,k=2") == (("k", "1"), ("k", "2"))


@pytest.mark.parametrize("bad", ["Bearer%20secret", "=orphan", "bad key=v", "k=line%0Abreak"])
def test_a_malformed_entry_is_logged_without_its_text_and_skipped(bad, caplog):
    with caplog.at_level(logging.WARNING, logger="traceml.schema.otlp_headers"):
        assert parse_otlp_headers(f"a=1,{bad},b=2") == (("a", "1"), ("b", "2"))
    [record] = caplog.records
    assert "OTEL_EXPORTER_OTLP_HEADERS" in record.getMessage() and "entry 2" in record.getMessage()
    assert "secret" not in record.getMessage() and "orphan" not in record.getMessage()


def test_exporter_and_processor_read_the_same_value_the_same_way(monkeypatch):
    raw = "X-Tenant=a%20b,not-a-pair,authorization=Bearer%20t"
    settings = resolve_settings("http://127.0.0.1:4317", environ={"OTEL_EXPORTER_OTLP_HEADERS": raw})
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", raw)
    config, _ = config_from_args(["--db", "x.db", "--export-endpoint", "http://127.0.0.1:4318/v1/metrics"])
    assert settings.traces.headers == settings.metrics.headers == (("x-tenant", "a b"), ("authorization", "Bearer t"))
    assert config.export.headers == dict(settings.traces.headers)
