"""The embedded `traceml-processor`: a child process on free loopback ports.

On the host node of a multi-node job (`launcher/multinode.py`) its OTLP gRPC
receiver listens on the rendezvous host's address and a fixed port instead, and
its OTLP/HTTP (deep-capture control, uploads, `/readyz`) on the same address and
the next port, so every node's ranks reach both.

A child process rather than a thread keeps the processor's GIL time (OTLP
decoding, SQLite commits, analysis) away from the launcher's elastic agent, and
lets `traceml run` stop it with the same SIGTERM path a container would get.
Its log goes to `processor.log` in the run folder, not to the terminal.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .multinode import format_host

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


class EmbeddedProcessorError(RuntimeError):
    """The embedded processor did not start; the message says why and where its log is."""


LOOPBACK = "127.0.0.1"


def _base_url(host: str, port: int) -> str:
    return f"http://{format_host(host)}:{port}"


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True, slots=True)
class ProcessorEndpoints:
    grpc_port: int | None  # None: no OTLP gRPC listener (a one-node run's processor)
    http_port: int
    ui: tuple[str, int] | None = None  # the web view's address (`traceml run --ui`)
    grpc_host: str = "127.0.0.1"  # where OTLP gRPC listens
    advertised_host: str | None = None  # the name the ranks use, when not grpc_host (a 0.0.0.0 bind)
    http_host: str = LOOPBACK  # where OTLP/HTTP listens (a node's address on a multi-node host)

    @property
    def grpc_address(self) -> str:
        host = self.advertised_host or self.grpc_host
        return f"{format_host(host)}:{self.grpc_port}"

    @property
    def otlp_grpc_endpoint(self) -> str:
        return f"http://{self.grpc_address}"

    @property
    def http_address(self) -> str:
        """OTLP/HTTP's host:port as the ranks use it (`control_url`'s)."""
        return self.control_url.removeprefix("http://")

    @property
    def ready_url(self) -> str:
        """Asked by the launcher on this machine: a wildcard bind is reached through loopback."""
        host = {"0.0.0.0": LOOPBACK, "::": "::1"}.get(self.http_host, self.http_host)
        return f"{_base_url(host, self.http_port)}/readyz"

    @property
    def control_url(self) -> str:
        """The OTLP/HTTP base URL the ranks poll for capture requests (`TRACEML_CONTROL_ENDPOINT`):
        loopback on one node, the name every node's ranks use on a multi-node host."""
        host = self.http_host if self.http_host == LOOPBACK else (self.advertised_host or self.http_host)
        return _base_url(host, self.http_port)

    def ui_url(self, run_id: str | None = None) -> str | None:
        """The web view's address (its page of `run_id` when given); None without --ui."""
        if self.ui is None:
            return None
        from urllib.parse import quote

        base = f"{_base_url(*self.ui)}/ui/"
        return base if run_id is None else f"{base}run?id={quote(run_id, safe='')}"


class EmbeddedProcessor:
    """Start with `start()`, point ranks at `endpoints`, `stop()` when they are done."""

    def __init__(self, db_path: Path, summary_dir: Path, log_path: Path,
                 ui: tuple[str, int] | None = None, grpc_bind: tuple[str, int] | None = None,
                 advertised_host: str | None = None, auth_token_file: Path | None = None,
                 http_bind: tuple[str, int] | None = None, grpc: bool = True) -> None:
        self.db_path = Path(db_path)
        self.summary_dir = Path(summary_dir)
        self.log_path = Path(log_path)
        self.ui = ui  # serve the web view here; port 0 = a free loopback port
        self.grpc = grpc  # listen for OTLP gRPC at all: not when every rank sends OTLP/HTTP
        self.grpc_bind = grpc_bind  # (host, port) for OTLP gRPC; None = a free loopback port
        self.http_bind = http_bind  # (host, port) for OTLP/HTTP; None = a free loopback port
        self.advertised_host = advertised_host
        self.auth_token_file = auth_token_file  # --auth-token-file for the processor
        self.endpoints: ProcessorEndpoints | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file = None

    def command(self, endpoints: ProcessorEndpoints) -> list[str]:
        command = [
            sys.executable, "-m", "traceml.processor.cli",
            "--db", str(self.db_path),
            "--otlp-grpc", "off" if endpoints.grpc_port is None
            else f"{format_host(endpoints.grpc_host)}:{endpoints.grpc_port}",
            "--otlp-http", f"{format_host(endpoints.http_host)}:{endpoints.http_port}",
            "--summary-dir", str(self.summary_dir),
        ]
        if endpoints.ui is not None:
            host, port = endpoints.ui
            command += ["--ui", f"{format_host(host)}:{port}"]
        if self.auth_token_file is not None:
            command += ["--auth-token-file", str(self.auth_token_file)]
        return command

    def start(self, ready_timeout_s: float = READY_TIMEOUT_S) -> ProcessorEndpoints:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        grpc_host, grpc_port = self.grpc_bind or ("127.0.0.1", free_loopback_port() if self.grpc else None)
        http_host, http_port = self.http_bind or (LOOPBACK, free_loopback_port())
        while http_port == grpc_port and self.http_bind is None:
            http_port = free_loopback_port()
        ui = None
        if self.ui is not None:
            host, port = self.ui
            while not port or port in (grpc_port, http_port):
                port = free_loopback_port()
            ui = (host, port)
        endpoints = ProcessorEndpoints(grpc_port, http_port, ui, grpc_host, self.advertised_host, http_host)
        self._log_file = open(self.log_path, "ab")
        child_env = dict(os.environ)
        # The processor must not export its own summary metrics to the endpoint the
        # ranks use, and must never pick up the user's collector from the environment.
        for name in list(child_env):
            if name.startswith("OTEL_EXPORTER_OTLP"):
                del child_env[name]
        self._proc = subprocess.Popen(
            self.command(endpoints), stdout=self._log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=child_env, start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        deadline = time.monotonic() + ready_timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                self._close_log()
                raise EmbeddedProcessorError(
                    f"the embedded traceml-processor exited with code {code} during start-up; "
                    f"see {self.log_path}")
            if _is_ready(endpoints.ready_url):
                break
            if time.monotonic() > deadline:
                self.stop()
                raise EmbeddedProcessorError(
                    f"the embedded traceml-processor was not ready after {ready_timeout_s:.0f} s; "
                    f"see {self.log_path}")
            time.sleep(0.1)
        self.endpoints = endpoints
        return endpoints

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM (the processor flushes and commits), then SIGKILL after the timeout."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            except ProcessLookupError:
                pass
        self._close_log()
        return proc.returncode

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _die_with_parent() -> None:
    """Linux: SIGTERM the processor if the launcher dies without stopping it (e.g. SIGKILL).

    The processor then summarises the open run and exits instead of lingering.
    """
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except Exception:
        pass


def _is_ready(url: str) -> bool:
    # Never through a proxy of the environment: the processor is on this machine (a node's own
    # address on a multi-node host, which NO_PROXY rarely lists).
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
