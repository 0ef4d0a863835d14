"""The bounded HTTP/1.1 front the OTLP/HTTP receiver, the health checks and the web view run on.

`HttpFront` is the HTTP/1.1 server for traffic from the network. `http.server` is
unfit for that (Python's docs say so, and it showed: no read timeouts, one thread
per connection with no cap, a framing error left the connection open so the rest
of the bytes were parsed as a second request, and at the descriptor limit its
accept loop spun a core). Here the parsing is h11's (a maintained, strict HTTP/1.1
state machine) and the I/O is one asyncio loop on its own thread, so an idle or
slow connection costs a small object rather than a thread, and every wait has a
deadline:

- the request head must be complete `header_timeout_s` after the connection
  opens (TLS handshake included) or after its first byte on a kept-alive
  connection; a kept-alive connection may wait `keepalive_timeout_s` for that byte;
- the whole body must arrive within `body_timeout_s` of the head, with no gap
  between its bytes longer than `body_chunk_timeout_s`, and an answer the client
  does not read is dropped after `body_timeout_s`;
- at most `max_connections` are open (clamped below the process's descriptor
  limit, so the gRPC port, SQLite and the logs always have descriptors left). At
  the cap, room is made for the newcomer by closing the connection that made the
  least progress: first one with no complete request head (none at all, or one
  still arriving: a real client sends its head at once), the one waiting longest;
  else the body arriving slowest (bytes per second). Each is counted
  (`evicted_idle`, `evicted_slow_head`, `evicted_slow_body`). So a flood of slow
  or silent connections, however many, costs a real sender at most the time to
  be accepted. Only when every open connection is being answered is the
  newcomer answered 503 with `Retry-After` and closed;
- a framing error (malformed chunk, conflicting lengths, oversized head) is
  answered and the connection closed: nothing after it is read as a request;
- at EMFILE the loop pauses accepting for a second (asyncio's own back-off)
  instead of spinning, and says so in one line every 10 s.

The application is a callable the front invokes on the loop with the request
head; it answers at once (`Reply`) or asks for the body (`Accept`), whose handler
then runs in a bounded thread pool. So checks that need no body (route, bearer
token, content type, admission) refuse before any of it is read.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http import HTTPStatus
from typing import Callable, Union

import h11

from traceml.processor import settings
from traceml.processor.listener import BACKLOG, SHUTDOWN_POLL_S, bind, connection_cap
from traceml.schema import vocabulary as v

LOG = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
"""A request head larger than this is answered 431 and the connection closed."""
LINGER_S = 1.0
"""After an answer that closes the connection, how long what the client still sends is dropped."""
READ_AHEAD_BYTES = 1 << 20
"""Bytes a connection may buffer while its request is being handled before reading pauses."""
ACCEPT_BATCH = 16
"""Connections accepted per turn of the loop (asyncio accepts up to its `backlog` argument at a
time). Each holds a descriptor before the front has counted it, and one evicted to make room
holds its own until the next turn, so with `listener.BACKLOG` (128) at a time a flood reached
EMFILE (asyncio then stops accepting for a second) at a 1,024-file limit; a small batch keeps a
flood within the descriptors `connection_cap` leaves spare, and lets the heads already
received be read between batches."""
SHUTDOWN_GRACE_S = 2.0
"""How long `shutdown()` lets requests in progress finish before their connections are cut."""
_EMFILE_LOG_EVERY_S = 10.0


# --- what the application sees and answers ------------------------------------------------


@dataclass(frozen=True)
class RequestHead:
    """One request's line and headers (names lower-case; the first of repeated headers wins)."""

    method: str
    path: str
    query: str
    headers: dict[str, str]


@dataclass(frozen=True)
class Reply:
    """A complete answer. For HEAD the body is left out and its length still sent."""

    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Accept:
    """Read the body (up to the front's cap), then call `handle(body)` on a pool thread.

    Args:
        handle: turns the body into the answer; runs off the loop, so it may block.
        error: the answer for a failure the front finds while reading the body
            (413 too large, 400 bad framing, 408 too slow), in the route's encoding.
        release: called on the loop exactly once, when `handle` has returned or the
            body could not be read, before the answer is written (admission slots).
        max_body_bytes: this route's largest body (a capture's raw trace), instead of the
            front's; None: the front's.
    """

    handle: Callable[[bytes], Reply]
    error: Callable[[int, str], Reply]
    release: Callable[[], None] | None = None
    max_body_bytes: int | None = None


Application = Callable[[RequestHead], Union[Reply, Accept]]


@dataclass(frozen=True)
class HttpLimits:
    """The front's timeouts and connection cap (declared, with their ranges, in `settings`)."""

    header_timeout_s: float = settings.HTTP_HEADER_TIMEOUT.default
    body_timeout_s: float = settings.HTTP_BODY_TIMEOUT.default
    body_chunk_timeout_s: float = settings.HTTP_BODY_CHUNK_TIMEOUT.default
    keepalive_timeout_s: float = settings.HTTP_KEEPALIVE_TIMEOUT.default
    max_connections: int = settings.HTTP_MAX_CONNECTIONS.default

    def validate(self) -> None:
        """Raises `settings.SettingError` for a value outside its declared range."""
        for setting, value in ((settings.HTTP_HEADER_TIMEOUT, self.header_timeout_s),
                               (settings.HTTP_BODY_TIMEOUT, self.body_timeout_s),
                               (settings.HTTP_BODY_CHUNK_TIMEOUT, self.body_chunk_timeout_s),
                               (settings.HTTP_KEEPALIVE_TIMEOUT, self.keepalive_timeout_s),
                               (settings.HTTP_MAX_CONNECTIONS, self.max_connections)):
            setting.check(value, f"HttpLimits.{setting.name.removeprefix('http_')}")


EVENTS = v.HTTP_CONNECTION_EVENTS
"""Connection events the front counts (`HttpFront.events()`, `on_event`): each costs one debug line."""


# --- the connection --------------------------------------------------------------------------


class _Timeout(Exception):
    pass


class _HungUp(Exception):
    pass


class _TooLarge(Exception):
    pass


class _TlsFailed(Exception):
    pass


def _reply_bytes(conn: h11.Connection, reply: Reply, method: bytes, close: bool) -> bytes:
    headers = [("Content-Type", reply.content_type), ("Content-Length", str(len(reply.body))),
               ("Server", "traceml-processor"), *reply.headers]
    if close:
        headers.append(("Connection", "close"))
    try:
        reason = HTTPStatus(reply.status).phrase
    except ValueError:
        reason = ""
    out = conn.send(h11.Response(status_code=reply.status, headers=headers, reason=reason))
    if reply.body and method != b"HEAD":
        out += conn.send(h11.Data(data=reply.body))
    return out + conn.send(h11.EndOfMessage())


def _plain(status: int, message: str, retry_after: int | None = None) -> Reply:
    headers = (("Retry-After", str(retry_after)),) if retry_after is not None else ()
    return Reply(status, (message + "\n").encode(), headers=headers)


class _Connection(asyncio.Protocol):
    """One client connection: bytes go straight into h11; one task answers requests in turn."""

    def __init__(self, front: "HttpFront"):
        self.front = front
        self.loop = front.loop
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.transport: asyncio.BaseTransport | None = None
        self.task: asyncio.Task | None = None
        self.peer = "?"
        self._waiter: asyncio.Future | None = None
        self._write_waiter: asyncio.Future | None = None
        self._write_paused = False
        self._read_paused = False
        self._since_wait = 0
        self._eof = False
        self._lost = False
        self._got_bytes = False  # bytes of the next request have arrived (it is not idle)
        self._evicted = False  # closed to make room at the cap (counted there, not again)
        self._body_since: float | None = None  # reading a body since (loop time), for eviction
        self._body_bytes = 0
        self._served = False  # answered a request before: a kept-alive connection
        self._discarding = False  # answered and closing: further bytes are dropped
        self._linger = False
        self._phase = "header"  # what a timeout or hang-up interrupted
        self._tls = front.tls_context is not None

    # -- asyncio.Protocol callbacks ---------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if not self.front._admit(self):
            return
        self.front._waiting[self] = self.loop.time()  # no request head yet (TLS handshake included)
        if self._tls:
            transport.pause_reading()  # start_tls resumes it; raw bytes must not reach h11
        self.task = self.loop.create_task(self._run())

    def data_received(self, data: bytes) -> None:
        if self._eof or self._discarding:
            return
        if not self._got_bytes:
            self._got_bytes = True
            waiting = self.front._waiting
            if waiting.pop(self, None) is not None:  # a head begins: it waits from now, behind older ones
                waiting[self] = self.loop.time()
        if self._body_since is not None:
            self._body_bytes += len(data)
        self.h11.receive_data(data)
        self._since_wait += len(data)
        if self._waiter is None and self._since_wait > READ_AHEAD_BYTES and not self._read_paused:
            self.transport.pause_reading()  # busy with a request: the client waits, not our memory
            self._read_paused = True
        self._wake()

    def eof_received(self):
        self._end_of_input()
        return not self._tls  # plain TCP: keep the write side open to answer a half-closed client

    def connection_lost(self, exc) -> None:
        self._lost = True
        self._end_of_input()
        if self._write_waiter is not None and not self._write_waiter.done():
            self._write_waiter.set_exception(_HungUp())

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._write_waiter is not None and not self._write_waiter.done():
            self._write_waiter.set_result(None)

    def _end_of_input(self) -> None:
        if not self._eof:
            self._eof = True
            self.front._waiting.pop(self, None)
            self.h11.receive_data(b"")
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- waiting with deadlines -------------------------------------------------------------

    async def _wait(self, deadline: float, kind: str = "read") -> None:
        future = self.loop.create_future()
        timer = self.loop.call_at(deadline, _expire, future)
        if kind == "read":
            self._waiter, self._since_wait = future, 0
            if self._read_paused:
                self._read_paused = False
                self.transport.resume_reading()
        else:
            self._write_waiter = future
        try:
            await future
        finally:
            timer.cancel()
            if kind == "read":
                self._waiter = None
            else:
                self._write_waiter = None

    async def _next_event(self, deadline: float, gap_s: float | None = None):
        """The next h11 event, waiting for bytes until `deadline`, and no longer than `gap_s`
        after the latest bytes arrived (the per-chunk deadline of a body) when given."""
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError:
                if self._eof:  # the client went away mid-request; not a framing error
                    raise _HungUp() from None
                raise
            if event is not h11.NEED_DATA:
                return event
            if self._eof:  # h11 has seen the end: next_event raises or says ConnectionClosed
                raise _HungUp()
            await self._wait(deadline if gap_s is None else min(deadline, self.loop.time() + gap_s))

    async def _write(self, data: bytes) -> None:
        if self.transport.is_closing():
            raise _HungUp()
        self.transport.write(data)
        if self._write_paused:  # the client does not read: bounded like a slow body
            await self._wait(self.loop.time() + self.front.limits.body_timeout_s, "write")

    # -- the request loop -------------------------------------------------------------------

    async def _run(self) -> None:
        """Serve requests until the connection ends, count why it ended, then close it."""
        front, limits = self.front, self.front.limits
        try:
            await self._serve_requests()
        except h11.RemoteProtocolError as exc:
            front._count("framing_error", self, f"bad HTTP framing ({exc})")
            status = exc.error_status_hint if exc.error_status_hint >= 400 else 400
            await self._answer_and_close(_plain(status, f"bad request: {exc}"))
        except _Timeout:
            if self._evicted:
                pass
            elif self._phase == "header":
                front._count("header_timeout", self, f"request head not complete within {limits.header_timeout_s} s")
                if self._got_bytes:
                    await self._answer_and_close(_plain(408, "request head not received in time"))
            else:
                front._count("write_timeout", self, "answer not read in time")
        except (_HungUp, ConnectionError, ssl.SSLError, h11.LocalProtocolError) as exc:
            if not self._evicted and (self._got_bytes or self._phase == "body"):
                front._count("hung_up", self, f"client closed the connection mid-request ({type(exc).__name__})")
        except _TlsFailed:
            pass
        except asyncio.CancelledError:
            self._linger = False  # shutdown: no waiting
        except Exception:  # a bug here must not take the loop down
            LOG.exception("HTTP connection %s failed", self.peer)
        try:
            if self._linger:
                await self._drain_then_close()
        except asyncio.CancelledError:
            pass
        finally:
            self._close()

    async def _serve_requests(self) -> None:
        limits = self.front.limits
        deadline = self.loop.time() + limits.header_timeout_s
        if self._tls:
            await self._start_tls(deadline)
        while True:
            # Waiting for a request head (none yet, or one arriving): may be evicted at the cap.
            self.front._waiting.setdefault(self, self.loop.time())
            if not self._got_bytes:  # nothing of the next request yet: idle
                if self._served:
                    idle_until = self.loop.time() + limits.keepalive_timeout_s
                    try:
                        while not self._got_bytes and not self._eof:
                            await self._wait(idle_until)
                    except _Timeout:
                        return  # a quiet kept-alive connection closes without a word
                    deadline = self.loop.time() + limits.header_timeout_s
            self._phase = "header"
            event = await self._next_event(deadline)
            self.front._waiting.pop(self, None)
            if type(event) is h11.ConnectionClosed:
                return
            self._phase = "body"
            if not await self._handle(event):
                return
            if self.h11.our_state is h11.MUST_CLOSE or self.h11.their_state is not h11.DONE:
                return
            self.h11.start_next_cycle()
            self._served = True
            self._got_bytes = bool(self.h11.trailing_data[0])
            deadline = self.loop.time() + limits.header_timeout_s

    async def _start_tls(self, deadline: float) -> None:
        try:
            self.transport = await self.loop.start_tls(
                self.transport, self, self.front.tls_context, server_side=True,
                ssl_handshake_timeout=max(0.1, deadline - self.loop.time()))
        except (OSError, ssl.SSLError, ConnectionError, asyncio.TimeoutError) as exc:
            self.front._count("tls_failed", self, f"TLS handshake failed ({type(exc).__name__}: {exc})")
            raise _TlsFailed() from None

    async def _handle(self, request: h11.Request) -> bool:
        """Answer one request; False when the connection must close afterwards."""
        limits = self.front.limits
        target = request.target.decode("latin-1")
        path, _, query = target.partition("?")
        headers: dict[str, str] = {}
        for name, value in request.headers:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        if "content-length" in headers and "transfer-encoding" in headers:
            # Two framings: whichever a proxy in front chose, the other would smuggle.
            self.front._count("framing_error", self, "both Content-Length and Transfer-Encoding")
            await self._answer_and_close(_plain(400, "bad request: both Content-Length and Transfer-Encoding"))
            return False
        head = RequestHead(request.method.decode("latin-1"), path, query, headers)
        declared = int(headers.get("content-length") or 0)  # h11 has validated it
        decision = self.front.app(head)
        body_deadline = self.loop.time() + limits.body_timeout_s
        if isinstance(decision, Reply):
            keep = await self._reading_body(self._skip_body(body_deadline, declared))
            await self._send(decision, request.method, close=not keep)
            return keep
        released = [False]

        def release() -> None:
            if not released[0]:
                released[0] = True
                if decision.release is not None:
                    decision.release()

        cap = self.front.max_body_bytes if decision.max_body_bytes is None else decision.max_body_bytes
        try:
            if declared > cap:
                release()
                keep = await self._reading_body(self._skip_body(body_deadline, declared))
                reply = decision.error(413, f"body of {declared} bytes exceeds {cap}")
                await self._send(reply, request.method, close=not keep)
                return keep
            try:
                body = await self._reading_body(self._read_body(body_deadline, cap))
            except _TooLarge:
                release()
                await self._send(decision.error(413, f"body exceeds {cap} bytes"),
                                 request.method, close=True)
                return False
            except _Timeout:
                release()
                if self.loop.time() >= body_deadline:
                    why = f"request body not received within {limits.body_timeout_s} s"
                else:
                    why = f"no byte of the request body for {limits.body_chunk_timeout_s} s"
                self.front._count("body_timeout", self, why)
                await self._send(decision.error(408, why), request.method, close=True)
                return False
            except h11.RemoteProtocolError as exc:
                release()
                self.front._count("framing_error", self, f"bad body framing ({exc})")
                await self._send(decision.error(400, f"bad request body framing: {exc}"), request.method, close=True)
                return False
            try:
                reply = await self.loop.run_in_executor(self.front.pool, decision.handle, body)
            except Exception:
                LOG.exception("HTTP handler for %s %s failed", head.method, head.path)
                reply = decision.error(500, "internal error")
        finally:
            release()  # before the answer is written: a client holding its answer finds the slot free
        await self._send(reply, request.method)
        return True

    async def _reading_body(self, reading):
        """Await `reading` (a body being read or skipped) while counting its bytes, so the
        front can tell, at the cap, which body arrives slowest."""
        # What came with the head counts: h11 holds it unread.
        self._body_since, self._body_bytes = self.loop.time(), len(self.h11.trailing_data[0])
        self.front._bodies.add(self)
        try:
            return await reading
        finally:
            self._body_since = None
            self.front._bodies.discard(self)

    async def _read_body(self, deadline: float, cap: int) -> bytes:
        if self.h11.they_are_waiting_for_100_continue:
            await self._write(self.h11.send(h11.InformationalResponse(status_code=100, headers=[])))
        chunks, total = [], 0
        gap_s = self.front.limits.body_chunk_timeout_s
        while True:
            event = await self._next_event(deadline, gap_s)
            if type(event) is h11.Data:
                total += len(event.data)
                if total > cap:
                    raise _TooLarge()
                chunks.append(event.data)
            elif type(event) is h11.EndOfMessage:
                return b"".join(chunks)

    async def _skip_body(self, deadline: float, declared: int) -> bool:
        """Read and drop a body the answer does not need; False: close instead.

        Dropped rather than left unread so a client that sends its whole body
        before reading sees the answer. Bounded by `4 x` the body cap and the body
        timeout; a client waiting for `100 Continue` is answered and closed.
        """
        if self.h11.their_state is h11.DONE:
            return True
        if self.h11.they_are_waiting_for_100_continue:
            return False
        limit, seen = 4 * self.front.max_body_bytes, 0
        if declared > limit:
            return False
        try:
            while True:
                event = await self._next_event(deadline, self.front.limits.body_chunk_timeout_s)
                if type(event) is h11.EndOfMessage:
                    return True
                seen += len(event.data)
                if seen > limit:
                    return False
        except (_Timeout, h11.RemoteProtocolError):
            return False

    async def _send(self, reply: Reply, method: bytes, close: bool = False) -> None:
        if close:
            self._stop_reading()
        await self._write(_reply_bytes(self.h11, reply, method, close))

    async def _answer_and_close(self, reply: Reply) -> None:
        self._stop_reading()
        if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE) and not self.transport.is_closing():
            try:
                await self._write(_reply_bytes(self.h11, reply, b"GET", close=True))
            except (_HungUp, _Timeout, h11.LocalProtocolError, ConnectionError):
                pass

    def _stop_reading(self) -> None:
        """Nothing more is parsed on this connection: the rest of its bytes are dropped unread."""
        self._discarding = True
        self._linger = not self._lost

    async def _drain_then_close(self) -> None:
        """Half-close, then drop what the client still sends for up to LINGER_S.

        Closing with unread bytes makes the kernel answer with a reset, which can
        destroy the answer before the client reads it; this lets it arrive.
        """
        if self.transport.is_closing():
            return
        if self.transport.can_write_eof():
            self.transport.write_eof()
        deadline = self.loop.time() + LINGER_S
        try:
            while not self._eof:
                await self._wait(deadline)
        except _Timeout:
            pass

    def _close(self) -> None:
        self.front._release(self)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(_Timeout())


class _Refused(asyncio.Protocol):
    """Past the cap with every connection being answered: one 503 with Retry-After, then closed."""

    def __init__(self, tls: bool, retry_after_s: int):
        self._tls = tls
        self._retry_after = retry_after_s

    def connection_made(self, transport) -> None:
        if not self._tls:  # a plaintext answer means nothing to a TLS client: just close
            body = b"too many open connections\n"
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
                            b"Content-Length: %d\r\nRetry-After: %d\r\nConnection: close\r\n"
                            b"Server: traceml-processor\r\n\r\n%s" % (len(body), self._retry_after, body))
        transport.close()


# --- the server --------------------------------------------------------------------------------


class HttpFront:
    """The bounded HTTP/1.1 server (see the module docstring); bound at construction.

    Args:
        address: (host, port); IPv6 when the host contains ':'; port 0 picks one.
        app: request head -> `Reply` or `Accept` (called on the loop: must not block).
        limits: timeouts and connection cap.
        pool_size: threads for `Accept.handle` (the receiver's admission limit).
        max_body_bytes: the largest body read (413 beyond, as received on the wire).
        tls_context: server-side TLS, handshake on the connection (never the accept path).
        reuse_port: SO_REUSEPORT, for ingest workers sharing the port.
        retry_after_s: the `Retry-After` of the 503 at the cap.
        on_event: also told each connection event (the processor's self-telemetry counts them).
    """

    def __init__(self, address: tuple[str, int], app: Application, *, limits: HttpLimits = HttpLimits(),
                 pool_size: int = 8, max_body_bytes: int = 20 * 1024 * 1024,
                 tls_context: ssl.SSLContext | None = None, reuse_port: bool = False, retry_after_s: int = 1,
                 name: str = "traceml-http", on_event: Callable[[str], None] | None = None):
        limits.validate()
        self.app = app
        self.on_event = on_event
        self.limits = limits
        self.max_connections = connection_cap(limits.max_connections)
        if self.max_connections < limits.max_connections:
            LOG.info("HTTP connection cap %d lowered to %d by the descriptor limit (RLIMIT_NOFILE)",
                     limits.max_connections, self.max_connections)
        self.max_body_bytes = max_body_bytes
        self.tls_context = tls_context
        self.retry_after_s = retry_after_s
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix=name)
        self.socket = bind(address, reuse_port)
        self.server_address = self.socket.getsockname()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._open: set[_Connection] = set()
        # Connections waiting for a request head (none yet, or one still arriving) -> since when
        # (loop time); insertion order is that order, so the first has waited longest.
        self._waiting: dict[_Connection, float] = {}
        self._bodies: set[_Connection] = set()  # connections whose request body is being read
        self._events: Counter = Counter()
        self._stop_requested: asyncio.Event | None = None
        self._started = threading.Event()
        self._finished = threading.Event()
        self._shutdown_called = False
        self._last_emfile_log = 0.0

    # -- the ServerThread protocol ------------------------------------------------------------

    def serve_forever(self, poll_interval: float = SHUTDOWN_POLL_S) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._loop_exception)
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            self.loop.close()
            self._finished.set()

    def shutdown(self) -> None:
        """Stop accepting, let requests in progress finish (up to SHUTDOWN_GRACE_S), close the rest."""
        self._shutdown_called = True
        if not self._started.wait(5):
            return
        loop = self.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._stop_requested.set)
            except RuntimeError:
                pass  # the loop closed meanwhile
        self._finished.wait(SHUTDOWN_GRACE_S + 5)

    def server_close(self) -> None:
        self.socket.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def events(self) -> dict[str, int]:
        """Connection events so far (`EVENTS`), plus the connections open now."""
        out = {name: self._events.get(name, 0) for name in EVENTS}
        out["open_connections"] = len(self._open)
        return out

    # -- internals -------------------------------------------------------------------------------

    async def _serve(self) -> None:
        self._stop_requested = asyncio.Event()
        try:
            server = await self.loop.create_server(lambda: _Connection(self), sock=self.socket,
                                                   backlog=ACCEPT_BATCH)
            self.socket.listen(BACKLOG)  # asyncio listened with the batch size: the kernel queue stays as bound
        finally:
            self._started.set()
        if self._shutdown_called:
            self._stop_requested.set()
        await self._stop_requested.wait()
        server.close()
        for conn in [c for c in self._waiting if not c._got_bytes]:  # idle: nothing to finish
            conn.transport.abort()
        busy = [c.task for c in self._open if c.task is not None and not c.task.done()]
        if busy:
            _, pending = await asyncio.wait(busy, timeout=SHUTDOWN_GRACE_S)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        for conn in list(self._open):
            if conn.transport is not None:
                conn.transport.abort()
        await asyncio.sleep(0)  # let the aborts' connection_lost callbacks run

    def _admit(self, conn: _Connection) -> bool:
        if len(self._open) >= self.max_connections:
            victim = self._least_progress()
            if victim is None:
                self._count("refused_at_cap", conn, f"refused: {self.max_connections} connections open,"
                                                    " every one being answered")
                _Refused(conn._tls, self.retry_after_s).connection_made(conn.transport)
                return False
            self._evict(victim)
        self._open.add(conn)
        return True

    def _least_progress(self) -> _Connection | None:
        """The open connection that made the least progress (module docstring), or None when
        every one is being answered. O(1) while any waits for a head, as in a flood."""
        if self._waiting:
            return next(iter(self._waiting))
        if not self._bodies:
            return None
        now = self.loop.time()
        return min(self._bodies, key=lambda c: c._body_bytes / max(now - (c._body_since or now), 1e-3))

    def _evict(self, victim: _Connection) -> None:
        now = self.loop.time()
        if victim in self._bodies:
            since = victim._body_since if victim._body_since is not None else now
            event, detail = "evicted_slow_body", f"{victim._body_bytes} body bytes in {now - since:.1f} s"
        elif victim._got_bytes:
            event, detail = "evicted_slow_head", f"request head incomplete after {now - self._waiting[victim]:.1f} s"
        else:
            event, detail = "evicted_idle", f"no request for {now - self._waiting[victim]:.1f} s"
        victim._evicted = True
        self._count(event, victim, f"closed to make room at the connection cap: {detail}")
        self._release(victim)
        victim.transport.abort()

    def _release(self, conn: _Connection) -> None:
        self._open.discard(conn)
        self._waiting.pop(conn, None)
        self._bodies.discard(conn)

    def _count(self, event: str, conn, detail: str) -> None:
        self._events[event] += 1
        if self.on_event is not None:
            self.on_event(event)
        LOG.debug("HTTP %s from %s: %s", event, getattr(conn, "peer", "?"), detail)

    def _loop_exception(self, loop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and "accept" in context.get("message", ""):
            # EMFILE/ENFILE/ENOBUFS: asyncio stops accepting for a second and retries; one line per 10 s.
            self._events["accept_out_of_descriptors"] += 1
            if self.on_event is not None:
                self.on_event("accept_out_of_descriptors")
            now = time.monotonic()
            if now - self._last_emfile_log >= _EMFILE_LOG_EVERY_S:
                self._last_emfile_log = now
                LOG.warning("HTTP port %s cannot accept (%s); retrying every second (%d times so far)",
                            self.server_address[1], exc.strerror or exc, self._events["accept_out_of_descriptors"])
            return
        if isinstance(exc, (ConnectionError, ssl.SSLError)):
            LOG.debug("HTTP transport: %s", context.get("message"))
            return
        loop.default_exception_handler(context)
