"""OTLP log export requests -> the step rows a mapping places, with every other record counted.

TraceML's own exporter sends no logs. Log records reach the processor from emitters
that carry step records as logs: the original TraceML's OTLP export
(docs/wire-format.md "Log records received"), read by its mapping
(`mapping/traceml_logs.py`) into `ForeignStep`s that the one mapping layer
(`mapping/record.place`) judges and turns into our rows. A record no mapping
recognises is ignored and counted as foreign, exactly as a foreign span is; one of
the original's shape that builds no row is counted unused or unplaced, never guessed
into a phase; one with a value that breaks a rule is rejected with its reason; a part
of the request protobuf or the JSON parser could not read is rejected with its record
count (`otlp_read.PartlyReadable`). A (run, rank) that also sends TraceML's own step
spans keeps those as its rows (the layer's `own`), as it does over foreign spans. Like
the span and metric decoders this never
raises on content: the receivers turn the batch's counts into the OTLP partial
success (`rejected_log_records`) and self-metrics.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from traceml.processor.decode_attributes import Reject, attributes, resource_identity
from traceml.processor.mapping import traceml_logs
from traceml.processor.mapping.record import OwnRanks, place
from traceml.processor.store_records import (
    IGNORED_FOREIGN,
    IGNORED_UNPLACED,
    IGNORED_UNUSED_RECORD,
    DecodedBatch,
)
from traceml.schema import vocabulary as v

if TYPE_CHECKING:
    from traceml.processor.admission import RunAdmission
    from traceml.processor.decode import DecodeLimits

_KIND_KEY = traceml_logs.KEY_RECORD_KIND


class LogDecoder:
    """Stateless per request except for the shared run/rank admission caps."""

    def __init__(self, limits: "DecodeLimits", admission: "RunAdmission",
                 own_ranks: Callable[[], OwnRanks | None] = lambda: None):
        self.limits = limits
        self.admission = admission
        self._own_ranks = own_ranks  # the span decoder's (run, rank)s of TraceML's own step spans

    def decode_logs(self, request) -> DecodedBatch:
        """`ExportLogsServiceRequest` -> the batch its records contributed."""
        batch = DecodedBatch(v.SIGNAL_LOGS)
        limits = self.limits
        own = self._own_ranks()
        for part in getattr(request, "unreadable", ()):  # `otlp_read.PartlyReadable`
            batch.reject(part.reason, part.describe("log records"), part.items)
        for resource_logs in request.resource_logs:
            records = [r for scope in resource_logs.scope_logs for r in scope.log_records]
            ours = [r for r in records if any(kv.key == _KIND_KEY for kv in r.attributes)]
            if len(ours) < len(records):
                batch.ignored[IGNORED_FOREIGN] += len(records) - len(ours)
            if not ours:
                continue
            res = resource_identity(resource_logs.resource.attributes, limits)
            try:
                identity = traceml_logs.record_identity(attributes(resource_logs.resource.attributes, limits))
            except Reject as exc:
                batch.reject(exc.reason, f"log records' resource: {exc.detail}", len(ours))
                continue
            for record in ours:
                try:
                    step = traceml_logs.read_step(record, identity, limits)
                except Reject as exc:
                    batch.reject(exc.reason, f"{traceml_logs.MAPPING_NAME} log record: {exc.detail}")
                    continue
                if isinstance(step, traceml_logs.NotPlaced):
                    batch.ignored[IGNORED_UNUSED_RECORD if step.unused else IGNORED_UNPLACED] += 1
                    continue
                place(batch, step, res, limits, self.admission, traceml_logs.UNMEASURED, own=own)
        return batch
