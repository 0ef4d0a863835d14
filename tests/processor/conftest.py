"""Processor tests: the in-process service per test (`harness.processor_service`)."""
from __future__ import annotations

import pytest

from harness.processor_service import make_service


@pytest.fixture
def service(tmp_path):
    svc = make_service(tmp_path)
    yield svc
    svc.stop()
