"""The original TraceML's OTLP log records (traceopt-ai/traceml #394-#396) -> `ForeignStep`s.

A mapping, not a layer: it reads one `LogRecord` of the original's shape
(docs/wire-format.md "Log records received", where every key below is listed with
its source) and hands the layer (`record.place`) the step it describes. Nothing
else is guessed:

- a record is the original's when it carries `traceml.record_kind` (#394's record
  kind); any other log record is foreign and counted so by the log decoder;
- only `step_timing` records of schema version 1 become rows; `runtime_context` and
  `step_memory` are counted as unused (`IGNORED_UNUSED_RECORD`), and a step_timing
  record that cannot be placed (another schema version, a body that is not a map,
  no step number in it) is counted `IGNORED_UNPLACED` with why, never stored;
- a windowed record (#229/#231: one record per N steps, its timings the window's
  per-step MEANS, never totals) becomes ONE row: keyed by the window's FIRST step (so the
  row claims no step before the steps it covers: a run whose first window is 0-4 starts at
  step 0, not "part-way" at 4), bounds = the window's, phase values = its mean per step.
  No per-step value is invented for the window's other steps; the analysis counts rows, so
  its step gates count windows and a windowed run is judged more cautiously, never more
  confidently.

The original measures no collective wait, so that phase is said unmeasured; H2D is
sent only when measured (optional in #394), so its absence is a null, never a 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from traceml.processor.decode_attributes import Reject, Unsupported, any_value, attributes
from traceml.processor.mapping.record import ForeignStep, PhaseTime
from traceml.processor.store_records import NEGATIVE, NON_FINITE, TOO_MANY_ATTRIBUTES, WRONG_TYPE
from traceml.schema import vocabulary as v

if TYPE_CHECKING:
    from traceml.processor.decode import DecodeLimits

MAPPING_NAME = "traceml-logs"
"""How a run that came through this mapping is named on every surface."""

UNMEASURED: tuple[str, ...] = (v.METRIC_COLLECTIVE_WAIT,)
"""Phases the original TraceML never measures."""

SCHEMA_VERSION = 1

# The record's common fields (#394 item 1, names of 0.5.0's `TelemetryMeta`), on the record's
# attributes or, for the stable process facts, on its Resource (#396 item 3).
KEY_RECORD_KIND = "traceml.record_kind"
KEY_SCHEMA_VERSION = "traceml.schema_version"
KEY_SESSION_ID = "traceml.session_id"
KEY_GLOBAL_RANK = "traceml.global_rank"
KEY_LOCAL_RANK = "traceml.local_rank"
KEY_WORLD_SIZE = "traceml.world_size"
KEY_HOST_NAME = v.RES_HOST_NAME
KIND_STEP_TIMING = "step_timing"
RECORD_KINDS: tuple[str, ...] = (KIND_STEP_TIMING, "step_memory", "runtime_context")

# The step_timing body (#394 item 2's timings; #231's window).
BODY_STEP = "step"
BODY_TIMESTAMP = "timestamp"
BODY_WINDOW = "window"
PHASE_KEYS: Mapping[str, str] = {
    "data_wait_ms": v.METRIC_INPUT_WAIT,
    "h2d_ms": v.METRIC_H2D,
    "forward_ms": v.METRIC_FORWARD,
    "backward_ms": v.METRIC_BACKWARD,
    "optimizer_ms": v.METRIC_OPTIMIZER_STEP,
    "step_wall_ms": v.METRIC_TRACED_STEP_TIME,
}
WINDOW_START_STEP = "start_step"
WINDOW_END_STEP = "end_step"
WINDOW_STEP_COUNT = "step_count"
WINDOW_START = "start_timestamp"
WINDOW_END = "end_timestamp"


@dataclass(frozen=True, slots=True)
class NotPlaced:
    """A record of the original's shape that places no row, and why (for the partial success)."""

    unused: bool  # True: a record kind no row is built from; False: a step_timing that cannot be placed
    detail: str


def record_identity(resource_attrs: Mapping) -> dict:
    """The stable process facts of a Resource that a record's own attributes may repeat."""
    return {key: resource_attrs[key] for key in (KEY_SESSION_ID, KEY_GLOBAL_RANK, KEY_LOCAL_RANK,
                                                 KEY_WORLD_SIZE, KEY_HOST_NAME) if key in resource_attrs}


def is_original(attrs: Mapping) -> bool:
    """A log record of the original TraceML's export (it names its record kind)."""
    return KEY_RECORD_KIND in attrs


def _map_value(value, limits: "DecodeLimits", key: str, depth: int = 0):
    """An AnyValue -> a scalar or, for a key-value list (the body, its window), a dict."""
    if value.WhichOneof("value") == "kvlist_value" and depth < 2:
        values = value.kvlist_value.values
        if len(values) > limits.max_attributes:
            raise Reject(TOO_MANY_ATTRIBUTES, f"{key} holds {len(values)} keys (cap {limits.max_attributes})")
        return {kv.key: _map_value(kv.value, limits, kv.key, depth + 1) for kv in values}
    return any_value(value, limits, key)


def _number(body: Mapping, key: str):
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Reject(WRONG_TYPE, f"{key} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise Reject(NON_FINITE, f"{key} is {value}")
    return value


def _seconds(body: Mapping, key: str) -> float | None:
    """A timestamp in seconds since the epoch: finite and not negative."""
    value = _number(body, key)
    if value is not None and value < 0:
        raise Reject(NEGATIVE, f"{key} is {value}")
    return value


def _int(body: Mapping, key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if value.__class__ is not int:
        raise Reject(WRONG_TYPE, f"{key} must be an integer, got {value!r}")
    return value


def read_step(record, identity: Mapping, limits: "DecodeLimits") -> ForeignStep | NotPlaced:
    """One LogRecord of the original's shape -> the step it describes, or why it places none.

    `identity`: the Resource's stable facts (`record_identity`); the record's own attributes
    win. Raises `Reject` for a value that breaks a rule (the layer's reason words), so the
    decoder rejects the record as it would a span."""
    attrs = attributes(record.attributes, limits)
    kind = attrs.get(KEY_RECORD_KIND)
    if kind != KIND_STEP_TIMING:
        known = kind in RECORD_KINDS
        return NotPlaced(known, f"record kind {kind!r} {'builds no step row' if known else 'is not known'}")
    version = attrs.get(KEY_SCHEMA_VERSION)
    if version != SCHEMA_VERSION or version.__class__ is not int:
        return NotPlaced(False, f"step_timing schema version {version!r} is not {SCHEMA_VERSION}")
    body = _map_value(record.body, limits, "body")
    if not isinstance(body, dict):
        shown = body.kind if isinstance(body, Unsupported) else type(body).__name__
        return NotPlaced(False, f"step_timing body is {shown}, not a map")
    window = body.get(BODY_WINDOW)
    if window is not None and not isinstance(window, dict):
        return NotPlaced(False, "step_timing window is not a map")
    window = window or {}
    count = _int(window, WINDOW_STEP_COUNT)  # None: one step (the layer refuses a count below 1)
    step = _int(window, WINDOW_START_STEP)
    if step is None:  # no window start: the record's step (its window's last) less the others
        last = _int(body, BODY_STEP)
        if last is None:
            last = _int(window, WINDOW_END_STEP)
        step = last if last is None or count is None or count < 1 else last - count + 1
    if step is None:
        return NotPlaced(False, "step_timing record has no step number")
    phases: dict[str, PhaseTime] = {}
    for key, metric in PHASE_KEYS.items():
        ms = _number(body, key)
        if ms is not None:
            phases[metric] = PhaseTime(float(ms), None)
    end_s = _seconds(window, WINDOW_END)
    if end_s is None:
        end_s = _seconds(body, BODY_TIMESTAMP)
    end_ns = int(end_s * 1e9) if end_s is not None else record.time_unix_nano
    start_s = _seconds(window, WINDOW_START)
    if start_s is not None:
        start_ns = int(start_s * 1e9)
    else:  # one step: it ended at its timestamp and lasted its wall time (input wait before it)
        wall = sum(phases[m].ms for m in (v.METRIC_TRACED_STEP_TIME, v.METRIC_INPUT_WAIT) if m in phases)
        start_ns = end_ns - int(wall * 1e6)
    merged = {**identity, **attrs}
    return ForeignStep(
        mapping=MAPPING_NAME, step=step, start_ns=start_ns, end_ns=end_ns, phases=phases,
        run_id=merged.get(KEY_SESSION_ID), rank=merged.get(KEY_GLOBAL_RANK),
        world_size=merged.get(KEY_WORLD_SIZE), local_rank=merged.get(KEY_LOCAL_RANK),
        hostname=merged.get(KEY_HOST_NAME), steps=count if count is not None else 1)
