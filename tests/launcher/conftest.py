"""Fixtures of the launcher tests (helpers live in launcher_helpers.py)."""
from pathlib import Path

import pytest


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
