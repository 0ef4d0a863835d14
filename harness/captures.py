"""Hand-built capture records for surface tests: two ranks' summaries in, `CaptureRecord`s out.

The digest is the real `compute_digest` of summaries stated by hand (an extra sort on the
culprit, a reference that left entries out), so the surfaces are tested on the figures the
digest's owner makes. Operator names can be made hostile to test every surface's escaping.
"""
from __future__ import annotations

from traceml.processor.capture.digest import compute_digest
from traceml.processor.capture.model import CaptureRecord
from traceml.schema.capture import (
    HOST_NAME,
    KIND_COLLECTIVE,
    KIND_HOST,
    KIND_INPUT,
    KIND_OP,
    ROLE_CULPRIT,
    ROLE_REFERENCE,
    STATUS_DONE,
    STATUS_FAILED,
    TRIGGER_MANUAL,
    OpTime,
    RankCaptureSummary,
    trace_file_name,
)

STEPS = 5
HOSTILE_OP = "<script>alert(1)</script>[bold red]aten::evil"
"""An operator name a rank could send: HTML and Rich markup both."""
_BASE = {"aten::addmm": (KIND_OP, 4.0), "gloo:all_reduce": (KIND_COLLECTIVE, 2.0),
         "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__": (KIND_INPUT, 0.5),
         HOST_NAME: (KIND_HOST, 3.0)}


def rank_summary(capture_id: str, run_id: str, rank: int, role: str, step_ms: float,
                 ops: dict[str, tuple[str, float]], *, left_out: int = 0) -> RankCaptureSummary:
    """`ops`: name -> (kind, ms per step), stored summed over the steps as a rank sends them."""
    return RankCaptureSummary(
        capture_id=capture_id, run_id=run_id, rank=rank, role=role, first_step=12,
        step_ms=(step_ms,) * STEPS, activities=("cpu",),
        ops=tuple(OpTime(name=n, kind=k, count=STEPS, self_ms=ms * STEPS) for n, (k, ms) in ops.items()),
        ops_left_out=left_out, trace_bytes=4096, torch_version="test")


def capture_records(run_id: str, trigger: str, culprit: int, reference: int, *,
                    extra_op: str = "aten::sort", requested_at: float = 1_700_000_100.0
                    ) -> tuple[CaptureRecord, CaptureRecord]:
    """A done capture triggered by `trigger` (its culprit ran `extra_op` 21 ms/step more than the
    reference, of a 22 ms/step gap, and one op the reference left out of its summary) and a
    person's later capture that failed."""
    cid = "cap-1"
    c = rank_summary(cid, run_id, culprit, ROLE_CULPRIT, 32.0,
                     {**_BASE, extra_op: (KIND_OP, 21.5), "aten::rare": (KIND_OP, 1.0),
                      HOST_NAME: (KIND_HOST, 4.0)})
    r = rank_summary(cid, run_id, reference, ROLE_REFERENCE, 10.0, {**_BASE, extra_op: (KIND_OP, 0.5)}, left_out=7)
    traces = (trace_file_name(run_id, cid, culprit), trace_file_name(run_id, cid, reference))
    done = CaptureRecord(capture_id=cid, run_id=run_id, trigger=trigger, status=STATUS_DONE,
                         culprit_rank=culprit, reference_rank=reference, steps=STEPS,
                         requested_at=requested_at, finished_at=requested_at + 9.5, summaries=(c, r),
                         traces=traces, digest=compute_digest(c, r, phase_means={"forward": (26.0, 5.0)}))
    failed = CaptureRecord(capture_id="cap-2", run_id=run_id, trigger=TRIGGER_MANUAL, status=STATUS_FAILED,
                           culprit_rank=reference, reference_rank=None, steps=STEPS,
                           requested_at=requested_at + 400.0, finished_at=requested_at + 520.0,
                           reason=f"rank {reference} did not answer within the 120 s deadline")
    return done, failed
