"""A socketserver run on its own daemon thread: what both HTTP listeners share."""
from __future__ import annotations

import socketserver
import threading


class ServerThread:
    """Owns one bound server: `start()` serves in the background, `stop()` closes it."""

    def __init__(self, server: socketserver.BaseServer, name: str):
        self.server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)
