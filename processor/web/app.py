"""The web view as one framework-independent request handler.

`WebApp.handle(method, path, query, headers) -> WebResponse` knows nothing of
sockets: `server.UiServer` adapts it to `http.server` on the `--ui` address, and
any other HTTP server can mount it under its prefix (default `/ui`) by passing
the request's method, path, raw query string and headers and writing back the
status, headers and body it returns.

Routes under the prefix: `/` (index of runs), `/run?id=RUN` (one run),
`/api/runs` and `/api/run?id=RUN` (the JSON the pages refresh from), `/fleet` and
`/api/fleet` (hosts and GPUs that keep being a run's straggler), and
`/assets/<name>` for the names of `assets.ASSETS` only (nothing else of the host
is reachable). GET and HEAD only, but for one route: `POST /api/capture?id=RUN&rank=R`
[`&reference=R2&steps=N`], the run page's "Capture" button, which asks the processor's
capture book (`request_capture`, as `POST CAPTURES_PATH` does) and answers 202 with the
capture's id, or the book's refusal (403 off, 404 not held here, 409 one in progress, 400).
It needs the `X-TraceML-Capture` header besides the token: a cross-site form cannot set
it, and a cross-site script asking for it is stopped by the browser (no CORS answer here).

With a bearer token configured (the processor's `BearerAuth`) every route needs
it, in one of three forms: an `Authorization: Bearer <token>` header (scripts);
`?token=<token>` once in a browser, which answers a redirect to the same URL
without the token and sets an HttpOnly, SameSite=Strict cookie (Secure under TLS)
holding a keyed hash of the token, not the token; or that cookie afterwards.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import parse_qs, urlencode

from traceml.processor.security import BearerAuth
from traceml.processor.web.assets import ASSETS
from traceml.processor.web.feed import RunFeed
from traceml.processor.settings import FLEET_PERIOD
from traceml.processor.web.pages import fleet_page, index_page, run_page
from traceml.processor.web.svg import esc

LOG = logging.getLogger(__name__)

DEFAULT_PREFIX = "/ui"
COOKIE_NAME = "traceml_ui"
_COOKIE_LABEL = b"traceml-ui-cookie-v1"

PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_COMMON_HEADERS = (
    ("Content-Security-Policy", PAGE_CSP),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)
HTML = "text/html; charset=utf-8"
JSON = "application/json"
CAPTURE_HEADER = "x-traceml-capture"
"""The header the capture route requires (see the module's docstring: no cross-site request has it)."""


@dataclass(frozen=True)
class WebResponse:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


def _response(status: int, content_type: str, body: bytes | str, *extra: tuple[str, str]) -> WebResponse:
    data = body.encode() if isinstance(body, str) else body
    return WebResponse(status, (("Content-Type", content_type), *_COMMON_HEADERS, *extra), data)


def _message_page(status: int, title: str, text: str) -> WebResponse:
    page = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title></head>'
            f"<body><h1>{esc(title)}</h1><p>{esc(text)}</p></body></html>")
    return _response(status, HTML, page)


def _int(text: str) -> int:
    value = int(text)
    if value < 0 or value > 10**9:
        raise ValueError(text)
    return value


def _cookies(header: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in (header or "").split(";"):
        name, sep, value = part.strip().partition("=")
        if sep and name:
            out.setdefault(name, value.strip().strip('"'))
    return out


class WebApp:
    """Routes, the token check and the answers; the data comes from one `RunFeed`."""

    def __init__(self, feed: RunFeed, *, auth: BearerAuth = BearerAuth(), secure: bool = False,
                 prefix: str = DEFAULT_PREFIX, fleet_period_s: float = FLEET_PERIOD.default,
                 capture_book=None):
        self.feed = feed
        self.capture_book = capture_book  # `processor.capture.book.CaptureBook`; None: no capture route
        self.fleet_period_s = fleet_period_s  # the fleet page's period (`--fleet-period`)
        self.auth = auth
        self.secure = secure  # served over TLS: the cookie gets Secure
        self.prefix = prefix.rstrip("/")

    # --- the token ------------------------------------------------------------------------

    def _cookie_value(self) -> str:
        return hmac.new(str(self.auth.token).encode(), _COOKIE_LABEL, hashlib.sha256).hexdigest()

    def _authorised(self, headers: Mapping[str, str]) -> bool:
        if not self.auth.enabled:
            return True
        if headers.get("authorization") and self.auth.allows(headers["authorization"]):
            return True
        cookie = _cookies(headers.get("cookie")).get(COOKIE_NAME)
        return bool(cookie) and hmac.compare_digest(cookie.encode(), self._cookie_value().encode())

    def _token_login(self, path: str, params: dict[str, list[str]]) -> WebResponse:
        token = params.get("token", [""])[0]
        if not self.auth.allows(f"Bearer {token}"):
            return _message_page(401, "Unauthorised", "the token given is not this processor's token")
        rest = {k: v for k, v in params.items() if k != "token"}
        location = path + (f"?{urlencode(rest, doseq=True)}" if rest else "")
        cookie = (f"{COOKIE_NAME}={self._cookie_value()}; Path={self.prefix or '/'}; HttpOnly; SameSite=Strict"
                  + ("; Secure" if self.secure else ""))
        return _response(303, HTML, b"", ("Location", location), ("Set-Cookie", cookie))

    # --- the request -------------------------------------------------------------------------

    def handle(self, method: str, path: str, query: str, headers: Mapping[str, str]) -> WebResponse:
        """One request; never raises (a failure is a 500 with the reason logged)."""
        headers = {k.lower(): v for k, v in headers.items()}
        try:
            response = self._route(method.upper(), path, query, headers)
        except Exception:
            LOG.exception("web view request %s %s failed", method, path)
            response = _message_page(500, "Internal error", "the web view failed; see the processor log")
        if method.upper() == "HEAD":
            return WebResponse(response.status, response.headers, b"")
        return response

    def _route(self, method: str, path: str, query: str, headers: Mapping[str, str]) -> WebResponse:
        if path != self.prefix and not path.startswith(self.prefix + "/"):
            return _message_page(404, "Not found", "nothing is served here")
        capture_route = path == self.prefix + "/api/capture"
        if method not in ("GET", "HEAD") and not (capture_route and method == "POST"):
            return _response(405, "text/plain; charset=utf-8", "method not allowed\n", ("Allow", "GET, HEAD"))
        params = parse_qs(query or "", keep_blank_values=True)
        if self.auth.enabled and "token" in params:
            return self._token_login(path, params)
        if not self._authorised(headers):
            if path.startswith(self.prefix + "/api/"):
                return _response(401, JSON, json.dumps({"error": "bearer token required"}))
            return _message_page(401, "Token required", (
                "this processor needs its bearer token: open this address once with ?token=<token> "
                "(a cookie then keeps it), or send Authorization: Bearer <token>"))
        route = path[len(self.prefix):] or ""
        if capture_route:
            return self._capture(method, params, headers)
        if route == "":
            return _response(308, HTML, b"", ("Location", self.prefix + "/"))
        if route == "/":
            runs, _ = self.feed.runs()
            return _response(200, HTML, index_page(runs, prefix=self.prefix, refresh_s=self.feed.tick_s))
        if route == "/api/runs":
            _, body = self.feed.runs()
            return _response(200, JSON, body)
        if route in ("/run", "/api/run"):
            run_id = params.get("id", [None])[0]
            if run_id is None:
                if route == "/api/run":
                    return _response(404, JSON, json.dumps({"error": "which run? ?id=RUN"}))
                return _message_page(404, "No run given", "open a run from the index, or add ?id=RUN")
            # A run not stored yet gets its page all the same (cold: "no data yet"), so the address
            # `traceml run --ui` prints before the first step fills in once data arrives.
            view, body = self.feed.run_view(run_id)
            if route == "/api/run":
                return _response(200, JSON, body)
            return _response(200, HTML, run_page(view, prefix=self.prefix, refresh_s=self.feed.tick_s))
        if route in ("/fleet", "/api/fleet"):
            return self._fleet(route == "/api/fleet")
        if route.startswith("/assets/"):
            asset = ASSETS.get(route[len("/assets/"):])
            if asset is None:
                return _message_page(404, "Not found", "no such asset")
            return _response(200, asset[0], asset[1])
        return _message_page(404, "Not found", "no such page")


    def _capture(self, method: str, params: dict[str, list[str]], headers: Mapping[str, str]) -> WebResponse:
        """The "Capture" button: one request into the capture book, answered as JSON."""
        if method != "POST":
            return _response(405, JSON, json.dumps({"error": "POST only"}), ("Allow", "POST"))
        if not headers.get(CAPTURE_HEADER):
            return _response(403, JSON, json.dumps({"error": f"the {CAPTURE_HEADER} header is required"}))
        if self.capture_book is None:
            return _response(404, JSON, json.dumps({"error": "this web view has no capture book"}))
        try:
            run_id = params["id"][0]
            rank = _int(params["rank"][0])
            reference = _int(params["reference"][0]) if params.get("reference", [""])[0] else None
            steps = _int(params["steps"][0]) if params.get("steps", [""])[0] else None
        except (KeyError, IndexError, ValueError):
            return _response(400, JSON, json.dumps({"error": "give ?id=RUN&rank=R (&reference=R2&steps=N)"}))
        from traceml.processor.capture.book import CaptureRefused

        try:
            record = self.capture_book.request_capture(run_id, rank, reference, steps)
        except CaptureRefused as refused:
            return _response(refused.status, JSON, json.dumps({"error": str(refused)}))
        return _response(202, JSON, json.dumps({"capture_id": record.capture_id, "status": record.status,
                                                "rank": record.culprit_rank,
                                                "reference": record.reference_rank}))

    def _fleet(self, as_json: bool) -> WebResponse:
        """Hosts and GPUs by runs flagged and time lost over the fleet period (the store's history)."""
        import time
        from dataclasses import asdict

        from traceml.processor.store_read import StoreReadError, read_fleet

        try:
            entries = read_fleet(self.feed.db_path, since=time.time() - self.fleet_period_s)
        except StoreReadError:  # no database yet, or no history table in it: nothing flagged
            entries = []
        if as_json:
            return _response(200, JSON, json.dumps([asdict(entry) for entry in entries]))
        return _response(200, HTML, fleet_page(entries, prefix=self.prefix, period_s=self.fleet_period_s))

__all__ = ["CAPTURE_HEADER", "COOKIE_NAME", "DEFAULT_PREFIX", "PAGE_CSP", "WebApp", "WebResponse"]
