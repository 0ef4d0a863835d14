"""The HTTP front's deadlines and its choice at the connection cap, timed: an in-process front
on loopback, driven with raw sockets.

These two decide from how fast each connection sends (a byte every 0.2 s against a 1 s chunk
deadline; which body made the least progress, 1 byte against 50,000), with margins of most of a
second that a loaded machine's scheduling does not cross, so they run beside the serial tests
(tests/serial_tests.py); the attacks on the real processor are test_http_front's.
"""
from __future__ import annotations

import time

import pytest

from tests.reliability.test_http_front import raw, read_until_closed


def _front(limits, handle=None):
    """An HttpFront on a loopback port whose one route reads the body and answers 200."""
    from traceml.processor.http_front import Accept, HttpFront, Reply
    from traceml.processor.listener import ServerThread

    def app(head):
        return Accept(handle=handle or (lambda body: Reply(200, b"%d\n" % len(body))),
                      error=lambda code, message: Reply(code, (message + "\n").encode()))

    front = HttpFront(("127.0.0.1", 0), app, limits=limits, pool_size=2)
    server = ServerThread(front, "127.0.0.1", "test-front")
    server.start()
    return front, server


@pytest.mark.slow
def test_a_body_that_pauses_longer_than_the_chunk_deadline_is_answered_408_before_the_body_deadline():
    from traceml.processor.http_front import HttpLimits

    front, server = _front(HttpLimits(body_timeout_s=20.0, body_chunk_timeout_s=1.0))
    try:
        head = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
        with raw(server.port) as steady, raw(server.port) as stalled:
            steady.sendall(head)
            stalled.sendall(head + b"0123456789")
            started = time.monotonic()
            for _ in range(10):  # a byte every 0.2 s: within the chunk deadline each time
                steady.sendall(b"x" * 10)
                time.sleep(0.2)
            answer, closed = read_until_closed(stalled, 5.0)
            assert answer.startswith(b"HTTP/1.1 408") and b"no byte of the request body for 1.0 s" in answer
            assert closed and time.monotonic() - started < 10
            assert read_until_closed(steady, 5.0)[0].startswith(b"HTTP/1.1 200")
        assert front.events()["body_timeout"] == 1
    finally:
        server.stop()


@pytest.mark.slow
def test_at_the_cap_with_every_head_complete_the_slowest_body_makes_room():
    from traceml.processor.http_front import HttpLimits

    front, server = _front(HttpLimits(max_connections=2))
    try:
        head = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
        with raw(server.port) as slow, raw(server.port) as fast:
            slow.sendall(head + b"s")
            fast.sendall(head + b"f" * 50000)
            time.sleep(1.0)  # both heads read: neither is waiting for one
            with raw(server.port) as newcomer:
                newcomer.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok")
                assert read_until_closed(newcomer, 3.0)[0].startswith(b"HTTP/1.1 200")
            assert read_until_closed(slow, 3.0) == (b"", True)  # 1 byte in 1 s: the least progress
            fast.sendall(b"f" * 50000)
            assert read_until_closed(fast, 3.0)[0].startswith(b"HTTP/1.1 200")
        events = front.events()
        assert (events["evicted_slow_body"], events["refused_at_cap"], events["hung_up"]) == (1, 0, 0), events
    finally:
        server.stop()
