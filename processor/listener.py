"""Listeners on their own threads: bind a port, serve it in the background, stop it.

`ServerThread` runs one bound server on a daemon thread: anything with
`serve_forever(poll_interval)`, `shutdown()`, `server_close()` and
`server_address` (a `socketserver` server, or `http_front.HttpFront`), so the
requested host, the bound port, the thread and its shutdown are written once.
`bind` makes the listening socket (IPv4 or IPv6, optionally shared by the ingest
workers with SO_REUSEPORT) and `connection_cap` keeps a connection cap below the
process's descriptor limit.
"""
from __future__ import annotations

import socket
import socketserver
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from traceml.processor.http_front import HttpFront

SHUTDOWN_POLL_S = 0.05
"""How often a socketserver's accept loop looks for a stop request: `stop()` waits up to
this long per listener (the service stops two in a row), and an idle loop wakes this often."""
BACKLOG = 128
"""Connections the kernel queues on a listening socket before it is accepted."""


class ServerThread:
    """Owns one bound server: `start()` serves in the background, `stop()` closes it.

    Args:
        server: the server, already bound (its socket may be wrapped for TLS).
        host: the host it was asked to bind, kept as given (`port` is the bound one,
            which differs from the requested one when that was 0).
        name: the serving thread's name.
    """

    def __init__(self, server: "socketserver.BaseServer | HttpFront", host: str, name: str):
        self.server = server
        self.host = host
        self.port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S},
                                        name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


def connection_cap(configured: int) -> int:
    """`configured`, lowered so the HTTP port can never take the process's last descriptors.

    A quarter of the soft RLIMIT_NOFILE (at least 64) stays for gRPC, SQLite, logs
    and the ingest workers' pipes.
    """
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):
        return configured
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, soft - max(64, soft // 4)))


def bind(address: tuple[str, int], reuse_port: bool) -> socket.socket:
    """A non-blocking socket listening on (host, port): IPv6 when the host contains ':'."""
    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)  # connections queue from here on, as with socketserver
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
