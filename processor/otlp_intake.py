"""Incoming OTLP: one Export request a sender made -> decode -> ingest -> partial-success response.

The processor's intake side (its outgoing summary metrics are `summary_export`).
Shared by the gRPC and HTTP receivers so both answer the same way: rejected spans,
points or log records are counted in `partial_success` with a message naming the reasons;
ignored (non-TraceML) telemetry is mentioned in the message but not rejected.
"""
from __future__ import annotations

from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as logs_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb2

from traceml.processor.decode import Decoder
from traceml.processor.ingest import IngestQueue
from traceml.processor.self_telemetry import SelfTelemetry
from traceml.processor.store_records import DecodedBatch
from traceml.schema import vocabulary as v


class OtlpIntake:
    """Answers the trace, metrics and logs Export requests the receivers hand it."""

    def __init__(self, decoder: Decoder, ingest: IngestQueue, stats: SelfTelemetry):
        self.decoder = decoder
        self.ingest = ingest
        self.stats = stats

    def _ingest(self, batch: DecodedBatch) -> DecodedBatch:
        """Return once `batch` is committed, then count the request and the decoder's verdicts.

        Counted only once the batch is committed: a refused request (the queue
        counts its refusal) is sent again, and its verdicts are counted then.
        """
        self.ingest.submit(batch)  # raises Backpressure / IngestUnavailable
        self.stats.accepted(batch.signal)
        self.stats.records(v.RECORD_REJECTED, batch.signal, batch.rejected_count)
        self.stats.records(v.RECORD_IGNORED, batch.signal, batch.ignored_count)
        return batch

    def traces(self, request: trace_pb2.ExportTraceServiceRequest) -> trace_pb2.ExportTraceServiceResponse:
        batch = self._ingest(self.decoder.decode_traces(request))
        return _answer(trace_pb2.ExportTraceServiceResponse(), "rejected_spans", batch)

    def metrics(self, request: metrics_pb2.ExportMetricsServiceRequest) -> metrics_pb2.ExportMetricsServiceResponse:
        batch = self._ingest(self.decoder.decode_metrics(request))
        return _answer(metrics_pb2.ExportMetricsServiceResponse(), "rejected_data_points", batch)

    def logs(self, request: logs_pb2.ExportLogsServiceRequest) -> logs_pb2.ExportLogsServiceResponse:
        batch = self._ingest(self.decoder.decode_logs(request))
        return _answer(logs_pb2.ExportLogsServiceResponse(), "rejected_log_records", batch)

    def handler(self, signal: str):
        """The export method for `signal` (the receivers route by it)."""
        return {v.SIGNAL_TRACES: self.traces, v.SIGNAL_METRICS: self.metrics, v.SIGNAL_LOGS: self.logs}[signal]


def _answer(response, rejected_field: str, batch: DecodedBatch):
    """`partial_success` is set only when something was refused or is worth saying (OTLP: else unset).

    Every refusal is the decoder's (the store refuses nothing), so the answer is
    the committed batch's own counts and message.
    """
    rejected, message = batch.rejected_count, batch.message()
    if rejected or message:
        setattr(response.partial_success, rejected_field, rejected)
        response.partial_success.error_message = message
    return response
