"""A free loopback TCP port, for a server a test or benchmark starts on a known address."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A port the kernel just handed out on 127.0.0.1.

    The socket is closed before the caller binds, so another process could take the
    port in between; tests accept that small race for being able to name the address
    before the server starts (a restarted processor must come back on the same one).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
