"""`--ui HOST:PORT`: the web view on its own threaded HTTP server (standard library).

A thin adapter: each request's method, path, query and headers go to
`WebApp.handle`, its answer goes back as is. TLS comes from the processor's
`TlsConfig` (the handshake runs on the handler thread, as in the OTLP/HTTP
receiver); the bearer token is the app's.
"""
from __future__ import annotations

import logging
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from traceml.processor.security import TlsConfig
from traceml.processor.serving import ServerThread
from traceml.processor.web.app import WebApp

LOG = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0
"""A connection idle this long is closed (a browser's keep-alive must not pin a thread)."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_UiServer"
    timeout = REQUEST_TIMEOUT_S

    def log_message(self, fmt, *args):
        LOG.debug("ui %s " + fmt, self.address_string(), *args)

    def _serve(self) -> None:
        target = urlsplit(self.path)
        response = self.server.app.handle(self.command, target.path, target.query, dict(self.headers.items()))
        self.send_response(response.status)
        for name, value in response.headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if response.body:
            self.wfile.write(response.body)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _serve  # noqa: N815


class _UiServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, app: WebApp):
        super().__init__(address, _Handler)
        self.app = app


class _UiServer6(_UiServer):
    address_family = socket.AF_INET6


class UiServer(ServerThread):
    """The web view on HOST:PORT; `port` is the bound one (useful with port 0)."""

    def __init__(self, app: WebApp, host: str, port: int, *, tls: TlsConfig = TlsConfig()):
        server = (_UiServer6 if ":" in host else _UiServer)((host, port), app)
        if tls.enabled:
            server.socket = tls.server_context().wrap_socket(
                server.socket, server_side=True, do_handshake_on_connect=False)
        super().__init__(server, host, "traceml-ui")
        self.scheme = "https" if tls.enabled else "http"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.server.app.prefix}/"


def web_app_for(service) -> WebApp:
    """The web view of a running `ProcessorService`: its database, its run monitor's sessions,
    its token and TLS settings. What `--ui` serves, and what another HTTP server mounts
    under `/ui` (calling `handle` off its event loop: it reads SQLite)."""
    from traceml.processor.web.feed import RunFeed

    cfg = service.config
    monitor = service.monitor

    def session_of(run_id: str):
        state = monitor.state(run_id)
        return None if state is None else state.session

    def run_states():
        out = {}
        for run_id in monitor.run_ids():
            state = monitor.state(run_id)
            if state is not None:
                out[run_id] = "active" if state.ended is None else f"ended ({state.ended})"
        return out

    feed = RunFeed(cfg.db, session_source=session_of, run_states=run_states)
    return WebApp(feed, auth=cfg.auth, secure=cfg.tls.enabled)


def start_ui(service, host: str, port: int) -> UiServer:
    """Serve `web_app_for(service)` on HOST:PORT (`--ui`), with the service's TLS settings."""
    from traceml.processor.security import warn_if_exposed

    warn_if_exposed("the web view (--ui)", host, service.config.auth, service.config.tls)
    ui = UiServer(web_app_for(service), host, port, tls=service.config.tls)
    ui.start()
    return ui


__all__ = ["UiServer", "start_ui", "web_app_for"]
