"""The processor service in the test's own process, on free loopback ports, with a real SQLite file.

Faster than `ProcessorProcess` and inspectable (its receivers, workers and store are
attributes); a test that must kill or restart the processor uses the subprocess instead.
What it stored is read back with `harness.stored_rows`.
"""
from __future__ import annotations

from pathlib import Path

from traceml.processor.service import ProcessorConfig, ProcessorService


def make_service(tmp_path: Path, **overrides) -> ProcessorService:
    config = ProcessorConfig(db=tmp_path / "traceml.db", otlp_grpc=("127.0.0.1", 0),
                             otlp_http=("127.0.0.1", 0), prometheus=("127.0.0.1", 0),
                             summary_dir=tmp_path / "summaries", refresh_interval_s=0.2)
    for key, value in overrides.items():
        setattr(config, key, value)
    return ProcessorService(config).start()
