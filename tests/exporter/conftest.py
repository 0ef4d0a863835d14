"""Shared set-up for the exporter tests: one real OTLP receiver per module."""
from __future__ import annotations

import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
for path in (HERE, HERE.parent):  # exporter_records, otlp_test_receiver
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from otlp_test_receiver import OtlpTestReceiver  # noqa: E402


@pytest.fixture(scope="module")
def receiver():
    with OtlpTestReceiver() as r:
        yield r


@pytest.fixture
def fresh_receiver():
    with OtlpTestReceiver() as r:
        yield r


