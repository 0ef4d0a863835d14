"""Senders we did not write: TraceML step spans exported by the official OpenTelemetry Python exporter.

The spans carry the same resource, scope and attributes the receiver tests send as
raw OTLP (`harness.otlp_payloads.steps_request`), rebuilt as SDK
`ReadableSpan`s, so the SDK's own encoder, transport and retry policy deliver them.
"""
from __future__ import annotations

import threading

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from harness.otlp_payloads import steps_request


def _value(any_value):
    return getattr(any_value, any_value.WhichOneof("value"))


def step_spans(run_id: str, rank: int, steps: int, world_size: int) -> list[ReadableSpan]:
    """One rank's `steps` TraceML step spans as SDK spans."""
    [resource_spans] = steps_request(run_id, rank, range(steps), world_size=world_size).resource_spans
    resource = Resource({kv.key: _value(kv.value) for kv in resource_spans.resource.attributes})
    [scope_spans] = resource_spans.scope_spans
    scope = InstrumentationScope(scope_spans.scope.name)
    return [ReadableSpan(
        name=span.name, resource=resource, instrumentation_scope=scope, kind=SpanKind.INTERNAL,
        context=SpanContext(int.from_bytes(span.trace_id, "big"), int.from_bytes(span.span_id, "big"),
                            is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED)),
        attributes={kv.key: _value(kv.value) for kv in span.attributes},
        start_time=span.start_time_unix_nano, end_time=span.end_time_unix_nano,
    ) for span in scope_spans.spans]


def concurrent_exports(endpoint: str, run_id: str, *, senders: int,
                       steps: int) -> tuple[list[threading.Thread], dict[int, SpanExportResult]]:
    """`senders` official gRPC exporters, one rank each, exporting `steps` spans to `endpoint` at once.

    Returns the started threads and the results by rank (filled as each export ends).
    """
    results: dict[int, SpanExportResult] = {}

    def send(rank: int) -> None:
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=30)
        try:
            results[rank] = exporter.export(step_spans(run_id, rank, steps, senders))
        finally:
            exporter.shutdown()

    threads = [threading.Thread(target=send, args=(rank,)) for rank in range(senders)]
    for thread in threads:
        thread.start()
    return threads, results
