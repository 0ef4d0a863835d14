"""The web view over HTTP: mounted under `/ui` on the OTLP/HTTP port, or on its own `--ui HOST:PORT`.

Both go through the processor's bounded HTTP front (`http_front.HttpFront`: header,
body and keep-alive timeouts, a connection cap, framing errors closed), so the
page faces the same hostile traffic as the receiver with the same defences.
`WebApp.handle` reads SQLite, so it runs on the front's pool, never on its loop.
TLS comes from the processor's `TlsConfig`; the bearer token is the app's.
"""
from __future__ import annotations

import logging
from typing import Callable

from traceml.processor.security import TlsConfig
from traceml.processor.http_front import Accept, HttpFront, HttpLimits, Reply, RequestHead
from traceml.processor.listener import ServerThread
from traceml.processor.web.app import WebApp

LOG = logging.getLogger(__name__)

UI_POOL_THREADS = 4
"""Pages rendered at once; one tick's answer is shared, so a few threads serve many pages."""


def front_route(app: WebApp) -> Callable[[RequestHead], Accept | Reply]:
    """`app` as an HTTP-front route: requests under its prefix go to `WebApp.handle` on a pool thread."""
    prefix = app.prefix

    def route(head: RequestHead) -> Accept | Reply:
        if head.path != prefix and not head.path.startswith(prefix + "/"):
            return Reply(404, b"not found\n")

        def answer(_body: bytes) -> Reply:
            response = app.handle(head.method, head.path, head.query, head.headers)
            content_type, rest = "application/octet-stream", []
            for name, value in response.headers:
                if name.lower() == "content-type":
                    content_type = value
                else:
                    rest.append((name, value))
            return Reply(response.status, response.body, content_type, tuple(rest))

        return Accept(handle=answer, error=lambda code, message: Reply(code, (message + "\n").encode()))

    return route


class UiServer(ServerThread):
    """The web view on HOST:PORT (`--ui`); `port` is the bound one (useful with port 0)."""

    def __init__(self, app: WebApp, host: str, port: int, *, tls: TlsConfig = TlsConfig(),
                 limits: HttpLimits = HttpLimits(), on_event: Callable[[str], None] | None = None):
        self.app = app
        front = HttpFront((host, port), front_route(app), limits=limits, pool_size=UI_POOL_THREADS,
                          max_body_bytes=64 * 1024, tls_context=tls.server_context() if tls.enabled else None,
                          name="traceml-ui", on_event=on_event)
        super().__init__(front, host, "traceml-ui")
        self.scheme = "https" if tls.enabled else "http"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.app.prefix}/"


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

    book = getattr(service, "captures", None)  # the deep-capture book (issue 33: `capture.book.CaptureBook`)
    feed = RunFeed(cfg.db, session_source=session_of, run_states=run_states,
                   capture_source=None if book is None else book.of_run)
    return WebApp(feed, auth=cfg.auth, secure=cfg.tls.enabled, fleet_period_s=cfg.fleet_period_s,
                  capture_book=book)


def start_ui(service, host: str, port: int) -> UiServer:
    """Serve `web_app_for(service)` on HOST:PORT (`--ui`), with the service's TLS settings."""
    from traceml.processor.security import warn_if_exposed

    warn_if_exposed("the web view (--ui)", host, service.config.auth, service.config.tls)
    ui = UiServer(web_app_for(service), host, port, tls=service.config.tls, limits=service.config.http_limits,
                  on_event=service.stats.connection_event)
    ui.start()
    return ui


__all__ = ["UiServer", "front_route", "start_ui", "web_app_for"]
