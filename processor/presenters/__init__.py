"""Pure presenters: format a `LiveStepTimeResult`; never load SQLite, run the pipeline or diagnose."""
from traceml.processor.presenters.live import (
    IssueRow,
    format_live_line,
    freshness_text,
    issue_rows,
    render_live,
)

__all__ = ["IssueRow", "format_live_line", "freshness_text", "issue_rows", "render_live"]
