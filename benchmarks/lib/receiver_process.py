"""A count-only OTLP receiver in its own process, for benchmarks that time the sending side.

Its decoding runs in the child, so it is never counted as the exporter's CPU.
"""
from __future__ import annotations

import subprocess

from harness.child_python import child_env, module_command


class ReceiverProcess:
    """`harness.otlp_receiver` in its own process: `counts()` asks it how many spans and points
    it took so far; `close()` ends it."""

    def __init__(self):
        self.proc = subprocess.Popen(module_command("harness.otlp_receiver"), env=child_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        grpc_port, http_port = self.proc.stdout.readline().split()
        self.grpc = f"http://127.0.0.1:{grpc_port}"
        self.http = f"http://127.0.0.1:{http_port}"

    def counts(self) -> tuple[int, int]:
        self.proc.stdin.write("counts\n")
        self.proc.stdin.flush()
        spans, points = self.proc.stdout.readline().split()
        return int(spans), int(points)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)
