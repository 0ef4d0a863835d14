"""Issue 32 items 1-2: a slow-header flood does not lock real clients out of any HTTP port.

Before, 2,000 raw connections that dribbled header bytes held the OTLP/HTTP port's
connection cap, and a real OTLP/HTTP export got 503 for as long as the flood lasted
(the front closed only idle connections at the cap); `/metrics` ran on a thread per
connection with no cap, no TLS and no token. Now every HTTP port runs on the same
front, which at the cap closes the connection that made the least progress.

Here the real `traceml-processor`, limited to 1,024 open files, is flooded on each
port in turn (OTLP/HTTP, the web view on `--ui`, `/metrics`) by raw sockets that
open 2,000 connections, each sending a request head it never finishes, and open
again whatever the processor closes; during each flood a real client (`requests`)
must be answered within `SERVED_WITHIN_S`. The evictions are counted on `/metrics`.
Every loop is bounded by a count or a deadline, on loopback only.
"""
from __future__ import annotations

import re
import resource
import socket
import threading
import time

import pytest
import requests

from harness.otlp_payloads import steps_request
from harness.ports import free_port
from harness.stored_rows import count_rows
from tests.reliability.test_http_front import LimitedProcessor

FLOOD = 2000
NOFILE = 1024  # the processor's RLIMIT_NOFILE (soft and hard)
SERVED_WITHIN_S = 2.0
FLOOD_LIMIT_S = 30.0  # a flood stops by itself after this long, whatever the test does
PARTIAL_HEAD = b"POST /v1/traces HTTP/1.1\r\nHost: flood\r\nX-Slow: "


class SlowHeaderFlood:
    """`count` connections to `port`, each sending a head it never finishes (one more byte
    every `DRIBBLE_S`); one the server closed is opened again. Stops when told, or after
    `FLOOD_LIMIT_S`."""

    DRIBBLE_S = 0.25

    def __init__(self, port: int, count: int = FLOOD):
        self.port = port
        self.count = count
        self.socks: list[socket.socket | None] = []
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._dribble, name="slow-header-flood", daemon=True)

    def _open(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
            sock.setblocking(False)
            sock.send(PARTIAL_HEAD)
            return sock
        except OSError:
            return None

    def start(self) -> "SlowHeaderFlood":
        deadline = time.monotonic() + FLOOD_LIMIT_S / 2
        while len(self.socks) < self.count and time.monotonic() < deadline:
            self.socks.append(self._open())
        self._thread.start()
        return self

    def _dribble(self) -> None:
        deadline = time.monotonic() + FLOOD_LIMIT_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            for i, sock in enumerate(self.socks):
                if self._stop.is_set():
                    return
                try:
                    if sock is None:
                        raise OSError
                    sock.recv(4096)  # the server answered (408) or closed: open again
                    raise OSError
                except BlockingIOError:
                    try:
                        sock.send(b"a")
                        continue
                    except OSError:
                        pass
                except OSError:
                    pass
                if sock is not None:
                    sock.close()
                self.socks[i] = self._open()
                self.reopened += 1
            self._stop.wait(self.DRIBBLE_S)

    def open_now(self) -> int:
        return sum(sock is not None for sock in self.socks)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for sock in self.socks:
            if sock is not None:
                sock.close()
        self.socks.clear()


def timed(call) -> tuple[requests.Response, float]:
    started = time.monotonic()
    response = call()
    return response, time.monotonic() - started


def connection_events(prom_port: int) -> dict[str, float]:
    text = requests.get(f"http://127.0.0.1:{prom_port}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^traceml_processor_http_connection_events_total\{traceml_connection_event="(\w+)"\} (\S+)$', text, re.M)}


@pytest.mark.slow
def test_a_slow_header_flood_on_each_http_port_leaves_real_clients_served_at_the_file_limit(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FLOOD + 500:
        if hard != resource.RLIM_INFINITY and hard < FLOOD + 500:
            pytest.skip(f"this test process may open {hard} descriptors; the flood needs {FLOOD + 500}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (FLOOD + 500, hard))
    ui = free_port()
    proc = LimitedProcessor(tmp_path, NOFILE, summary_dir=None, extra_args=["--ui", f"127.0.0.1:{ui}"])
    proc.start(wait_readyz=True)
    body = steps_request("real-sender", 0, range(2)).SerializeToString()
    doors = {
        "otlp_http": (proc.http, lambda: requests.post(
            f"http://127.0.0.1:{proc.http}/v1/traces", data=body, timeout=10,
            headers={"Content-Type": "application/x-protobuf"})),
        "web_view": (ui, lambda: requests.get(f"http://127.0.0.1:{ui}/ui/", timeout=10)),
        "metrics": (proc.prom, lambda: requests.get(f"http://127.0.0.1:{proc.prom}/metrics", timeout=10)),
    }
    waited: dict[str, list[float]] = {}
    try:
        for door, (port, call) in doors.items():
            flood = SlowHeaderFlood(port).start()
            try:
                assert flood.open_now() >= FLOOD * 0.9, f"{door}: only {flood.open_now()} flood connections opened"
                times = []
                for _ in range(2):  # real requests while the flood holds the port
                    response, took = timed(call)
                    assert response.status_code == 200, (door, response.status_code, response.text[:200])
                    times.append(took)
                    time.sleep(0.2)
                waited[door] = times
            finally:
                flood.stop()
        events = connection_events(proc.prom)
        assert proc.proc.poll() is None
    finally:
        proc.stop()
    print("seconds to an answer during the flood:", {d: [round(t, 3) for t in ts] for d, ts in waited.items()})
    print("connection events:", {k: v for k, v in events.items() if v})
    for door, times in waited.items():
        assert max(times) < SERVED_WITHIN_S, (door, times)
    assert count_rows(proc.db, run_id="real-sender") == 2
    assert events["evicted_slow_head"] >= FLOOD, events  # each flood filled its cap and pushed past it
    assert "Traceback" not in proc.log_text()
