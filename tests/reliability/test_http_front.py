"""The OTLP/HTTP front under hostile traffic: the real processor, attacked over loopback with raw sockets.

Each attack is one the old `http.server` front lost to (issue 18, "HTTP front"):
a malformed chunked body whose remaining bytes were parsed and stored as a second
request; a stalled head or body held a thread forever; a flood of idle
connections reached the descriptor limit, after which neither port answered and
the accept loop spun a core; a client hanging up early cost a traceback. The
settings go in by environment (TRACEML_PROCESSOR_HTTP_*), so the same test runs
against an older processor and fails on the behaviour, not on a flag. Every
loop is bounded by a count or a deadline.
"""
from __future__ import annotations

import http.client
import resource
import socket
import sys
import time

import grpc
import psutil
import pytest

from harness import ProcessorProcess, wait_until
from harness.stored_rows import count_rows
from harness.otlp_payloads import steps_request

TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
TIMEOUT_S = 1.0  # header and body timeout of the shared processor
FRONT_ENV = {"TRACEML_PROCESSOR_HTTP_HEADER_TIMEOUT": str(TIMEOUT_S),
             "TRACEML_PROCESSOR_HTTP_BODY_TIMEOUT": str(TIMEOUT_S),
             "TRACEML_PROCESSOR_HTTP_MAX_CONNECTIONS": "16"}


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    proc = ProcessorProcess(tmp_path_factory.mktemp("http-front"), env=FRONT_ENV, summary_dir=None,
                            extra_args=["--log-level", "DEBUG", "--max-concurrent-requests", "2"])
    proc.start(wait_readyz=True)
    yield proc
    proc.stop()


def raw(port: int, timeout_s: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, bool]:
    """Everything the server sends within `limit_s`; True if it closed the connection by then."""
    data, deadline = b"", time.monotonic() + limit_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            break
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def otlp_post(run_id: str, rank: int = 0, steps=range(2)) -> bytes:
    body = steps_request(run_id, rank, steps).SerializeToString()
    return (b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def http_export(port: int, run_id: str, rank: int = 0) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v1/traces", body=steps_request(run_id, rank, range(2)).SerializeToString(),
                     headers={"Content-Type": "application/x-protobuf"})
        return conn.getresponse().status
    finally:
        conn.close()


def grpc_export(port: int, run_id: str, rank: int = 0) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        channel.unary_unary(TRACE_METHOD)(steps_request(run_id, rank, range(2)).SerializeToString(), timeout=10)


def log_lines(proc: ProcessorProcess, needle: str) -> int:
    return sum(needle in line for line in proc.log_text().splitlines())


@pytest.mark.slow
def test_a_malformed_chunk_is_answered_and_the_rest_never_becomes_a_request(processor):
    smuggled = otlp_post("smuggled")
    attack = (b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
              b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + smuggled)
    both = (b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + otlp_post("smuggled-cl-te"))
    for payload in (attack, both):
        with raw(processor.http) as sock:
            sock.sendall(payload)
            answer, closed = read_until_closed(sock, 3.0)
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
        assert answer.count(b"HTTP/1.1 ") == 1, answer  # one answer: nothing after the error was parsed
        assert closed, "the connection stayed open after a framing error"
    assert http_export(processor.http, "after-smuggling") == 200  # a later request, after any smuggled one
    assert count_rows(processor.db, run_id="after-smuggling") == 2
    assert count_rows(processor.db, run_id="smuggled") == 0
    assert count_rows(processor.db, run_id="smuggled-cl-te") == 0


@pytest.mark.slow
def test_a_stalled_head_is_closed_and_a_stalled_body_answered_408_within_the_timeouts(processor):
    with raw(processor.http) as silent, raw(processor.http) as head, raw(processor.http) as body:
        head.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        body.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                     b"Content-Length: 1000\r\n\r\n0123456789")  # 10 bytes of 1,000, then nothing
        limit = TIMEOUT_S + 4.0  # the timeout, plus room for a loaded machine
        silent_answer, silent_closed = read_until_closed(silent, limit)
        head_answer, head_closed = read_until_closed(head, limit)
        body_answer, body_closed = read_until_closed(body, limit)
    assert silent_closed and silent_answer == b""  # nothing sent: closed without a word
    assert head_closed and head_answer.startswith(b"HTTP/1.1 408")
    assert body_closed and body_answer.startswith(b"HTTP/1.1 408")
    # The stalled body held an admission slot (the limit is 2): it is free again.
    assert http_export(processor.http, "after-stall") == 200 and http_export(processor.http, "after-stall", 1) == 200


def test_at_the_connection_cap_heads_still_arriving_make_room_for_a_real_client(processor):
    """Issue 32: connections that began a head and never finish it no longer hold the cap
    against a real sender (it got 503 for as long as they stayed): the one waiting longest is
    closed, counted as evicted_slow_head, and the newcomer is served."""
    before = log_lines(processor, "HTTP evicted_slow_head")
    held = []
    try:
        for _ in range(16):  # the cap: each has begun a request, so none is idle
            sock = raw(processor.http)
            sock.sendall(b"POST /v1/traces HTTP/1.1\r\n")
            held.append(sock)
        time.sleep(0.2)  # let the front account for all of them
        assert http_export(processor.http, "past-slow-heads") == 200
        answer, closed = read_until_closed(held[0], 3.0)  # the oldest head was closed to make room
        assert closed and answer == b"", answer[:300]
    finally:
        for sock in held:
            sock.close()
    assert count_rows(processor.db, run_id="past-slow-heads") == 2
    assert wait_until(lambda: log_lines(processor, "HTTP evicted_slow_head") == before + 1, 5, 0.05)


@pytest.mark.slow
def test_at_the_cap_with_every_connection_being_answered_the_newcomer_gets_503_with_retry_after():
    """Nothing to close (every open connection is being answered): 503, Retry-After, closed."""
    import threading

    from traceml.processor.http_front import Accept, HttpFront, HttpLimits, Reply
    from traceml.processor.listener import ServerThread

    release = threading.Event()
    entered = threading.Semaphore(0)

    def busy(_body: bytes) -> Reply:
        entered.release()
        release.wait(10)
        return Reply(200, b"done\n")

    front = HttpFront(("127.0.0.1", 0), lambda head: Accept(handle=busy, error=lambda c, m: Reply(c)),
                      limits=HttpLimits(max_connections=2), pool_size=2)
    server = ServerThread(front, "127.0.0.1", "test-front")
    server.start()
    held = []
    try:
        for _ in range(2):
            sock = raw(server.port)
            sock.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            held.append(sock)
        assert entered.acquire(timeout=5) and entered.acquire(timeout=5)  # both being answered
        with raw(server.port) as extra:
            extra.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            answer, closed = read_until_closed(extra, 3.0)
        assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer and closed, answer[:300]
        assert front.events()["refused_at_cap"] == 1
        release.set()
        for sock in held:
            assert read_until_closed(sock, 3.0)[0].startswith(b"HTTP/1.1 200")
    finally:
        release.set()
        for sock in held:
            sock.close()
        server.stop()


def test_idle_connections_at_the_cap_make_room_for_a_real_client(processor):
    idle = [raw(processor.http) for _ in range(16)]
    try:
        time.sleep(0.2)
        assert http_export(processor.http, "past-idle") == 200
        answer, closed = read_until_closed(idle[0], 3.0)  # the longest-idle one was closed to make room
        assert closed and answer == b""
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.slow
def test_a_client_hanging_up_early_costs_one_counted_line(processor):
    before = log_lines(processor, "hung_up")
    with raw(processor.http) as sock:
        sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                     b"Content-Length: 100000\r\n\r\n" + b"\0" * 10)
        time.sleep(0.1)
    assert wait_until(lambda: log_lines(processor, "hung_up") == before + 1, 5, 0.05)
    time.sleep(0.3)
    assert log_lines(processor, "hung_up") == before + 1
    assert "Traceback" not in processor.log_text()


class LimitedProcessor(ProcessorProcess):
    """The processor CLI with a low RLIMIT_NOFILE (soft and hard), set in the child before it imports."""

    def __init__(self, folder, nofile: int, **kwargs):
        super().__init__(folder, **kwargs)
        self.nofile = nofile

    def command(self) -> list[str]:
        cmd = super().command()
        assert cmd[1:3] == ["-m", "traceml.processor.cli"]
        boot = (f"import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({self.nofile}, "
                f"{self.nofile})); sys.argv[0] = 'traceml-processor'; "
                "runpy.run_module('traceml.processor.cli', run_name='__main__', alter_sys=True)")
        return [sys.executable, "-c", boot, *cmd[3:]]


def cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


@pytest.mark.slow
def test_an_idle_flood_past_the_descriptor_limit_leaves_both_ports_serving_and_the_process_quiet(tmp_path):
    nofile = 256
    flood = 600  # well past the child's descriptor limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < flood + 200:
        pytest.skip(f"this test process may open {soft} descriptors; the flood needs {flood + 200}")
    proc = LimitedProcessor(tmp_path, nofile, summary_dir=None,
                            env={"TRACEML_PROCESSOR_HTTP_HEADER_TIMEOUT": "60"})  # the flood stays put
    proc.start(wait_readyz=True)
    socks = []
    try:
        for _ in range(flood):
            try:
                socks.append(socket.create_connection(("127.0.0.1", proc.http), timeout=2))
            except OSError:
                break  # the backlog is full: the flood is as big as this machine lets it be
        time.sleep(1.0)  # the processor accepts (or cannot) what it can
        # A real client on each port, while the flood is held open.
        grpc_export(proc.grpc, "flood-grpc")
        assert count_rows(proc.db, run_id="flood-grpc") == 2
        assert http_export(proc.http, "flood-http") == 200
        assert count_rows(proc.db, run_id="flood-http") == 2
        # Idle, with the flood still open: the process must not spin (a count of CPU-seconds, not a timing).
        time.sleep(0.5)
        before = cpu_s(proc.proc.pid)
        time.sleep(3.0)
        used = cpu_s(proc.proc.pid) - before
        assert used < 0.3, f"{used:.2f} CPU-seconds in 3 idle seconds: the process spins"
        assert proc.proc.poll() is None
    finally:
        for sock in socks:
            sock.close()
        proc.stop()
    assert "Traceback" not in proc.log_text()


@pytest.mark.slow
def test_at_emfile_the_http_port_waits_quietly_and_both_ports_serve_once_descriptors_return(tmp_path):
    nofile = 256
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2 * nofile + 200:
        pytest.skip(f"this test process may open {soft} descriptors; the flood needs {2 * nofile + 200}")
    proc = LimitedProcessor(tmp_path, nofile, summary_dir=None)
    proc.start(wait_readyz=True)
    socks = []
    try:
        # Raw TCP to the gRPC port takes the process's last descriptors (grpcio holds them until its
        # handshake deadline); then HTTP connections wait in the backlog and accept() fails with EMFILE.
        for _ in range(nofile + 50):
            socks.append(socket.create_connection(("127.0.0.1", proc.grpc), timeout=2))
        assert wait_until(lambda: psutil.Process(proc.proc.pid).num_fds() >= nofile, 10, 0.05)
        for _ in range(20):
            socks.append(socket.create_connection(("127.0.0.1", proc.http), timeout=2))
        time.sleep(1.0)
        before = cpu_s(proc.proc.pid)
        time.sleep(3.0)
        used = cpu_s(proc.proc.pid) - before
        assert used < 0.3, f"{used:.2f} CPU-seconds in 3 seconds at the descriptor limit: the process spins"
        for sock in socks:
            sock.close()
        socks.clear()
        # Descriptors back: both ports serve again, with no restart.
        assert wait_until(lambda: psutil.Process(proc.proc.pid).num_fds() < nofile - 50, 10, 0.1)
        grpc_export(proc.grpc, "after-emfile")
        assert wait_until(lambda: http_export(proc.http, "after-emfile", 1) == 200, 10, 0.2)
        assert count_rows(proc.db, run_id="after-emfile") == 4
        assert log_lines(proc, "cannot accept (Too many open files)") <= 1  # one line per 10 s, not one per try
    finally:
        for sock in socks:
            sock.close()
        proc.stop()
