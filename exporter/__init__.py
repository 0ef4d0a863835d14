"""TraceML's OTLP exporter: finished steps -> `traceml.step` spans and per-step memory gauges.

`start_from_settings()` is what `traceml.init()` calls; `OtlpStepExporter` is the
`traceml.records.TelemetrySink` the samplers feed.
"""
from .settings import ExporterSettings, resolve_settings
from .start import start_from_settings
from .step_exporter import ExporterStats, OtlpStepExporter

__all__ = ["ExporterSettings", "ExporterStats", "OtlpStepExporter", "resolve_settings", "start_from_settings"]
