"""Shared set-up for the exporter tests: one real OTLP receiver per module."""
from __future__ import annotations

import pytest

from harness.otlp_receiver import OtlpTestReceiver


@pytest.fixture(scope="module")
def receiver():
    with OtlpTestReceiver() as r:
        yield r


@pytest.fixture
def fresh_receiver():
    with OtlpTestReceiver() as r:
        yield r
