"""The capture paths on the OTLP/HTTP receiver (`schema.capture` names them and their documents).

Mounted on the receiver's app (`OtlpHttpApp.mount`), so they share its port, TLS, bearer token
and admission: a request without the token is answered 401 before anything else is looked at,
and a POST beyond the concurrent-request limit 429 before its body is read. Answers are JSON
(`{"error": ...}` for a refusal); the book decides, this module only translates:

- `GET CONTROL_PATH?run_id=R&rank=N`: 200 + the `CaptureRequest` (now taken), else 204;
- `POST CAPTURES_PATH` (`ManualRequest`): 202 `{"capture_id", ...}`; 403 off, 404 not this
  processor's run, 409 one in progress, 400 a bad body (the message names the problem);
- `GET CAPTURES_PATH?run_id=R`, `GET CAPTURES_PATH/<id>`: the records (`record_json`);
- `POST CAPTURES_PATH/<id>/ranks/<rank>/{summary,trace,failure}`: a rank's answer; 400 a bad
  summary (nothing stored), 413 a trace over the cap, 404 a capture this processor does not hold.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict
from urllib.parse import parse_qs

from traceml.processor.capture.book import CaptureBook, CaptureRefused
from traceml.processor.capture.model import CaptureRecord
from traceml.processor.http_front import Accept, Reply, RequestHead
from traceml.schema.capture import (
    CAPTURES_PATH,
    CONTROL_PATH,
    PART_FAILURE,
    PART_SUMMARY,
    PART_TRACE,
    CaptureFormatError,
    ManualRequest,
)

LOG = logging.getLogger(__name__)

JSON = "application/json"
MAX_FAILURE_BYTES = 4096


def _json(status: int, doc, headers: tuple = ()) -> Reply:
    return Reply(status, json.dumps(doc).encode(), JSON, headers)


def _error(status: int, message: str, headers: tuple = ()) -> Reply:
    return _json(status, {"error": message}, headers)


def record_json(record: CaptureRecord) -> dict:
    """A record as the routes (and `traceml capture`) read it: its fields, the digest's as they are,
    each rank's summary reduced to what a reader needs (rank, role, steps, trace note)."""
    return {
        "capture_id": record.capture_id, "run_id": record.run_id, "trigger": record.trigger,
        "status": record.status, "reason": record.reason, "culprit_rank": record.culprit_rank,
        "reference_rank": record.reference_rank, "steps": record.steps, "requested_at": record.requested_at,
        "finished_at": record.finished_at, "traces": list(record.traces),
        "ranks": [{"rank": s.rank, "role": s.role, "first_step": s.first_step, "steps": len(s.step_ms),
                   "activities": list(s.activities), "trace_note": s.trace_note} for s in record.summaries],
        "digest": None if record.digest is None else asdict(record.digest),
    }


class CaptureRoutes:
    """One callable for both prefixes (`mount(CONTROL_PATH, ...)`, `mount(CAPTURES_PATH, ...)`)."""

    def __init__(self, book: CaptureBook, app):
        self.book = book
        self.app = app  # the receiver's `OtlpHttpApp`: its token and admission

    def __call__(self, head: RequestHead) -> Reply | Accept:
        if not self.app.auth.allows(head.headers.get("authorization")):
            return _error(401, "missing or wrong bearer token", (("WWW-Authenticate", "Bearer"),))
        path = head.path.rstrip("/")
        if path == CONTROL_PATH:
            if head.method != "GET":  # not HEAD either: answering hands the request out
                return _error(405, "the control path answers GET", (("Allow", "GET"),))
            return self._control(head)
        parts = path[len(CAPTURES_PATH):].strip("/").split("/") if path != CAPTURES_PATH else []
        if head.method in ("GET", "HEAD"):
            if not parts:
                return self._list(head)
            if len(parts) == 1:
                record = self.book.get(parts[0])
                if record is None:
                    return _error(404, f"capture {parts[0][:80]!r} is not held by this processor")
                return _json(200, record_json(record))
            return _error(404, "no such capture path")
        if head.method != "POST":
            return _error(405, "method not allowed", (("Allow", "GET, POST"),))
        if not parts:
            return self._admitted(self._manual)
        if len(parts) == 4 and parts[1] == "ranks" and parts[3] in (PART_SUMMARY, PART_TRACE, PART_FAILURE):
            try:
                rank = int(parts[2])
            except ValueError:
                return _error(400, f"rank must be a whole number, got {parts[2][:20]!r}")
            capture_id, part = parts[0], parts[3]
            # A trace is read up to the capture cap (413 beyond, unread); every other body up to the front's.
            cap = self.book.max_trace_bytes if part == PART_TRACE else None
            return self._admitted(lambda body: self._answer(capture_id, rank, part, body), cap)
        return _error(404, "no such capture path")

    def _admitted(self, handle, max_body_bytes: int | None = None) -> Reply | Accept:
        """Read the body under the receiver's admission limit (429 beyond it, before the body)."""
        app = self.app
        if app.in_flight >= app.max_concurrent_requests:
            return _error(429, f"over the limit of {app.max_concurrent_requests} concurrent requests",
                          (("Retry-After", "1"),))
        app.in_flight += 1
        return Accept(handle=lambda body: self._guarded(handle, body),
                      error=lambda code, message: _error(code, message), release=app._release,
                      max_body_bytes=max_body_bytes)

    @staticmethod
    def _guarded(handle, body: bytes) -> Reply:
        try:
            return handle(body)
        except CaptureRefused as exc:
            return _error(exc.status, str(exc))

    def _control(self, head: RequestHead) -> Reply:
        query = parse_qs(head.query)
        run_id, rank = (query.get("run_id") or [None])[0], (query.get("rank") or [None])[0]
        if not run_id or rank is None:
            return _error(400, "the control path needs ?run_id=...&rank=...")
        try:
            rank_n = int(rank)
        except ValueError:
            return _error(400, f"rank must be a whole number, got {rank[:20]!r}")
        request = self.book.pending_for(run_id, rank_n)
        if request is None:
            return Reply(204)
        return Reply(200, request.to_json(), JSON)

    def _list(self, head: RequestHead) -> Reply:
        run_id = (parse_qs(head.query).get("run_id") or [None])[0]
        if not run_id:
            return _error(400, "list captures with ?run_id=...")
        return _json(200, {"run_id": run_id, "captures": [record_json(r) for r in self.book.of_run(run_id)]})

    def _manual(self, body: bytes) -> Reply:
        try:
            request = ManualRequest.from_json(body)
        except CaptureFormatError as exc:
            return _error(400, str(exc))
        record = self.book.request_capture(request.run_id, request.rank, request.reference, request.steps)
        return _json(202, {"capture_id": record.capture_id, "run_id": record.run_id,
                           "culprit_rank": record.culprit_rank, "reference_rank": record.reference_rank,
                           "steps": record.steps})

    def _answer(self, capture_id: str, rank: int, part: str, body: bytes) -> Reply:
        if part == PART_SUMMARY:
            record = self.book.receive_summary(capture_id, rank, body)
        elif part == PART_TRACE:
            record = self.book.receive_trace(capture_id, rank, body)
        else:
            if len(body) > MAX_FAILURE_BYTES:
                return _error(413, f"a failure report is at most {MAX_FAILURE_BYTES} bytes")
            try:
                doc = json.loads(body)
                reason = doc["reason"]
                if not isinstance(reason, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                return _error(400, 'a failure report is {"reason": "..."}')
            record = self.book.receive_failure(capture_id, rank, reason)
        return _json(200, {"capture_id": capture_id, "status": record.status})
