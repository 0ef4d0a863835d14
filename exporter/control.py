"""The rank's deep-capture control client (issue 33): polls the processor for capture requests and
uploads the answers.

It runs on the exporter's worker thread only, on the rounds that thread runs anyway while steps
flow (`OtlpStepExporter._run`): it adds no wake-up of its own, so an idle job's exporter still
sleeps, and a request reaches the rank within `control_poll_interval_s` plus one export round of
a step. A poll is a GET of `CONTROL_PATH?run_id=R&rank=N` on each configured processor base URL
(`TRACEML_CONTROL_ENDPOINT`), with the headers (the token) and TLS files of the exporter's traces
(`transport.http_client_options`, the one owner), on a kept-alive connection, and a
`POLL_TIMEOUT_S` timeout: a dead or silent
processor costs the exporter's thread at most that per URL and poll, never the training thread.
A failed poll is counted and backs that URL off (doubling, up to `MAX_BACKOFF_S`); a request
that does not parse, or names another run or rank, is counted and ignored. Nothing here raises.

A request is handed to `traceml.deep_capture.arm` (refused: the rank answers with a failure
saying why). The answer comes back on the capture's builder thread, which queues it and wakes
the worker (`notify`); the next round uploads it to the base URL the request came from: the
summary, then the gzip'd trace, or `.../failure` with the reason. An upload that meets a
connection error or a 5xx is tried again on later rounds (`UPLOAD_ATTEMPTS` in all); a 4xx is
final (a refused summary is followed by a failure naming the refusal). At shutdown `finish`
waits, within the exporter's deadline, for a capture being summarised and uploads it.
"""
from __future__ import annotations

import collections
import http.client
import json
import logging
import ssl
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlencode

from traceml.schema.capture import (
    CAPTURES_PATH,
    CONTROL_PATH,
    MAX_SUMMARY_BYTES,
    PART_FAILURE,
    PART_SUMMARY,
    PART_TRACE,
    CaptureFormatError,
    CaptureRequest,
)

from .identity import RunIdentity
from .settings import ExporterSettings
from .transport import KeptAliveConnection, http_client_options

_log = logging.getLogger("traceml.exporter")

POLL_TIMEOUT_S = 1.0
"""Connect and read timeout of one poll: an answer is a few hundred bytes on a processor that
answers from memory."""
MAX_BACKOFF_S = 60.0
UPLOAD_ATTEMPTS = 3
_OK, _REFUSED, _RETRY = "ok", "refused", "retry"


@dataclass(frozen=True, slots=True)
class ControlStats:
    """Counts since start (`ExporterStats.control`)."""

    polls: int  # GETs answered (204 or 200)
    poll_failures: int  # GETs that failed: connection error, timeout, a status other than 200/204
    bad_requests: int  # 200s whose body was no valid request for this rank (ignored)
    requests: int  # valid requests received
    refused: int  # requests answered with a failure at once (another capture in progress, no torch)
    uploads: int  # parts delivered (summary, trace, failure)
    upload_failures: int  # parts given up on


class _Upload:
    """One answer on its way: the parts still to send, in order."""

    __slots__ = ("url", "result", "parts", "attempts")

    def __init__(self, url: str, result) -> None:
        self.url = url
        self.result = result
        self.attempts = 0
        if result.failure is not None or result.summary is None:
            self.parts = [PART_FAILURE]
        else:
            self.parts = [PART_SUMMARY] + ([PART_TRACE] if result.trace is not None else [])


class ControlClient:
    """Polls and uploads for one rank; called on the exporter's worker thread (see the module docstring)."""

    def __init__(self, identity: RunIdentity, settings: ExporterSettings, notify: Callable[[], None], *,
                 arm: Callable | None = None) -> None:
        import requests

        self._requests = requests
        self._session = requests.Session()
        self._identity = identity
        self._urls = tuple(settings.control_endpoints)
        self._interval_s = settings.control_poll_interval_s
        self._upload_timeout_s = settings.traces.timeout_s
        self._headers, self._verify, self._cert = http_client_options(settings.traces, tls=True)
        self._query = urlencode({"run_id": identity.run_id, "rank": identity.rank})
        self._polls = {url: KeptAliveConnection(url, self._verify, self._cert) for url in self._urls}
        self._notify = notify
        self._arm = arm
        self._next_poll = {url: 0.0 for url in self._urls}
        self._failures_in_row = {url: 0 for url in self._urls}
        self._steps_seen = 0
        self._outbox: collections.deque[_Upload] = collections.deque()
        self._delivered = threading.Event()
        self._counts = dict.fromkeys(ControlStats.__slots__, 0)
        self._logged = 0

    def stats(self) -> ControlStats:
        return ControlStats(**self._counts)

    # --- the worker's rounds ---------------------------------------------------------------

    def on_round(self, steps_received: int) -> None:
        """One worker round: upload answers that are ready; poll the URLs that are due when steps
        arrived since the previous round (`steps_received` is the exporter's running count)."""
        try:
            self._upload_ready(None)
            flowing, self._steps_seen = steps_received != self._steps_seen, steps_received
            if not flowing:
                return
            now = time.monotonic()
            for url in self._urls:
                if now >= self._next_poll[url]:
                    self._poll(url)
        except Exception as exc:  # the worker must survive anything a peer can answer
            self._note(f"capture control error: {type(exc).__name__}: {exc}")

    def finish(self, deadline: float) -> None:
        """Shutdown: an armed capture that never started fails; one being summarised is waited for
        until `deadline` (monotonic); then what is ready is uploaded within it."""
        try:
            capture = sys.modules.get("traceml.deep_capture")
            if capture is not None:
                capture.cancel_pending("the run ended before the capture began")
                while capture.busy():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._delivered.wait(min(left, 0.05))
                    self._delivered.clear()
            self._upload_ready(deadline)
        except Exception as exc:
            self._note(f"capture control error at shutdown: {type(exc).__name__}: {exc}")

    # --- polls -------------------------------------------------------------------------------

    def _poll(self, url: str) -> None:
        ok = False
        try:
            status, _, body = self._polls[url].request("GET", f"{CONTROL_PATH}?{self._query}", self._headers,
                                                      POLL_TIMEOUT_S, max_bytes=MAX_SUMMARY_BYTES)
            if status in (200, 204):
                ok = True
                self._counts["polls"] += 1
                if status == 200:
                    self._received(url, body)
            else:
                text = body[:200].decode("utf-8", "replace")
                self._note(f"capture control poll of {url} answered HTTP {status}: {text}")
        except (OSError, http.client.HTTPException, ssl.SSLError) as exc:
            self._note(f"capture control poll of {url} failed: {type(exc).__name__}: {exc}")
        if ok:
            self._failures_in_row[url] = 0
            delay = self._interval_s
        else:
            self._counts["poll_failures"] += 1
            n = self._failures_in_row[url] = self._failures_in_row[url] + 1
            delay = min(MAX_BACKOFF_S, self._interval_s * (2 ** min(n, 16)))
        self._next_poll[url] = time.monotonic() + delay

    def _received(self, url: str, body: bytes) -> None:
        try:
            request = CaptureRequest.from_json(body)
        except CaptureFormatError as exc:
            self._counts["bad_requests"] += 1
            self._note(f"capture request from {url} ignored: {exc}")
            return
        me = self._identity
        if request.run_id != me.run_id or request.rank != me.rank:
            self._counts["bad_requests"] += 1
            self._note(f"capture request from {url} ignored: it names run {request.run_id!r} rank "
                       f"{request.rank}, this is run {me.run_id!r} rank {me.rank}")
            return
        self._counts["requests"] += 1
        arm = self._arm
        if arm is None:
            from traceml import deep_capture

            arm = deep_capture.arm
        try:
            reason = arm(request, lambda result: self._deliver(url, result))
        except Exception as exc:
            reason = f"the capture could not be armed: {type(exc).__name__}: {exc}"
        if reason is not None:
            self._counts["refused"] += 1
            from traceml.deep_capture import CaptureResult

            self._outbox.append(_Upload(url, CaptureResult(request, failure=reason)))

    def _deliver(self, url: str, result) -> None:
        """The capture's answer (its builder thread): queued for the worker, which is woken."""
        self._outbox.append(_Upload(url, result))
        self._delivered.set()
        self._notify()

    # --- uploads -----------------------------------------------------------------------------

    def _upload_ready(self, deadline: float | None) -> None:
        for _ in range(len(self._outbox)):
            if deadline is not None and time.monotonic() >= deadline:
                return
            upload = self._outbox.popleft()
            if not self._send(upload, deadline):
                upload.attempts += 1
                if upload.attempts < UPLOAD_ATTEMPTS:
                    self._outbox.append(upload)
                else:
                    self._counts["upload_failures"] += len(upload.parts)

    def _send(self, upload: _Upload, deadline: float | None) -> bool:
        """Send the parts left, in order; False when one should be tried again later."""
        request = upload.result.request
        base = f"{upload.url}{CAPTURES_PATH}/{request.capture_id}/ranks/{request.rank}/"
        while upload.parts:
            part = upload.parts[0]
            if part == PART_SUMMARY:
                body, kind = upload.result.summary.to_json(), "application/json"
            elif part == PART_TRACE:
                body, kind = upload.result.trace, "application/gzip"
            else:
                reason = upload.result.failure or "no summary"
                body, kind = json.dumps({"reason": reason[:1000]}).encode(), "application/json"
            outcome, detail = self._post(base + part, body, kind, deadline)
            if outcome == _RETRY:
                return False
            upload.parts.pop(0)
            if outcome == _OK:
                self._counts["uploads"] += 1
                continue
            self._counts["upload_failures"] += 1
            self._note(f"capture {request.capture_id}: the processor refused the {part}: {detail}")
            if part == PART_SUMMARY:  # say why instead of the trace that would follow
                upload.parts = [PART_FAILURE]
                upload.result = type(upload.result)(request, failure=f"the processor refused the summary: {detail}")
        return True

    def _post(self, url: str, body: bytes, kind: str, deadline: float | None) -> tuple[str, str]:
        timeout = self._upload_timeout_s
        if deadline is not None:
            timeout = max(0.05, min(timeout, deadline - time.monotonic()))
        headers = dict(self._headers)
        headers["Content-Type"] = kind
        try:
            response = self._session.post(url, data=body, headers=headers, timeout=timeout,
                                          verify=self._verify, cert=self._cert)
        except self._requests.exceptions.RequestException as exc:
            self._note(f"capture upload to {url} failed: {type(exc).__name__}: {exc}")
            return _RETRY, f"{type(exc).__name__}: {exc}"
        detail = f"HTTP {response.status_code}: {response.text[:200]}"
        if 200 <= response.status_code < 300:
            return _OK, detail
        if response.status_code in (408, 429) or response.status_code >= 500:
            self._note(f"capture upload to {url} answered {detail}")
            return _RETRY, detail
        return _REFUSED, detail

    def close(self) -> None:
        for poll in self._polls.values():
            poll.close()
        try:
            self._session.close()
        except Exception:
            pass

    def _note(self, message: str) -> None:
        """First at WARNING, then every 100th: a processor that is away must not flood the log."""
        if self._logged % 100 == 0:
            _log.warning("traceml: %s (capture control messages so far: %d)", message, self._logged + 1)
        else:
            _log.debug("traceml: %s", message)
        self._logged += 1
