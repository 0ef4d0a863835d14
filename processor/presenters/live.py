"""Pure live-view presenters: a `LiveStepTimeResult` in, a Rich renderable or a text line out.

They only format what the analysis already holds; they never read SQLite,
run the pipeline or diagnose. The resource lines are the card's own
(`reporting.resources`, from the same projected section), so the live view and
the card say the same of the same analysis. Every string that came from the wire (run id,
strategy, issue texts, an error message) passes `terminal_text.printable` and
reaches Rich as `Text`, never as markup.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from traceml.processor.presenters.terminal_text import printable, printable_text
from traceml.processor.reporting.badput import live_badput_text, project_window_badput
from traceml.processor.reporting.input_note import before_forward_note
from traceml.processor.reporting.resources import (
    live_resource_text,
    project_resources,
    resource_lines,
    resource_window_of,
)
from traceml.processor.step_time.model import (
    FRESHNESS_BRIDGED,
    FRESHNESS_COLD,
    FRESHNESS_EXPIRED,
    FRESHNESS_LIVE,
    LiveStepTimeResult,
    StepTimeMetric,
)
from traceml.schema.diagnosis import SEVERITY_CRIT, SEVERITY_INFO, SEVERITY_WARN

# (window metric name, label) in display order.
TABLE_METRICS: tuple[tuple[str, str], ...] = (
    ("step_time", "Step Time"),
    ("input_wait", "Input Wait"),
    ("h2d", "H2D"),
    ("forward", "Forward"),
    ("backward", "Backward"),
    ("optimizer_step", "Optimizer"),
    ("compute", "Compute"),
    ("residual", "Residual"),
    ("traced_step_time", "Traced Step Time"),
)

_SEVERITY_STYLE = {SEVERITY_CRIT: "bold red", SEVERITY_WARN: "yellow", SEVERITY_INFO: "green"}
_FRESHNESS_STYLE = {
    FRESHNESS_LIVE: "green", FRESHNESS_BRIDGED: "yellow", FRESHNESS_EXPIRED: "red", FRESHNESS_COLD: "dim",
}


@dataclass(frozen=True)
class IssueRow:
    """One issue as the live view shows it (also what parity tests compare)."""

    position: int
    kind: str
    severity: str
    status: str
    score: str
    rank: str
    summary: str


def issue_rows(result: LiveStepTimeResult) -> tuple[IssueRow, ...]:
    return tuple(
        IssueRow(
            position=i + 1,
            kind=printable(issue.kind),
            severity=printable(issue.severity),
            status=printable(issue.status),
            score="" if issue.score is None else f"{issue.score:.3f}",
            rank="" if issue.culprit_rank is None else f"rank {issue.culprit_rank}",
            summary=printable(issue.summary),
        )
        for i, issue in enumerate(result.analysis.diagnosis.issues)
    )


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _worst(m: StepTimeMetric | None) -> str:
    if m is None or m.worst is None:
        return "—"
    return f"{m.worst:.1f} (r{m.worst_rank})"


def _skew(m: StepTimeMetric | None) -> str:
    return "—" if m is None or m.skew is None else f"{m.skew:+.0%}"


def resource_section(result: LiveStepTimeResult) -> dict:
    """The analysis's resource figures as the final summary projects them (`resources`)."""
    return project_resources(resource_window_of(result.analysis))


def badput_section(result: LiveStepTimeResult) -> dict:
    """The analysis's badput ledger over the live window, as the final summary projects it."""
    return project_window_badput(result.analysis)


def freshness_text(result: LiveStepTimeResult) -> str:
    age = "" if result.age_s is None else f", {result.age_s:.1f}s old"
    err = "" if not result.error else f" ({printable(result.error)})"
    return f"{result.freshness}{age}{err}"


def _rate(steps_per_s: float | None, samples_per_s: float | None) -> str:
    parts = []
    if steps_per_s is not None:
        parts.append(f"{steps_per_s:.2f} steps/s")
    if samples_per_s is not None:
        parts.append(f"{samples_per_s:.1f} samples/s")
    return " | ".join(parts)


def render_live(
    result: LiveStepTimeResult,
    *,
    steps_per_s: float | None = None,
    samples_per_s: float | None = None,
    title: str | None = None,
    run_state: str | None = None,
) -> RenderableType:
    """Diagnosis line(s), the per-metric table and a freshness footer, in one panel.

    `run_state`: what the caller knows of the run beyond the window (`ended`, or how long
    ago the last step arrived), shown first in the footer."""
    window = result.analysis.window
    rows = issue_rows(result)
    header = Text()
    header.append(f"run {printable(window.run_id)}", style="bold")
    header.append(f" | {printable(window.training_strategy)} | {len(window.expected_ranks)} rank(s) | "
                  f"clock {printable(window.clock or 'none')} | {window.step_count} aligned steps")
    if window.steps:
        header.append(f" (last {window.steps[-1]})")
    rate = _rate(steps_per_s, samples_per_s)
    if rate:
        header.append(f" | {rate}")

    diagnosis = Text()
    for row in rows:
        if row.position > 1:
            diagnosis.append("\n")
        diagnosis.append(f"{row.position}. ")
        diagnosis.append(row.kind, style=_SEVERITY_STYLE.get(row.severity, ""))
        diagnosis.append(f" [{row.severity}, {row.status}]")
        if row.score:
            diagnosis.append(f" score {row.score}")
        if row.rank:
            diagnosis.append(f" {row.rank}")
        diagnosis.append(f": {row.summary}", style="dim")

    table = Table(expand=False, show_edge=False, pad_edge=False)
    table.add_column("metric")
    table.add_column("median ms", justify="right")
    table.add_column("worst ms (rank)", justify="right")
    table.add_column("skew", justify="right")
    table.add_column("share", justify="right")
    for name, label in TABLE_METRICS:
        m = window.metrics.get(name)
        share = window.shares.get(name)
        table.add_row(label, _ms(None if m is None else m.median), _worst(m), _skew(m),
                      "—" if share is None or name == "step_time" else f"{share:.0%}")

    resources = Text("\n".join(resource_lines(resource_section(result))), style="cyan")
    lost = live_badput_text(badput_section(result))
    before_forward = result.analysis.input_before_forward_ranks
    note = Text(f"Note: {printable(before_forward_note(before_forward))}" if before_forward else "",
                style="dim")

    state = "" if run_state is None else f"run {printable(run_state)} · "
    footer = Text(f"{state}freshness: {freshness_text(result)}", style=_FRESHNESS_STYLE.get(result.freshness, ""))
    lost_text = () if lost is None else (Text(printable(lost), style="magenta"),)
    return Panel(Group(header, diagnosis, *((note,) if before_forward else ()), table, resources, *lost_text,
                       footer),
                 title=printable_text(title or "TraceML Step Time"),
                 expand=False)


def format_live_line(
    result: LiveStepTimeResult,
    *,
    steps_per_s: float | None = None,
    samples_per_s: float | None = None,
    ended: bool = False,
    last_step_age: str | None = None,
) -> str:
    """One plain line for logs and non-terminal output: `[ended]` in place of the freshness for a
    run whose end was seen, else the freshness and, when given, how long ago the last step came;
    the median and worst process CPU, RSS, GPU and host CPU when they were measured."""
    window = result.analysis.window
    parts = [f"[{'ended' if ended else result.freshness}] run {printable(window.run_id)}"]
    if last_step_age is not None and not ended:
        parts.append(f"last step {last_step_age} ago")
    parts += [f"{window.step_count} steps", f"clock {printable(window.clock or 'none')}"]
    rows: Sequence[IssueRow] = issue_rows(result)
    issues = "; ".join(
        f"{r.kind} {r.severity}" + (f" {r.score}" if r.score else "") + (f" {r.rank}" if r.rank else "")
        for r in rows
    )
    parts.append(issues)
    step = window.metrics.get("step_time")
    if step is not None and step.median is not None:
        parts.append(f"step {step.median:.1f} ms (worst {_worst(step)})")
    resources = live_resource_text(resource_section(result))
    if resources is not None:
        parts.append(resources)
    badput = badput_section(result)
    if badput["available"] and badput["window"]["total_share"] is not None:
        parts.append(f"lost {badput['window']['total_share']:.0%} of rank-time")
    rate = _rate(steps_per_s, samples_per_s)
    if rate:
        parts.append(rate)
    return " | ".join(parts)
