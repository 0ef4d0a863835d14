"""The wire vocabulary shared by the training side and the processor.

Standard library only: this is the lowest layer. Every span name, attribute key,
raw event name, metric name and unit that crosses OTLP is declared here once;
`docs/wire-format.md` documents the same names for people.

Raw event names are the storage vocabulary below the SQLite normalisation
boundary. Canonical metric names (input_wait, h2d, ...) appear only after
normalisation (`RAW_EVENT_TO_METRIC`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

# --- Raw timing events (training side, wire, raw payload in SQLite) ----------

RAW_EVENT_PREFIX = "_traceml_internal:"

RAW_DATALOADER_NEXT = "_traceml_internal:dataloader_next"
RAW_H2D = "_traceml_internal:h2d_time"
RAW_FORWARD = "_traceml_internal:forward_time"
RAW_BACKWARD = "_traceml_internal:backward_time"
RAW_OPTIMIZER_STEP = "_traceml_internal:optimizer_step"
RAW_STEP_TIME = "_traceml_internal:step_time"

RAW_EVENTS: tuple[str, ...] = (
    RAW_DATALOADER_NEXT,
    RAW_H2D,
    RAW_FORWARD,
    RAW_BACKWARD,
    RAW_OPTIMIZER_STEP,
    RAW_STEP_TIME,
)

# --- Canonical metric names (processor side, after normalisation) ------------

METRIC_INPUT_WAIT = "input_wait"
METRIC_H2D = "h2d"
METRIC_FORWARD = "forward"
METRIC_BACKWARD = "backward"
METRIC_OPTIMIZER_STEP = "optimizer_step"
METRIC_TRACED_STEP_TIME = "traced_step_time"

RAW_EVENT_TO_METRIC: Mapping[str, str] = {
    RAW_DATALOADER_NEXT: METRIC_INPUT_WAIT,
    RAW_H2D: METRIC_H2D,
    RAW_FORWARD: METRIC_FORWARD,
    RAW_BACKWARD: METRIC_BACKWARD,
    RAW_OPTIMIZER_STEP: METRIC_OPTIMIZER_STEP,
    RAW_STEP_TIME: METRIC_TRACED_STEP_TIME,
}

CANONICAL_METRICS: tuple[str, ...] = tuple(RAW_EVENT_TO_METRIC.values())

# Derived metrics computed by the analyzer (never sent on the wire).
METRIC_COMPUTE = "compute"
METRIC_RESIDUAL = "residual"
METRIC_STEP_TIME = "step_time"

# Required on every aligned step of a rank; occurrence-driven ones may be absent.
REQUIRED_METRICS: tuple[str, ...] = (
    METRIC_INPUT_WAIT,
    METRIC_FORWARD,
    METRIC_BACKWARD,
    METRIC_TRACED_STEP_TIME,
)
OCCURRENCE_METRICS: tuple[str, ...] = (METRIC_H2D, METRIC_OPTIMIZER_STEP)


def raw_event_key(raw_event: str) -> str:
    """`_traceml_internal:forward_time` -> `forward_time` (used inside attribute keys)."""
    if raw_event.startswith(RAW_EVENT_PREFIX):
        return raw_event[len(RAW_EVENT_PREFIX):]
    return raw_event


def raw_event_from_key(key: str) -> str:
    """Inverse of `raw_event_key`."""
    return RAW_EVENT_PREFIX + key


# --- Resource attributes (one set per rank process) ---------------------------

RES_SERVICE_NAME = "service.name"
RES_SERVICE_INSTANCE_ID = "service.instance.id"
RES_HOST_NAME = "host.name"
DEFAULT_SERVICE_NAME = "traceml-training"

ATTR_RUN_ID = "traceml.run.id"
ATTR_RANK = "traceml.rank"
ATTR_LOCAL_RANK = "traceml.local_rank"
ATTR_NODE_RANK = "traceml.node_rank"
ATTR_WORLD_SIZE = "traceml.world_size"
ATTR_LOCAL_WORLD_SIZE = "traceml.local_world_size"
ATTR_TRAINING_STRATEGY = "traceml.training.strategy"

# Accepted by the processor where TraceML's own keys are absent (NeMo/Megatron).
RESOURCE_ALIASES: Mapping[str, str] = {
    "dl.rank": ATTR_RANK,
    "dl.world_size": ATTR_WORLD_SIZE,
    "dl.local_rank": ATTR_LOCAL_RANK,
    "nemo.run.id": ATTR_RUN_ID,
}

STRATEGY_DDP = "ddp"
STRATEGY_FSDP = "fsdp"
STRATEGY_SINGLE = "single"
TRAINING_STRATEGIES: tuple[str, ...] = (STRATEGY_DDP, STRATEGY_FSDP, STRATEGY_SINGLE)

# --- Spans ---------------------------------------------------------------------

INSTRUMENTATION_SCOPE = "traceml"

SPAN_STEP = "traceml.step"
"""One per completed step per rank; self-contained: it alone rebuilds one row."""

SPAN_PHASE_PREFIX = "traceml.phase."
"""Child spans `traceml.phase.<raw event key>` for trace viewers only."""

SPAN_RUN_END = "traceml.run.end"
"""End-of-run marker: the rank finished cleanly (attributes carry final counts)."""

ATTR_STEP = "traceml.step"
ATTR_DEVICE = "traceml.device"
ATTR_PHASE = "traceml.phase"
ATTR_STEPS_COMPLETED = "traceml.steps.completed"

# Peak memory of the step, on the `traceml.step` span (int, bytes: unit `By`), with
# ATTR_DEVICE naming the tracked device. Present only when measured (CUDA); a
# non-CUDA device sends none of the three (stored as null, never 0). On the span,
# not on a gauge: a per-step metric attribute would make a new series every step.
ATTR_MEMORY_PEAK_ALLOCATED = "traceml.memory.peak_allocated"
ATTR_MEMORY_PEAK_RESERVED = "traceml.memory.peak_reserved"
MEMORY_UNIT = "By"

# Per raw event on the `traceml.step` span: summed values for the step.
#   traceml.event.<raw event key>.cpu_ms   double, always present for a seen event
#   traceml.event.<raw event key>.gpu_ms   double, only when CUDA timing resolved
#   traceml.event.<raw event key>.count    int, number of occurrences summed
EVENT_ATTR_PREFIX = "traceml.event."
EVENT_FIELD_CPU_MS = "cpu_ms"
EVENT_FIELD_GPU_MS = "gpu_ms"
EVENT_FIELD_COUNT = "count"
EVENT_FIELDS: tuple[str, ...] = (EVENT_FIELD_CPU_MS, EVENT_FIELD_GPU_MS, EVENT_FIELD_COUNT)


def event_attribute(raw_event: str, field: str) -> str:
    """Attribute key for one field of one raw event on a `traceml.step` span."""
    if field not in EVENT_FIELDS:
        raise ValueError(f"unknown event field {field!r}")
    return f"{EVENT_ATTR_PREFIX}{raw_event_key(raw_event)}.{field}"


def parse_event_attribute(key: str) -> tuple[str, str] | None:
    """`traceml.event.forward_time.cpu_ms` -> (`_traceml_internal:forward_time`, `cpu_ms`)."""
    if not key.startswith(EVENT_ATTR_PREFIX):
        return None
    rest = key[len(EVENT_ATTR_PREFIX):]
    name, dot, field = rest.rpartition(".")
    if not dot or not name or field not in EVENT_FIELDS:
        return None
    return raw_event_from_key(name), field


# --- Training-side metrics (raw input for the processor, not for Prometheus) --

# Gauges with a `traceml.step` point attribute, sent by exporters before peak memory
# moved onto the step span; the processor still reads them (LEGACY_MEMORY_METRICS).
METRIC_MEMORY_PEAK_ALLOCATED = "traceml.memory.peak_allocated"
METRIC_MEMORY_PEAK_RESERVED = "traceml.memory.peak_reserved"
LEGACY_MEMORY_METRICS: tuple[str, ...] = (METRIC_MEMORY_PEAK_ALLOCATED, METRIC_MEMORY_PEAK_RESERVED)
METRIC_TELEMETRY_DROPPED = "traceml.telemetry.dropped"
METRIC_EXPORT_FAILURES = "traceml.telemetry.export.failures"
METRIC_EXPORT_RETRIES = "traceml.telemetry.export.retries"
ATTR_QUEUE = "traceml.queue"
"""Which bounded queue dropped: `timing`, `memory`, `spans`, `metrics`."""
QUEUE_NAMES: tuple[str, ...] = ("timing", "memory", "spans", "metrics")

# The OTLP signals TraceML sends and receives: the exporter's failure/retry metrics
# and the processor's record counts carry one in ATTR_SIGNAL.
Signal = Literal["traces", "metrics"]
SIGNAL_TRACES: Signal = "traces"
SIGNAL_METRICS: Signal = "metrics"
SIGNALS: tuple[Signal, ...] = (SIGNAL_TRACES, SIGNAL_METRICS)

# Final counts on the `traceml.run.end` span (besides ATTR_STEPS_COMPLETED and,
# when any step was published, ATTR_STEP = the last step number).
RUN_END_DROPPED_PREFIX = "traceml.telemetry.dropped."
ATTR_RUN_END_EXPORT_FAILURES = "traceml.telemetry.export.failures"
ATTR_RUN_END_EXPORT_RETRIES = "traceml.telemetry.export.retries"


def run_end_dropped_attribute(queue: str) -> str:
    """`spans` -> `traceml.telemetry.dropped.spans` (a final count on the run-end span)."""
    if queue not in QUEUE_NAMES:
        raise ValueError(f"unknown queue {queue!r}")
    return RUN_END_DROPPED_PREFIX + queue


# --- Processor re-exported summary metrics (no step attribute, ever) ------------

ATTR_METRIC = "traceml.metric"
ATTR_STATISTIC = "traceml.statistic"
ATTR_DIAGNOSIS_KIND = "traceml.diagnosis.kind"
ATTR_DIAGNOSIS_SEVERITY = "traceml.diagnosis.severity"
ATTR_DIAGNOSIS_STATUS = "traceml.diagnosis.status"
ATTR_CULPRIT_RANK = "traceml.diagnosis.culprit_rank"
ATTR_FRESHNESS = "traceml.freshness"
ATTR_OUTCOME = "traceml.outcome"
ATTR_SIGNAL = "traceml.signal"

STATISTICS: tuple[str, ...] = ("median", "worst", "average")


@dataclass(frozen=True)
class MetricSpec:
    """One OpenTelemetry instrument: name, unit, description, and its attribute keys."""

    name: str
    unit: str
    description: str
    attributes: tuple[str, ...]
    kind: str = "gauge"  # gauge | counter

    @property
    def prometheus_name(self) -> str:
        return prometheus_name(self.name, self.unit, counter=self.kind == "counter")


SUMMARY_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("traceml.window.metric", "s",
               "Step Time metric statistic over the run's common step window (selected clock).",
               (ATTR_RUN_ID, ATTR_METRIC, ATTR_STATISTIC)),
    MetricSpec("traceml.window.skew", "1",
               "Worst-rank skew of a Step Time metric: (worst - median) / median.",
               (ATTR_RUN_ID, ATTR_METRIC)),
    MetricSpec("traceml.rank.metric", "s",
               "Per-rank window average of a Step Time metric.",
               (ATTR_RUN_ID, ATTR_RANK, ATTR_METRIC)),
    MetricSpec("traceml.window.steps", "{step}",
               "Number of aligned steps in the run's common window.", (ATTR_RUN_ID,)),
    MetricSpec("traceml.window.ranks", "{rank}",
               "Number of ranks in the run's rank universe.", (ATTR_RUN_ID,)),
    MetricSpec("traceml.window.last_step", "{step}",
               "Latest aligned step id in the window.", (ATTR_RUN_ID,)),
    MetricSpec("traceml.run.first_step", "{step}",
               "Lowest step id stored for the run: above 0 when the processor first saw the run part-way "
               "(started after the job, or received the run after a rebalance).", (ATTR_RUN_ID,)),
    MetricSpec("traceml.run.fresh", "1",
               "1 for the run's current freshness state (cold, live, bridged, expired).",
               (ATTR_RUN_ID, ATTR_FRESHNESS)),
    MetricSpec("traceml.rank.memory.peak", "By",
               "Latest per-step peak allocated memory of a rank's tracked device.",
               (ATTR_RUN_ID, ATTR_RANK)),
    MetricSpec("traceml.diagnosis.active", "1",
               "Active diagnosis issue; the value is its score (0 where none applies).",
               (ATTR_RUN_ID, ATTR_DIAGNOSIS_KIND, ATTR_DIAGNOSIS_SEVERITY,
                ATTR_DIAGNOSIS_STATUS, ATTR_CULPRIT_RANK)),
    MetricSpec("traceml.rank.telemetry.dropped", "{record}",
               "Telemetry records a rank reported dropped, by queue.",
               (ATTR_RUN_ID, ATTR_RANK, ATTR_QUEUE), kind="counter"),
)

PROCESSOR_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("traceml.processor.records", "{record}",
               "Records received by the processor, by outcome (accepted, rejected, duplicate, ignored).",
               (ATTR_OUTCOME, ATTR_SIGNAL), kind="counter"),
    MetricSpec("traceml.processor.analysis.duration", "s",
               "Duration of the latest live analysis refresh of a run.", (ATTR_RUN_ID,)),
    MetricSpec("traceml.processor.run.lag", "s",
               "Seconds between now and the newest step end received for a run.", (ATTR_RUN_ID,)),
    MetricSpec("traceml.processor.runs", "{run}", "Runs currently tracked.", ()),
    MetricSpec("traceml.processor.export.failures", "{request}",
               "Summary-metric pushes to the OTLP export endpoint that failed after their retries.",
               (), kind="counter"),
)

# What each rank's exporter sends as metrics: bounded attributes only (run, rank and
# one closed set each), so the series count never grows with steps.
TRAINING_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(METRIC_TELEMETRY_DROPPED, "{record}",
               "Telemetry records dropped on the training side because a bounded queue was full, by queue.",
               (ATTR_RUN_ID, ATTR_RANK, ATTR_QUEUE), kind="counter"),
    MetricSpec(METRIC_EXPORT_FAILURES, "{record}",
               "Spans or metric points lost because their OTLP export failed after retries, by signal.",
               (ATTR_RUN_ID, ATTR_RANK, ATTR_SIGNAL), kind="counter"),
    MetricSpec(METRIC_EXPORT_RETRIES, "{request}",
               "OTLP export requests retried after a transient error, by signal.",
               (ATTR_RUN_ID, ATTR_RANK, ATTR_SIGNAL), kind="counter"),
)

_UNIT_SUFFIX = {"s": "seconds", "By": "bytes", "1": "ratio", "ms": "milliseconds"}


def prometheus_name(otel_name: str, unit: str, *, counter: bool = False) -> str:
    """OpenTelemetry name + unit -> Prometheus metric name (dots to underscores, unit suffix).

    Curly-brace annotation units ({step}) add no suffix; counters end in `_total`.
    """
    name = otel_name.replace(".", "_").replace("-", "_")
    suffix = _UNIT_SUFFIX.get(unit)
    if suffix and not name.endswith("_" + suffix):
        name = f"{name}_{suffix}"
    if counter and not name.endswith("_total"):
        name += "_total"
    return name


def prometheus_label(attribute_key: str) -> str:
    """OpenTelemetry attribute key -> Prometheus label name."""
    return attribute_key.replace(".", "_").replace("-", "_")
