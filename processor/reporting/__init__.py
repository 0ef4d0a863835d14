"""Final summary (JSON + text card) and summary-metric projections of a finished analysis.

Pure: nothing here loads SQLite, aligns steps or diagnoses (docs/SCHEMA.md).
"""
from traceml.processor.metric_point import MetricPoint, make_point
from traceml.processor.reporting.final_summary import (
    FINAL_SUMMARY_FILE,
    PUBLIC_METRIC_KEYS,
    PUBLIC_METRICS,
    SUMMARY_CARD_FILE,
    project_final_summary,
    render_card,
    write_summary_files,
)
from traceml.processor.reporting.inputs import RankMemory, RankTelemetry, RunMetadata, RunTelemetry
from traceml.processor.reporting.summary_metrics import summary_metric_points

__all__ = [
    "FINAL_SUMMARY_FILE", "PUBLIC_METRIC_KEYS", "PUBLIC_METRICS", "SUMMARY_CARD_FILE",
    "project_final_summary", "render_card", "write_summary_files",
    "RankMemory", "RankTelemetry", "RunMetadata", "RunTelemetry",
    "MetricPoint", "make_point", "summary_metric_points",
]
