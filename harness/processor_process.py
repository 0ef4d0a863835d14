"""`traceml-processor` as a real subprocess: the CLI a deployment runs, on loopback.

One class for the tests and the benchmarks that need the processor in its own
process (to kill it with SIGKILL, restart it on the same address and database,
measure its RSS and CPU, or let a real Prometheus scrape it). Tests that only need
a processor use the in-process service instead (`harness.processor_service`).

Ports left at 0 are chosen by the processor and read from its ready line; a
restart reuses the ports of the first start, so senders keep their address.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Iterable, Mapping

from harness.waiting import wait_until

READY_LINE = re.compile(r"traceml-processor ready grpc=(\d+|None) http=(\d+) prometheus=(\S+)")


class ProcessorProcess:
    """`python -m traceml.processor.cli` with its database and logs in `folder`.

    Args:
        folder: working directory, database, summaries and one log per start.
        grpc_port, http_port, prometheus_port: 0 (default) lets the processor pick; grpc_port
            None: no OTLP gRPC listener (`--otlp-grpc off`, as a one-node `traceml run` has it).
        extra_args: further CLI flags, after the defaults (so they win).
        env: added to the inherited environment, from which OTEL_* and TRACEML_*
            are removed so the caller's settings cannot leak into the processor.
        db: the database file (default `folder/traceml.db`).
        summary_dir: where ended runs' summaries go; None: no `--summary-dir`.
    """

    def __init__(self, folder: Path, *, grpc_port: int | None = 0, http_port: int = 0, prometheus_port: int = 0,
                 extra_args: Iterable[str] = (), env: Mapping[str, str] | None = None,
                 db: Path | None = None, summary_dir: Path | None | bool = True):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.db = Path(db) if db is not None else self.folder / "traceml.db"
        self.summary_dir = self.folder / "summaries" if summary_dir is True else (summary_dir or None)
        self.grpc, self.http, self.prom = grpc_port, http_port, prometheus_port
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._log = None

    @property
    def log_path(self) -> Path:
        return self.folder / f"processor-{self.starts}.log"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "traceml.processor.cli", "--db", str(self.db),
               "--otlp-grpc", "off" if self.grpc is None else f"127.0.0.1:{self.grpc}",
               "--otlp-http", f"127.0.0.1:{self.http}",
               "--prometheus", f"127.0.0.1:{self.prom}", "--export-endpoint", "off"]
        if self.summary_dir is not None:
            cmd += ["--summary-dir", str(self.summary_dir)]
        return cmd + self.extra_args

    def start(self, timeout_s: float = 60.0, *, wait_readyz: bool = False) -> "ProcessorProcess":
        """Start and wait for the ready line; `wait_readyz`: also for `/readyz` to answer 200."""
        self.starts += 1
        env = {k: val for k, val in os.environ.items() if not k.startswith(("OTEL_", "TRACEML_"))}
        env.update(self.env)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=self.folder)
        wait_until(lambda: READY_LINE.search(self.log_text()) or self.proc.poll() is not None, timeout_s, 0.01)
        match = READY_LINE.search(self.log_text())
        if match is None:
            self.stop()
            raise RuntimeError(f"processor did not start: {self.log_text()}")
        grpc, http, prom = match.groups()
        self.grpc, self.http = (int(grpc) if grpc.isdigit() else None), int(http)
        self.prom = int(prom) if prom.isdigit() else self.prom
        if wait_readyz and not wait_until(self.ready, timeout_s, 0.01):
            self.stop()
            raise RuntimeError(f"processor not ready: {self.log_text()}")
        return self

    def ready(self) -> bool:
        """`/readyz` answers 200."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/readyz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log_text(self) -> str:
        """This start's log (the latest one)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.prom}/metrics", timeout=10) as r:
            return r.read().decode()

    def rss_bytes(self) -> int:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def kill9(self) -> None:
        """SIGKILL: no shutdown path runs, as on a node failure."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()

    def stop(self) -> int:
        """SIGTERM (the graceful path), SIGKILL after 60 s; the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not None and not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ProcessorProcess":
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
