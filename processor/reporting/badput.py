"""The badput ledger as every surface shows it: the public `badput` section and its text lines.

`project_badput` turns a `RunLedger` (`processor.diagnosis.ledger`, which owns every
figure) into the `badput` section of `final_summary.json`; `badput_lines` writes the
card's lines from that section, so the card, the web view, the report and
`traceml compare` read the same rounded numbers. Pure and presenting only: it
never computes a loss, a share or a speed-up. The shape never changes with what
was measured: every key is always present, an unmeasurable figure is null, a
measured zero is 0.0.
"""
from __future__ import annotations

from typing import Mapping

from traceml.processor.reporting.public_number import public_number
from traceml.schema.badput import CAUSE_RESTARTS, LEDGER_CAUSES

_SECONDS_DIGITS = 3
_HOURS_DIGITS = 6
_RATIO_DIGITS = 4
_MS_DIGITS = 3

CAUSE_KEYS: tuple[str, ...] = ("rank_seconds", "device_hours", "share", "ranks", "worst_rank", "culprit_rank")
"""Keys of one cause's entry (`badput.window.causes[cause]`, `badput.run.causes[cause]`)."""
WHAT_IF_KEYS: tuple[str, ...] = (
    "kind", "cause", "culprit_rank", "basis", "step_time_ms", "predicted_step_time_ms", "speedup",
    "speedup_low", "speedup_high", "lost_rank_seconds", "lost_device_hours",
)
"""Keys of one `badput.what_if[]` entry."""
RESTART_KEYS: tuple[str, ...] = ("attempts", "redone_steps", "redone_rank_seconds", "downtime_s",
                                 "downtime_rank_seconds")

CAUSE_LABELS: Mapping[str, str] = {
    "straggler_wait": "straggler wait", "input_stall": "input stall", "h2d": "H2D",
    "communication": "communication", "drift": "drift", "restarts": "restarts",
}

UNITS: Mapping[str, str] = {
    "*rank_seconds": "rank-seconds: seconds of one rank's time, summed over ranks",
    "*device_hours": "device-hours: hours of one GPU's time, summed over GPUs (null: no GPU known)",
    "speedup*": "ratio: step time now / predicted step time",
    "downtime_s": "seconds (wall clock)",
}
"""The units block's entries for the badput keys (`final_summary.UNITS` adds them)."""


def _cause(loss) -> dict:
    if loss is None:
        return {k: (0 if k == "ranks" else None) for k in CAUSE_KEYS}
    return {"rank_seconds": public_number(loss.rank_seconds, _SECONDS_DIGITS),
            "device_hours": public_number(loss.device_hours, _HOURS_DIGITS),
            "share": public_number(loss.share, _RATIO_DIGITS), "ranks": int(loss.ranks),
            "worst_rank": loss.worst_rank, "culprit_rank": loss.culprit_rank}


def _causes(causes: Mapping | None) -> dict:
    causes = causes or {}
    return {cause: _cause(causes.get(cause)) for cause in LEDGER_CAUSES}


def _what_if(w) -> dict:
    return {"kind": w.kind, "cause": w.cause, "culprit_rank": w.culprit_rank, "basis": w.basis,
            "step_time_ms": public_number(w.step_time_ms, _MS_DIGITS),
            "predicted_step_time_ms": public_number(w.predicted_step_time_ms, _MS_DIGITS),
            "speedup": public_number(w.speedup, _RATIO_DIGITS), "speedup_low": public_number(w.speedup_low, _RATIO_DIGITS),
            "speedup_high": public_number(w.speedup_high, _RATIO_DIGITS),
            "lost_rank_seconds": public_number(w.rank_seconds, _SECONDS_DIGITS),
            "lost_device_hours": public_number(w.device_hours, _HOURS_DIGITS)}


def project_badput(ledger) -> dict:
    """The public `badput` section of a `RunLedger` (None: a section of nulls)."""
    window = None if ledger is None else ledger.window
    restarts = None if ledger is None else ledger.restarts
    return {
        "available": window is not None and window.total_rank_seconds is not None,
        "step_basis": None if window is None else window.step_basis,
        "devices_known": 0 if window is None else int(window.devices_known),
        "window": {
            "steps": 0 if window is None else int(window.steps),
            "first_step": None if window is None else window.first_step,
            "last_step": None if window is None else window.last_step,
            "ranks": 0 if window is None else int(window.ranks),
            "rank_seconds": None if window is None else public_number(window.window_rank_seconds, _SECONDS_DIGITS),
            "total_rank_seconds": None if window is None else public_number(window.total_rank_seconds, _SECONDS_DIGITS),
            "total_share": None if window is None else public_number(window.total_share, _RATIO_DIGITS),
            "total_device_hours": None if window is None else public_number(window.total_device_hours, _HOURS_DIGITS),
            "causes": _causes(None if window is None else window.causes),
        },
        "run": {
            "steps": None if ledger is None else ledger.run_steps,
            "scale": None if ledger is None else public_number(ledger.scale, _RATIO_DIGITS),
            "total_rank_seconds": None if ledger is None else public_number(ledger.total_rank_seconds, _SECONDS_DIGITS),
            "total_device_hours": None if ledger is None else public_number(ledger.total_device_hours, _HOURS_DIGITS),
            "causes": _causes(None if ledger is None else ledger.causes),
        },
        "restarts": None if restarts is None else {
            "attempts": int(restarts.attempts), "redone_steps": int(restarts.redone_steps),
            "redone_rank_seconds": public_number(restarts.redone_rank_seconds, _SECONDS_DIGITS),
            "downtime_s": public_number(restarts.downtime_s, _SECONDS_DIGITS),
            "downtime_rank_seconds": public_number(restarts.downtime_rank_seconds, _SECONDS_DIGITS)},
        "what_if": [] if window is None else [_what_if(w) for w in window.what_ifs],
    }


def project_window_badput(analysis) -> dict:
    """The `badput` section of an analysis's window ledger alone (the live view: no run facts read,
    so the run so far is the window); the ledger's owner makes the run ledger."""
    from traceml.processor.diagnosis.ledger import WindowLedger, run_ledger

    ledger = getattr(analysis, "ledger", None)
    return project_badput(run_ledger(ledger) if isinstance(ledger, WindowLedger) else None)


# --- Text -----------------------------------------------------------------------------------


def fmt_rank_time(seconds: float | None) -> str:
    """Rank-seconds for people: `12.3 rank-s`, `4.5 rank-min`, `6.78 rank-h`; `—` when unknown."""
    if seconds is None:
        return "—"
    if seconds < 120:
        return f"{seconds:.1f} rank-s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} rank-min"
    return f"{seconds / 3600:,.2f} rank-h"


def fmt_device_hours(hours: float | None, devices_known: int) -> str:
    if not devices_known or hours is None:
        return "device-hours: none known (no GPU reported)"
    return f"{hours:,.3f} device-h ({devices_known} GPU(s) known)"


def _share(share: float | None) -> str:
    return "" if share is None else f" ({share:.0%})"


def cause_text(cause: str, entry: Mapping) -> str:
    """`straggler wait 6.0 rank-s (9%), waiting for rank 1`: one cause as the card says it."""
    text = f"{CAUSE_LABELS.get(cause, cause)} {fmt_rank_time(entry['rank_seconds'])}{_share(entry['share'])}"
    if entry.get("culprit_rank") is not None:
        text += f", waiting for rank {entry['culprit_rank']}"
    elif entry.get("worst_rank") is not None:
        text += f", most on rank {entry['worst_rank']}"
    return text


def what_if_text(w: Mapping) -> str:
    """`INPUT_STRAGGLER (rank 1) at the median: step 140.0 -> 40.0 ms, 3.50x faster (3.40x-3.60x)`."""
    who = "" if w["culprit_rank"] is None else f" (rank {w['culprit_rank']})"
    how = {"median": "at the median", "removed": "removed", "best_window": "back at its best window"}.get(
        w["basis"], str(w["basis"]))
    interval = ("" if w["speedup_low"] is None or w["speedup_high"] is None
                else f" ({w['speedup_low']:.2f}x-{w['speedup_high']:.2f}x)")
    speed = "—" if w["speedup"] is None else f"{w['speedup']:.2f}x"
    return (f"{w['kind']}{who} {how}: step {w['step_time_ms']:.1f} -> {w['predicted_step_time_ms']:.1f} ms, "
            f"{speed} faster{interval}")


def badput_lines(section: Mapping) -> list[str]:
    """The card's (and the report's text) lines of the `badput` section; none without a ledger.
    Kinds and numbers only (no string from the wire), yet the card escapes everything anyway."""
    if not section["available"]:
        return []
    win, run = section["window"], section["run"]
    steps = "" if run["steps"] is None else f" ({run['steps']:,} steps)"
    lines = ["",
             f"Lost time: {fmt_rank_time(win['total_rank_seconds'])} over the window{_share(win['total_share'])};"
             f" about {fmt_rank_time(run['total_rank_seconds'])} over the run so far{steps};"
             f" {fmt_device_hours(run['total_device_hours'], section['devices_known'])}"]
    parts = [cause_text(c, run["causes"][c]) for c in LEDGER_CAUSES  # what rounds to 0 % is left out
             if c != CAUSE_RESTARTS and (run["causes"][c]["share"] or 0) >= 0.005]
    if parts:
        lines.append("  run so far: " + "; ".join(parts))
    restarts = section["restarts"]
    if restarts is not None and restarts["attempts"] > 1:
        lines.append(f"  restarts: {restarts['attempts'] - 1} restart(s), {restarts['redone_steps']:,} rank-step(s) "
                     f"done again ({fmt_rank_time(restarts['redone_rank_seconds'])}), "
                     f"{restarts['downtime_s']:.1f} s between attempts "
                     f"({fmt_rank_time(restarts['downtime_rank_seconds'])})")
    for w in section["what_if"]:
        lines.append(f"What if: {what_if_text(w)}")
    return lines


def live_badput_text(section: Mapping) -> str | None:
    """One line for the live view: the window's lost time, its largest causes, the first what-if.
    None without a ledger."""
    if not section["available"]:
        return None
    win = section["window"]
    causes = sorted(((entry["share"] or 0.0, cause) for cause, entry in win["causes"].items()
                     if (entry["share"] or 0.0) >= 0.005), reverse=True)[:3]
    text = (f"Lost time: {fmt_rank_time(win['total_rank_seconds'])} over the window{_share(win['total_share'])}"
            + (": " + ", ".join(cause_text(c, win["causes"][c]) for _, c in causes) if causes else ""))
    if section["what_if"]:
        text += f" | what if {what_if_text(section['what_if'][0])}"
    return text


def lost_total(summary: Mapping) -> float | None:
    """A summary's lost rank-seconds over the run so far (None: an older summary, or none measurable)."""
    section = summary.get("badput") if isinstance(summary, Mapping) else None
    run = section.get("run") if isinstance(section, Mapping) else None
    value = run.get("total_rank_seconds") if isinstance(run, Mapping) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


__all__ = [
    "CAUSE_KEYS", "CAUSE_LABELS", "RESTART_KEYS", "UNITS", "WHAT_IF_KEYS", "badput_lines", "cause_text",
    "fmt_device_hours", "fmt_rank_time", "live_badput_text", "lost_total", "project_badput",
    "project_window_badput", "what_if_text",
]
