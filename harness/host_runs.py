"""Short two-rank runs whose ranks claim a host, sent as TraceML's wire format over OTLP/HTTP.

What the repeat-offender and exemplar tests need from a "run": a rank whose resource says
`host.name` = the culprit host and is the straggler of its run (the contract's
`ddp_rank_straggler` figures: rank 0 waits 100 ms for input, rank 1 waits in backward for
it, so INPUT_STRAGGLER crit with culprit 0 after 24 steps), then both ranks' end markers so
the processor ends and summarises the run at once. No torch, no SDK: the protobuf requests
`harness.otlp_payloads` builds, POSTed as a rank's exporter would.
"""
from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass, field
from typing import Mapping

from harness.otlp_payloads import run_end_span, step_span, trace_request
from traceml.schema import vocabulary as v

CULPRIT_EVENTS_MS: Mapping[str, float] = {v.RAW_DATALOADER_NEXT: 100.0, v.RAW_FORWARD: 20.0,
                                          v.RAW_BACKWARD: 20.0, v.RAW_STEP_TIME: 140.0}
WAITING_EVENTS_MS: Mapping[str, float] = {v.RAW_DATALOADER_NEXT: 0.0, v.RAW_FORWARD: 20.0,
                                          v.RAW_BACKWARD: 120.0, v.RAW_STEP_TIME: 140.0}
STEPS = 24


@dataclass
class SentRun:
    """What was sent: the run, its ranks' hosts, and every step span's ids by (rank, step)."""

    run_id: str
    hosts: dict[int, str]
    span_ids: dict[tuple[int, int], tuple[bytes, bytes]] = field(default_factory=dict)
    step_ms: dict[tuple[int, int], float] = field(default_factory=dict)


def post(http_port: int, request, path: str = "/v1/traces") -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}{path}", data=request.SerializeToString(),
                                 headers={"Content-Type": "application/x-protobuf"}, method="POST")
    with urllib.request.urlopen(req, timeout=30) as response:
        assert response.status == 200, response.status


def send_straggler_run(http_port: int, run_id: str, culprit_host: str, other_host: str, *,
                       steps: int = STEPS, slow_step: int | None = None, end: bool = True) -> SentRun:
    """Rank 0 (on `culprit_host`) is the input straggler, rank 1 (on `other_host`) waits for it.

    `slow_step`: this step of rank 0 takes 3x as long (the window's worst step, for exemplars).
    A culprit's GPU comes from real ranks (tests/processor/test_repeat_offenders.py)."""
    sent = SentRun(run_id, {0: culprit_host, 1: other_host})
    start = time.time() - steps * 0.2
    for rank, events, host in ((0, CULPRIT_EVENTS_MS, culprit_host), (1, WAITING_EVENTS_MS, other_host)):
        spans = []
        for step in range(steps):
            step_events = dict(events)
            if rank == 0 and step == slow_step:
                step_events = {name: value * 3 for name, value in events.items()}
            span = step_span(step, rank, step_events, end_s=start + step * 0.15)
            sent.span_ids[(rank, step)] = (span.trace_id, span.span_id)
            sent.step_ms[(rank, step)] = step_events[v.RAW_STEP_TIME]
            spans.append(span)
        if end:
            spans.append(run_end_span(rank, steps))
        post(http_port, trace_request(run_id, rank, spans, world_size=2, extra={v.RES_HOST_NAME: host}))
    return sent


__all__ = ["CULPRIT_EVENTS_MS", "STEPS", "SentRun", "WAITING_EVENTS_MS", "post", "send_straggler_run"]
