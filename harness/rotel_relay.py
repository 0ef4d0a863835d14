"""`rotel-agent` (PyPI `rotel`, a Rust OTLP agent) as a relay on loopback: a non-Python
OTLP peer the project did not write, between senders and the processor.

The binary ships inside the `rotel` wheel (a dev dependency). Its log goes to
stdout, which is kept in a file: the tests read rotel's own account of what it
retried and what it dropped from there.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from typing import Iterable

from harness.ports import free_port
from harness.waiting import wait_until

# rotel's own log lines (rotel 0.0.1a15): a retry it schedules (src/exporters/retry.rs), and
# each way it gives data up ("Exporting failed, dropping data.", "Too many batch items split,
# dropping data.", "Unable to send item while exiting, will drop data.", "Failed to encode
# request, dropping.").
RETRY_LINE = "Exporting failed, will retry again after delay."
DROP_MARKERS = ("dropping data", "will drop data", "request, dropping")


def rotel_binary() -> Path | None:
    """The `rotel-agent` inside the installed `rotel` package, else one on PATH, else None."""
    spec = importlib.util.find_spec("rotel")
    if spec is not None and spec.origin:
        candidate = Path(spec.origin).parent / "rotel-agent"
        if candidate.exists():
            return candidate
    found = shutil.which("rotel-agent")
    return Path(found) if found else None


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class RotelRelay:
    """`rotel-agent start` receiving OTLP on two free loopback ports and exporting OTLP to
    `exporter_endpoint` over `protocol` ("grpc" or "http"); `extra_args` are further flags.

    Use as a context manager; `stop()` sends SIGTERM (rotel flushes what it holds) and
    kills it if it has not exited after 20 s.
    """

    def __init__(self, folder: Path, exporter_endpoint: str, protocol: str = "grpc",
                 extra_args: Iterable[str] = ()):
        binary = rotel_binary()
        if binary is None:
            raise RuntimeError("rotel-agent is not installed (pip install rotel)")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.grpc_port, self.http_port = free_port(), free_port()
        self.log_path = self.folder / "rotel.log"
        self.argv = [str(binary), "start",
                     "--otlp-grpc-endpoint", f"127.0.0.1:{self.grpc_port}",
                     "--otlp-http-endpoint", f"127.0.0.1:{self.http_port}",
                     "--exporter", "otlp", "--otlp-exporter-endpoint", exporter_endpoint,
                     "--otlp-exporter-protocol", protocol,
                     "--pid-file", str(self.folder / "rotel.pid"),
                     "--log-file", str(self.folder / "rotel-agent.log"), *extra_args]
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def grpc_endpoint(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self, timeout_s: float = 30.0) -> "RotelRelay":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT)
        up = wait_until(lambda: self.proc.poll() is not None
                        or (_listening(self.grpc_port) and _listening(self.http_port)), timeout_s, 0.05)
        if not up or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"rotel-agent did not start: {self.log_text()}")
        return self

    def log_text(self) -> str:
        """rotel's log with its terminal colour codes removed."""
        if not self.log_path.exists():
            return ""
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))

    def log_lines(self, needle: str) -> list[str]:
        return [line for line in self.log_text().splitlines() if needle in line]

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._log is not None and not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "RotelRelay":
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
