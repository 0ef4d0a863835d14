"""`traceml-processor --version` and `--max-concurrent-requests`, as a deployment uses them."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from traceml.processor.cli import config_from_args


@pytest.mark.slow
def test_version_prints_the_installed_package_version():
    out = subprocess.run([sys.executable, "-m", "traceml.processor.cli", "--version"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"traceml-processor {importlib.metadata.version('traceml-otel')}"


def test_max_concurrent_requests_from_flag_then_environment(monkeypatch):
    monkeypatch.delenv("TRACEML_PROCESSOR_MAX_CONCURRENT_REQUESTS", raising=False)
    assert config_from_args([])[0].max_concurrent_requests == 128
    monkeypatch.setenv("TRACEML_PROCESSOR_MAX_CONCURRENT_REQUESTS", "7")
    assert config_from_args([])[0].max_concurrent_requests == 7
    assert config_from_args(["--max-concurrent-requests", "3"])[0].max_concurrent_requests == 3
    with pytest.raises(ValueError, match="at least 1"):
        config_from_args(["--max-concurrent-requests", "0"])
