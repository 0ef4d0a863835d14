"""OTLP export requests -> typed TraceML ingest records, with every refusal counted.

`Decoder` is the ingest path's one entry: it holds the caps (`DecodeLimits`) and
the run admission (`admission.RunAdmission`) and hands traces to the span decoder
(`decode_spans`), metrics to the metric decoder (`decode_metrics`) and logs to the
log decoder (`decode_logs`), which judge
attributes by the same rules (`decode_attributes`). Together they are the
processor's only readers of wire names (all from `traceml.schema.vocabulary` and
`traceml.schema.resources`) and its only judges of values: what they hand on
(`store_records.DecodedBatch`) is valid, so nothing after them checks again. A
span or data point with any other value is rejected whole, with its reason; the
rest of the request is kept. They never raise on content; telemetry that is not
TraceML's is ignored and counted. A part of the request that protobuf or the JSON
parser could not read (`otlp_read.PartlyReadable`, e.g. another service's
resource with an attribute map nested past protobuf's recursion limit) is
rejected with its span or point count, the rest kept. The receivers turn the
counts into OTLP partial-success answers and self-metrics.
"""
from __future__ import annotations

from dataclasses import dataclass

from traceml.processor import settings
from traceml.processor.admission import RunAdmission
from traceml.processor.decode_logs import LogDecoder
from traceml.processor.decode_metrics import MetricDecoder
from traceml.processor.decode_spans import SpanDecoder
from traceml.processor.store_records import MAX_EVENT_MS, DecodedBatch


@dataclass(frozen=True)
class DecodeLimits:
    """Caps that keep one client from exhausting the processor."""

    max_runs: int = settings.MAX_RUNS.default
    max_ranks_per_run: int = settings.MAX_RANKS_PER_RUN.default
    max_attribute_bytes: int = 4_096  # per string value
    max_run_id_chars: int = 256
    max_attributes: int = 512  # per span / data point
    max_step: int = 2**53
    max_event_ms: float = MAX_EVENT_MS
    max_event_count: int = 10_000_000
    max_memory_bytes: int = 2**50  # 1 PiB


class Decoder:
    """The decoders under one set of caps and one admission (stateless per request otherwise)."""

    def __init__(self, limits: DecodeLimits | None = None, admission: RunAdmission | None = None):
        self.limits = limits or DecodeLimits()
        self.admission = admission or RunAdmission(self.limits)
        self.spans = SpanDecoder(self.limits, self.admission)
        self.metrics = MetricDecoder(self.limits, self.admission)
        # A rank that sends TraceML's own step spans keeps them as its rows over its log records too.
        self.logs = LogDecoder(self.limits, self.admission, own_ranks=lambda: self.spans.mappings.own)

    def decode_traces(self, request) -> DecodedBatch:
        """`ExportTraceServiceRequest` -> step rows, per-step memory and run-end markers."""
        return self.spans.decode_traces(request)

    def decode_metrics(self, request) -> DecodedBatch:
        """`ExportMetricsServiceRequest` -> drop counts, resource samples and legacy memory rows."""
        return self.metrics.decode_metrics(request)

    def decode_logs(self, request) -> DecodedBatch:
        """`ExportLogsServiceRequest` -> the step rows a mapping placed; every other record counted."""
        return self.logs.decode_logs(request)
