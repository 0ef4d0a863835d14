"""Processor tests: helpers live in `processor_harness` (a unique module name: several
test folders have a conftest.py, so `import conftest` would be ambiguous)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from processor_harness import make_service  # noqa: E402


@pytest.fixture
def service(tmp_path):
    svc = make_service(tmp_path)
    yield svc
    svc.stop()
