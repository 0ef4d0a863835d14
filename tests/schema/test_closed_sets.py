"""Closed sets of public strings: the `Literal` type and the tuple name the same values, in order."""
from __future__ import annotations

from typing import get_args

from traceml.schema import diagnosis as d
from traceml.schema import vocabulary as v


def test_severity_literal_is_the_severities_in_ascending_order():
    assert get_args(d.Severity) == d.SEVERITIES == ("info", "warn", "crit")


def test_signal_literal_is_the_otlp_signals():
    assert get_args(v.Signal) == v.SIGNALS == ("traces", "metrics", "logs")
