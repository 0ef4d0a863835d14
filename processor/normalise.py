"""Decoded records -> the row tuples the writer stores: the SQLite normalisation boundary.

Raw event names (`_traceml_internal:*`) become the canonical metric columns here
(`forward_cpu_ms`, `forward_gpu_ms`, `forward_count`, ...), so no reader ever
decodes JSON. The raw events are kept as JSON text in `payload` (raw event name
-> [cpu_ms, gpu_ms, count]) for audit and for event names this version does not
know. Each step row also gets the `packed` BLOB (`sqlite_layout.PACKED_FORMAT`)
and a content digest, by which the writer recognises a resend (the step span's trace and span
ids ride along for exemplars, outside the digest: a resend is the same step whatever its
ids). A resource record
(`schema.resources`) is one `resource_samples` row as it is.

What arrives is what the decoders (`decode`) let through, and it is not checked again here:
run id, rank, step and timestamps are valid; every duration is None or a finite
float in [0, `store_records.MAX_EVENT_MS`]; every count None or an int >= 0; memory
peaks None or an int >= 0. A span with any other value was rejected whole by the
decoder, with its reason. The one thing decode passes that the columns cannot
hold is a raw event name this version does not know: it stays in `payload` only
and is counted for the writer to report.

No SQL runs here: rows are built before the writer takes its lock.
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Mapping

from traceml.processor.sqlite_layout import METRIC_VALUE_COLUMNS, PACKED_FORMAT, PACKED_METRICS
from traceml.processor.step_time.model import ResourceIngestRecord, StepMemoryIngestRecord, StepTimeIngestRecord
from traceml.schema.vocabulary import RAW_EVENT_TO_METRIC

UNKNOWN_DEVICE = "unknown"
"""`device` of a memory row whose sender named no device (the column is NOT NULL)."""

_RAW_EVENT_SLOT: Mapping[str, int] = {
    raw: 3 * PACKED_METRICS.index(metric) for raw, metric in RAW_EVENT_TO_METRIC.items()
}  # raw event -> index of its cpu column in METRIC_VALUE_COLUMNS (gpu +1, count +2)
_PACKED_SLOTS: tuple[int, ...] = tuple(
    i for k in range(len(PACKED_METRICS)) for i in (3 * k, 3 * k + 1)
)
_NAN = float("nan")
_START_TIME = struct.Struct("<d")
_blake2b = hashlib.blake2b
_JSON_EVENT_NAME: Mapping[str, str] = {raw: json.dumps(raw) for raw in RAW_EVENT_TO_METRIC}
_float_repr = float.__repr__  # what json.dumps writes for a finite float
_last_identity: tuple = (None, None, None, None)  # (identity, run id, raw strategy, head)


def normalise_step_record(record: StepTimeIngestRecord, receive_time: float) -> tuple[tuple, int]:
    """One decoded step record -> (its `step_time_samples` row in `SAMPLE_COLUMNS` order,
    how many of its raw event names this version does not know)."""
    flat: list[float | int | None] = [None] * len(METRIC_VALUE_COLUMNS)
    # While every name is known and every value a float / int / None as decode makes
    # them, the audit JSON is written directly (the same text as json.dumps, faster).
    plain: list[tuple[str, str]] | None = []
    unknown = 0
    slots = _RAW_EVENT_SLOT
    for raw_name, raw in record.events.items():
        k = slots.get(raw_name)
        if k is None:
            unknown += 1
            plain = None
            continue
        cpu, gpu, count = raw.cpu_ms, raw.gpu_ms, raw.count
        flat[k], flat[k + 1], flat[k + 2] = cpu, gpu, count
        if plain is not None:
            if ((cpu is None or cpu.__class__ is float) and (gpu is None or gpu.__class__ is float)
                    and (count is None or count.__class__ is int)):
                plain.append((raw_name, f"{_JSON_EVENT_NAME[raw_name]}:["
                                        f"{'null' if cpu is None else _float_repr(cpu)},"
                                        f"{'null' if gpu is None else _float_repr(gpu)},"
                                        f"{'null' if count is None else count}]"))
            else:
                plain = None

    if plain is not None:
        plain.sort()
        payload_text = "{" + ",".join([text for _, text in plain]) + "}"
    else:
        payload_text = json.dumps({name: [raw.cpu_ms, raw.gpu_ms, raw.count]
                                   for name, raw in record.events.items()},
                                  sort_keys=True, separators=(",", ":"))
    run_id, identity, raw_strategy = record.run_id, record.identity, record.training_strategy
    cached = _last_identity
    if cached[0] is identity and cached[1] is run_id and cached[2] is raw_strategy:
        head = cached[3]  # spans of one resource share their identity object
    else:
        head = _identity_head(run_id, identity, raw_strategy)
    rank, step = identity.global_rank, record.step
    start_time, sample_time = record.start_time, record.sample_time
    packed = PACKED_FORMAT.pack(*[_NAN if flat[i] is None else flat[i] for i in _PACKED_SLOTS],
                                sample_time, rank, step)
    # The digest covers everything a sender controls: identity and strategy (head), the
    # raw events (payload JSON, which never holds a NUL), the values, end time, rank and
    # step (packed, exact float64) and the start time. A resend is recognised whatever
    # the receive time; any real difference replaces the row.
    h = _blake2b(payload_text.encode(), digest_size=16)
    h.update(b"\0")
    h.update(packed)
    h.update(_START_TIME.pack(start_time))
    h.update(head[-1])
    _, local_rank, node_rank, world_size, local_world_size, hostname, strategy, _ = head
    row = (run_id, rank, local_rank, node_rank, world_size, local_world_size, hostname,
           step, start_time, sample_time, receive_time, strategy, *flat, record.trace_id, record.span_id,
           payload_text, packed, h.hexdigest())
    return row, unknown


def _identity_head(run_id: str, identity, strategy: str | None) -> tuple:
    """(run id, local rank, node rank, world size, local world size, hostname, strategy,
    their repr as bytes for the digest); the last one is remembered for the next span."""
    global _last_identity
    fields = (run_id, identity.local_rank, identity.node_rank, identity.world_size,
              identity.local_world_size, identity.hostname, strategy)
    head = (*fields, repr(fields).encode())
    _last_identity = (identity, run_id, strategy, head)
    return head


def normalise_memory_record(record: StepMemoryIngestRecord, receive_time: float) -> tuple:
    """One decoded memory record -> its `step_memory_samples` row in `MEMORY_COLUMNS` order."""
    return (record.run_id, record.global_rank, record.step, record.device or UNKNOWN_DEVICE,
            record.peak_allocated_bytes, record.peak_reserved_bytes, record.sample_time,
            receive_time)


def normalise_resource_record(record: ResourceIngestRecord, receive_time: float) -> tuple:
    """One decoded resource record -> its `resource_samples` row in `RESOURCE_COLUMNS` order."""
    return (record.run_id, record.global_rank, record.host, record.device, record.metric, record.sample_time,
            record.value, record.source, record.pid, receive_time)


__all__ = ["UNKNOWN_DEVICE", "normalise_memory_record", "normalise_resource_record", "normalise_step_record"]
