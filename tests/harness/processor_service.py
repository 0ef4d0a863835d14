"""The processor service in the test's own process, on free loopback ports, with a real SQLite file.

Faster than `ProcessorProcess` and inspectable (its receivers, workers and store are
attributes); a test that must kill or restart the processor uses the subprocess instead.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path

from traceml.processor.service import ProcessorConfig, ProcessorService


def make_service(tmp_path: Path, **overrides) -> ProcessorService:
    config = ProcessorConfig(db=tmp_path / "traceml.db", otlp_grpc=("127.0.0.1", 0),
                             otlp_http=("127.0.0.1", 0), prometheus=("127.0.0.1", 0),
                             summary_dir=tmp_path / "summaries", refresh_interval_s=0.2)
    for key, value in overrides.items():
        setattr(config, key, value)
    return ProcessorService(config).start()


def count_rows(db: Path, table: str = "step_time_samples", run_id: str | None = None) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        if run_id is None:
            return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        return conn.execute(f"SELECT count(*) FROM {table} WHERE run_id = ?", (run_id,)).fetchone()[0]
    finally:
        conn.close()
