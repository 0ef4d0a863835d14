"""A socketserver run on its own daemon thread: what both HTTP listeners share.

The OTLP/HTTP receiver and the Prometheus endpoint subclass `ServerThread`, so
the requested host, the bound port, the accept loop's thread and its shutdown are
written once.
"""
from __future__ import annotations

import socketserver
import threading


SHUTDOWN_POLL_S = 0.05
"""How often the accept loop looks for a stop request: `stop()` waits up to this long
per listener (the service stops two in a row), and an idle loop wakes this often."""


class ServerThread:
    """Owns one bound server: `start()` serves in the background, `stop()` closes it.

    Args:
        server: the server, already bound (its socket may be wrapped for TLS).
        host: the host it was asked to bind, kept as given (`port` is the bound one,
            which differs from the requested one when that was 0).
        name: the accept loop's thread name.
    """

    def __init__(self, server: socketserver.BaseServer, host: str, name: str):
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
