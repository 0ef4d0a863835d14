"""A free loopback TCP port, for a server a test or benchmark starts on a known address.

The port is free when handed out and the caller binds it a little later, so whatever else
could take it in between must be kept off it:
- the kernel: ports come from below its ephemeral range (32768-60999 on Linux), which it
  uses for servers on port 0 and the local end of every outgoing connection, so none of the
  suite's own processors, receivers and clients can be given the port by the kernel;
- the other pytest-xdist workers of the same run: each process takes its ports from a slice
  of its own (by PYTEST_XDIST_WORKER: gw0, gw1, ...; a run without xdist has the first);
- this process: a port is handed out once (each process walks its slice from a random
  start, so a child process of the same worker starts elsewhere).
Another program on the machine could still bind the port first, as with any address named
in advance; the bind check here makes that rare. Where the ephemeral range leaves no room
below it, the kernel's choice (port 0) is used instead.
"""
from __future__ import annotations

import os
import random
import re
import socket
import threading
from typing import Iterator

_FIRST = 10_000  # above the registered services people run on a developer's machine
_SLICE = 2_500  # ports per process slot; nine slots fit below 32768
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _slot() -> int:
    """0 outside xdist, N + 1 for worker gwN."""
    match = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(match.group(1)) + 1 if match else 0


def _ephemeral_low() -> int:
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _candidates() -> Iterator[int] | None:
    slots = (_ephemeral_low() - _FIRST) // _SLICE
    if slots < 1:
        return None
    first = _FIRST + (_slot() % slots) * _SLICE
    start = random.randrange(_SLICE)
    return (first + (start + i) % _SLICE for i in range(_SLICE))


_lock = threading.Lock()
_walk: Iterator[int] | None = None
_walk_pid: int | None = None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _kernel_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port() -> int:
    """A port nothing listens on now, on 127.0.0.1, never handed out before by this process."""
    global _walk, _walk_pid
    with _lock:
        if _walk is None or _walk_pid != os.getpid():  # a fork starts its own walk
            _walk, _walk_pid = _candidates(), os.getpid()
        if _walk is not None:
            for port in _walk:
                if _bindable(port):
                    return port
        return _kernel_port()  # no room below the ephemeral range, or the slice is used up
