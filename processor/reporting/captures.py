"""Deep captures as every surface shows them: the public `captures` section and its text lines.

`project_captures` turns the capture book's `CaptureRecord`s (`processor.capture.model`; the
digest's figures come from `processor.capture.digest`, which owns them) into the `captures`
section of `final_summary.json`; `link_findings` writes each capture's id into the evidence of
the finding that triggered it; `capture_lines` writes the card's lines from the section, so the
card, the web view and the report read the same rounded numbers. Pure and presenting only: it
never computes an excess, a share or a gap. Operator names come from the ranks: the card passes
through `printable`, the pages through `html.escape`; this module returns them as sent.
"""
from __future__ import annotations

import datetime as _dt
from typing import Iterable, Mapping, Sequence

from traceml.processor.capture.model import CaptureRecord, Digest
from traceml.processor.reporting.public_number import public_number
from traceml.schema.capture import STATUS_DONE, STATUS_FAILED, STATUS_REFUSED, TRIGGER_MANUAL

_MS_DIGITS = 3
_RATIO_DIGITS = 4

CAPTURE_KEYS: tuple[str, ...] = ("capture_id", "trigger", "status", "reason", "culprit_rank", "reference_rank",
                                 "steps", "requested_at", "finished_at", "traces", "digest")
"""Keys of one `captures[]` entry."""
DIGEST_KEYS: tuple[str, ...] = ("gap_ms", "culprit_step_ms", "reference_step_ms", "culprit_steps",
                                "reference_steps", "rows", "rows_left_out", "not_seen", "phase_gap")
ROW_KEYS: tuple[str, ...] = ("name", "kind", "culprit_ms", "reference_ms", "excess_ms", "share_of_gap")
PHASE_KEYS: tuple[str, ...] = ("phase", "culprit_ms", "reference_ms", "gap_ms")
EVIDENCE_KEY = "capture_id"
"""The evidence key a triggering finding gains."""

UNITS: Mapping[str, str] = {
    "share_of_gap": "ratio of the capture's gap_ms (culprit minus reference, per captured step)",
    "requested_at": "ISO 8601, UTC",
    "finished_at": "ISO 8601, UTC",
}
"""The units block's entries for the capture keys (`final_summary.UNITS` adds them); `*_ms` is
milliseconds per captured step there."""
OPEN_NOTE = ("raw traces: open a .pt.trace.json.gz in Perfetto (ui.perfetto.dev), or run "
             "`tensorboard --logdir <run dir>` in the run folder that holds them")
"""How the raw traces are opened: one sentence for the card, the web view and the report."""
CARD_ROWS = 3
"""Rows of a digest the card's one line names (the web view and the report show them all)."""


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _ms(value: float | None) -> float | None:
    return public_number(value, _MS_DIGITS)


def project_digest(digest: Digest | None) -> dict | None:
    """One capture's public `digest` (None: the capture has none, it failed or is not done)."""
    if digest is None:
        return None
    return {
        "gap_ms": _ms(digest.gap_ms),
        "culprit_step_ms": _ms(digest.culprit_step_ms),
        "reference_step_ms": _ms(digest.reference_step_ms),
        "culprit_steps": int(digest.culprit_steps),
        "reference_steps": int(digest.reference_steps),
        "rows": [{"name": row.name, "kind": row.kind, "culprit_ms": _ms(row.culprit_ms),
                  "reference_ms": _ms(row.reference_ms), "excess_ms": _ms(row.excess_ms),
                  "share_of_gap": public_number(row.share_of_gap, _RATIO_DIGITS)} for row in digest.rows],
        "rows_left_out": int(digest.rows_left_out),
        "not_seen": list(digest.not_seen),
        "phase_gap": [{"phase": g.phase, "culprit_ms": _ms(g.culprit_ms), "reference_ms": _ms(g.reference_ms),
                       "gap_ms": _ms(g.gap_ms)} for g in digest.phase_gap],
    }


def project_capture(record: CaptureRecord) -> dict:
    return {
        "capture_id": record.capture_id,
        "trigger": record.trigger,
        "status": record.status,
        "reason": record.reason,
        "culprit_rank": int(record.culprit_rank),
        "reference_rank": None if record.reference_rank is None else int(record.reference_rank),
        "steps": int(record.steps),
        "requested_at": _iso(record.requested_at),
        "finished_at": _iso(record.finished_at),
        "traces": list(record.traces),
        "digest": project_digest(record.digest),
    }


def project_captures(records: Iterable[CaptureRecord]) -> list[dict]:
    """The public `captures` section: every capture of the run, oldest first."""
    return [project_capture(r) for r in sorted(records, key=lambda r: (r.requested_at, r.capture_id))]


def link_findings(issues: Sequence[dict], captures: Sequence[Mapping]) -> None:
    """Give each projected finding that triggered a capture that capture's id in its evidence (the
    latest one when several did): same kind as the trigger and the same culprit rank."""
    for capture in captures:  # oldest first: a later capture of the same finding wins
        if capture["trigger"] == TRIGGER_MANUAL:
            continue
        for issue in issues:
            if issue["kind"] == capture["trigger"] and issue["culprit_rank"] == capture["culprit_rank"]:
                # First, so a view that shows only an evidence's first entries still shows it.
                rest = {k: v for k, v in issue["evidence"].items() if k != EVIDENCE_KEY}
                issue["evidence"] = {EVIDENCE_KEY: capture["capture_id"], **rest}


# --- Text ------------------------------------------------------------------------------------


def _signed(value: float) -> str:
    return f"{value:+.1f}"


def row_text(row: Mapping) -> str:
    """`aten::sort +21.3 ms/step (94 % of the gap)`; an unknown reference time is said."""
    if row["excess_ms"] is None:
        return f"{row['name']} {row['culprit_ms']:.1f} ms/step (reference time unknown)"
    share = "" if row["share_of_gap"] is None else f" ({row['share_of_gap']:.0%} of the gap)".replace("%", " %")
    return f"{row['name']} {_signed(row['excess_ms'])} ms/step{share}"


def capture_heading(capture: Mapping) -> str:
    """`rank 1 vs rank 0 over 5 steps` (the reference named when there is one)."""
    ref = "" if capture["reference_rank"] is None else f" vs rank {capture['reference_rank']}"
    return f"rank {capture['culprit_rank']}{ref} over {capture['steps']} step(s)"


def status_text(capture: Mapping) -> str:
    """The capture's one line when it has no digest: its state, and why when it failed or was refused."""
    status = capture["status"]
    if status in (STATUS_FAILED, STATUS_REFUSED):
        return f"{status}: {capture['reason'] or 'no reason given'}"
    if status == STATUS_DONE:
        return "done, no digest"
    return status


def capture_line(capture: Mapping) -> str:
    """One line: the heading and the largest excesses, or the state when there is no digest."""
    head = f"Capture {capture['capture_id']}: {capture_heading(capture)}"
    digest = capture["digest"]
    if digest is None:
        return f"{head}: {status_text(capture)}"
    rows = [r for r in digest["rows"] if r["excess_ms"] is None or r["excess_ms"] > 0][:CARD_ROWS]
    if not rows:
        return f"{head}: no entry took longer on rank {capture['culprit_rank']} (gap {digest['gap_ms']:+.1f} ms/step)"
    return f"{head}: " + "; ".join(row_text(r) for r in rows)


def capture_lines(captures: Sequence[Mapping], capture_id: str | None = None) -> list[str]:
    """The card's lines for one capture (`capture_id`, under its finding) or, with None, for every
    capture no finding names (a person's requests), each with its trace files."""
    chosen = [c for c in captures if c["capture_id"] == capture_id] if capture_id is not None else list(captures)
    lines: list[str] = []
    for capture in chosen:
        lines.append(f"  {capture_line(capture)}")
        if capture["traces"]:
            lines.append("    traces: " + ", ".join(capture["traces"]))
    return lines


def unlinked(captures: Sequence[Mapping], issues: Sequence[Mapping]) -> list[Mapping]:
    """Captures no finding's evidence names (manual ones, and those whose finding is gone)."""
    named = {issue["evidence"].get(EVIDENCE_KEY) for issue in issues if isinstance(issue.get("evidence"), Mapping)}
    return [c for c in captures if c["capture_id"] not in named]


__all__ = ["CAPTURE_KEYS", "UNITS", "DIGEST_KEYS", "EVIDENCE_KEY", "OPEN_NOTE", "PHASE_KEYS", "ROW_KEYS", "capture_heading",
           "capture_line", "capture_lines", "link_findings", "project_capture", "project_captures",
           "project_digest", "row_text", "status_text", "unlinked"]
