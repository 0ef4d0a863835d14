"""What both sides decide from a host name alone.

The exporter reaches a loopback endpoint directly (no proxy can reach this machine's
loopback for it), and the processor and the launcher warn when a listener beyond loopback
has no token or TLS: one reading of "loopback" for both.
"""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """`localhost` (any case) or a loopback address (127.0.0.0/8, ::1); a name is not resolved."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return False
