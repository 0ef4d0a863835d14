"""Rank-side: a job under `traceml run` that lasts until the processor's automatic deep capture of
its run ended, every rank leaving at the same update.

Rank 0 asks the processor `traceml run` named to the ranks (the first URL in
TRACEML_CONTROL_ENDPOINT, with the ranks' token from TRACEML_OTLP_HEADERS: a multi-node processor
requires it) for the run's captures on a thread (`CaptureWatch`); the loop calls `stop_together`
after each step, outside it, so the other ranks learn through one all-reduce and no rank is left
waiting in a collective. Used by harness.sort_straggler_job and tests/launcher/scripts/plain_loop.py's
--until-capture.
"""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from typing import Callable, Optional

from traceml.schema.capture import CAPTURES_PATH
from traceml.schema.otlp_headers import parse_otlp_headers

POLL_S = 0.3  # between two asks of the captures route


def control_endpoint() -> str:
    """The processor's control URL `traceml run` gave the ranks (the first of a list), no trailing slash."""
    return os.environ.get("TRACEML_CONTROL_ENDPOINT", "").split(",")[0].rstrip("/")


def automatic_capture_ended(captures: list[dict]) -> bool:
    """Whether a capture the processor asked for itself (not a person's `manual` one) is done or failed."""
    return any(c["trigger"] != "manual" and c["status"] in ("done", "failed") for c in captures)


def run_captures() -> list[dict]:
    """The captures of this run (TRACEML_RUN_ID) as the processor's captures route lists them; none
    while it cannot answer (not up yet, or busy: the caller asks again)."""
    url = f"{control_endpoint()}{CAPTURES_PATH}?run_id={os.environ['TRACEML_RUN_ID']}"
    headers = dict(parse_otlp_headers(os.environ.get("TRACEML_OTLP_HEADERS", "")))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the processor is never behind a proxy
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=5) as answer:
            return json.loads(answer.read())["captures"]
    except OSError:
        return []


class CaptureWatch:
    """Rank 0's thread: asks for the run's captures until an automatic one ended (or `max_seconds`
    passed), then runs `then(watch)` (a follow-up such as a person's `traceml capture`, or keeping
    what the route said) and sets `ended`, always, so the loop stops even if the follow-up failed.

    `seen` holds the route's last answer; `timed_out` says the bound, not the capture, ended it.
    """

    def __init__(self, max_seconds: Optional[float] = None,
                 then: Optional[Callable[["CaptureWatch"], None]] = None) -> None:
        self.max_seconds = max_seconds
        self.then = then
        self.ended = threading.Event()
        self.seen: list[dict] = []
        self.timed_out = False

    def start(self) -> "CaptureWatch":
        threading.Thread(target=self._watch, name="capture-watch", daemon=True).start()
        return self

    def _watch(self) -> None:
        deadline = None if self.max_seconds is None else time.monotonic() + self.max_seconds
        try:
            while True:
                self.seen = run_captures()
                if automatic_capture_ended(self.seen):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    self.timed_out = True
                    break
                time.sleep(POLL_S)
            if self.then is not None:
                self.then(self)
        finally:
            self.ended.set()


def stop_together(watch: Optional[CaptureWatch]) -> bool:
    """After a step, outside it, on every rank: True on all ranks once rank 0's watch ended (one
    all-reduce of a flag; ranks without a watch pass None)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1.0 if watch is not None and watch.ended.is_set() else 0.0])
    dist.all_reduce(flag)
    return flag.item() > 0
