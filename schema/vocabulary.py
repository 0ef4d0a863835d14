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

from traceml.schema.distribution import DISTRIBUTION

# --- Raw timing events (training side, wire, raw payload in SQLite) ----------

RAW_EVENT_PREFIX = "_traceml_internal:"

RAW_DATALOADER_NEXT = "_traceml_internal:dataloader_next"
RAW_H2D = "_traceml_internal:h2d_time"
RAW_FORWARD = "_traceml_internal:forward_time"
RAW_BACKWARD = "_traceml_internal:backward_time"
RAW_OPTIMIZER_STEP = "_traceml_internal:optimizer_step"
RAW_STEP_TIME = "_traceml_internal:step_time"
RAW_COLLECTIVE_WAIT = "_traceml_internal:collective_wait"
"""Time the training thread spent inside blocking torch.distributed collectives in the step
(DDP's gradient-bucket all-reduces included). Its canonical metric is `METRIC_COLLECTIVE_WAIT`.
A measured sub-interval of whatever contains it (backward under DDP, the residual for an
explicit collective between phases), never added to Step Time; occurrence-driven."""

RAW_EVENTS: tuple[str, ...] = (
    RAW_DATALOADER_NEXT,
    RAW_H2D,
    RAW_FORWARD,
    RAW_BACKWARD,
    RAW_OPTIMIZER_STEP,
    RAW_STEP_TIME,
    RAW_COLLECTIVE_WAIT,
)

# --- Canonical metric names (processor side, after normalisation) ------------

METRIC_INPUT_WAIT = "input_wait"
METRIC_H2D = "h2d"
METRIC_FORWARD = "forward"
METRIC_BACKWARD = "backward"
METRIC_OPTIMIZER_STEP = "optimizer_step"
METRIC_TRACED_STEP_TIME = "traced_step_time"
METRIC_COLLECTIVE_WAIT = "collective_wait"

RAW_EVENT_TO_METRIC: Mapping[str, str] = {
    RAW_DATALOADER_NEXT: METRIC_INPUT_WAIT,
    RAW_H2D: METRIC_H2D,
    RAW_FORWARD: METRIC_FORWARD,
    RAW_BACKWARD: METRIC_BACKWARD,
    RAW_OPTIMIZER_STEP: METRIC_OPTIMIZER_STEP,
    RAW_STEP_TIME: METRIC_TRACED_STEP_TIME,
    RAW_COLLECTIVE_WAIT: METRIC_COLLECTIVE_WAIT,  # last: the packed SQLite row appends it
}

CANONICAL_METRICS: tuple[str, ...] = tuple(RAW_EVENT_TO_METRIC.values())
METRIC_TO_RAW_EVENT: Mapping[str, str] = {metric: raw for raw, metric in RAW_EVENT_TO_METRIC.items()}

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
OCCURRENCE_METRICS: tuple[str, ...] = (METRIC_H2D, METRIC_OPTIMIZER_STEP, METRIC_COLLECTIVE_WAIT)


def raw_event_key(raw_event: str) -> str:
    """`_traceml_internal:forward_time` -> `forward_time` (used inside attribute keys)."""
    if raw_event.startswith(RAW_EVENT_PREFIX):
        return raw_event[len(RAW_EVENT_PREFIX):]
    return raw_event


def raw_event_from_key(key: str) -> str:
    """Inverse of `raw_event_key`."""
    return RAW_EVENT_PREFIX + key


def phase_name(raw_event: str) -> str:
    """The name users see for a raw event: its canonical metric (`forward`), else the
    event's own name without the internal prefix (a `timed_region` of the user's)."""
    return RAW_EVENT_TO_METRIC.get(raw_event) or raw_event_key(raw_event)


def raw_event_of_phase(name: str) -> str:
    """Inverse of `phase_name`: `forward` -> `_traceml_internal:forward_time`."""
    return METRIC_TO_RAW_EVENT.get(name) or raw_event_from_key(name)


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
ATTR_RUN_ATTEMPT = "traceml.run.attempt"
"""Elastic restart attempt of the rank process (`TORCHELASTIC_RESTART_COUNT`, 0 first)."""

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
"""Scope name; the scope version is the installed package's (`schema.distribution`)."""

# Resource attributes describing what made the telemetry (resource semantic conventions).
# The spans are built by TraceML's own encoder, not by the OpenTelemetry SDK, so
# `telemetry.sdk.name` must not be the reserved `opentelemetry`: it is the module of
# that encoder's entry point. `telemetry.distro.*` names TraceML as the
# instrumentation agent that patches PyTorch; both versions are the package's.
RES_TELEMETRY_SDK_NAME = "telemetry.sdk.name"
RES_TELEMETRY_SDK_LANGUAGE = "telemetry.sdk.language"
RES_TELEMETRY_SDK_VERSION = "telemetry.sdk.version"
RES_TELEMETRY_DISTRO_NAME = "telemetry.distro.name"
RES_TELEMETRY_DISTRO_VERSION = "telemetry.distro.version"
TELEMETRY_SDK_NAME = "traceml.exporter"
TELEMETRY_SDK_LANGUAGE = "python"
TELEMETRY_DISTRO_NAME = DISTRIBUTION
TELEMETRY_PREFIX = "telemetry."
"""A job's own `telemetry.*` resource keys describe its SDK and agent: never merged in."""

SPAN_STEP = "traceml.step"
"""One per completed step per rank; self-contained: it alone rebuilds one row."""

SPAN_PHASE_PREFIX = "traceml.phase."
"""Child spans `traceml.phase.<phase name>` (`phase_name`: `traceml.phase.forward`) for
trace viewers only. Older exporters named them by the raw event key
(`traceml.phase.forward_time`); the processor ignores every span with this prefix."""

SPAN_RUN_END = "traceml.run.end"
"""End-of-run marker: the rank's TraceML shut down (attributes carry final counts and, when
known, how the process ended: `ATTR_RUN_END_OUTCOME`)."""

ATTR_STEP = "traceml.step"
ATTR_DEVICE = "traceml.device"
ATTR_PHASE = "traceml.phase.name"
"""On a phase child span: its phase name (`forward`). Not `traceml.phase` itself, a
namespace of the step span's attributes: a name should not also be a namespace."""
ATTR_COLLECTIVE_LAST_ENTRY = "traceml.collective.last_entry"
"""On the step span, when a collective was timed: seconds from the step's first timed event to its
last collective_wait entry (double). The latest entry among ranks is the rank the others waited for."""
LEGACY_ATTR_PHASE = "traceml.phase"
"""What older exporters put on phase children: the raw event name (never read back)."""
ATTR_STEPS_COMPLETED = "traceml.steps.completed"
ATTR_STEP_BOUNDARY = "traceml.steps.boundary"
"""On `traceml.run.end`: how the rank's steps were delimited (one of `STEP_BOUNDARIES`)."""
STEP_BOUNDARY_EXPLICIT = "explicit"
"""A `trace_step` was entered, or a framework integration (HF Trainer, Lightning) claimed the
steps (whether or not one completed: 0 completed then means training stopped before its first)."""
STEP_BOUNDARY_OPTIMIZER = "optimizer"
"""Auto mode, unmarked loop: one step per optimizer update (`instrumentation/step_boundary.py`)."""
STEP_BOUNDARY_NONE = "none"
"""No boundary at all: no `trace_step`, no integration and (auto mode) no optimizer update,
e.g. an inference or evaluation loop; the process completed no step."""
STEP_BOUNDARIES = (STEP_BOUNDARY_EXPLICIT, STEP_BOUNDARY_OPTIMIZER, STEP_BOUNDARY_NONE)

# Peak memory of the step, on the `traceml.step` span (int, bytes: unit `By`), with
# ATTR_DEVICE naming the tracked device. Present only when measured (CUDA); a
# non-CUDA device sends none of the three (stored as null, never 0). On the span,
# not on a gauge: a per-step metric attribute would make a new series every step.
ATTR_MEMORY_PEAK_ALLOCATED = "traceml.memory.peak_allocated"
ATTR_MEMORY_PEAK_RESERVED = "traceml.memory.peak_reserved"
MEMORY_UNIT = "By"

# Per phase (raw event) on the `traceml.step` span: summed values for the step.
#   traceml.phase.<phase>.cpu.duration   double, seconds, always present for a seen event
#   traceml.phase.<phase>.gpu.duration   double, seconds, only when CUDA timing resolved
#   traceml.phase.<phase>.count          int, number of occurrences summed
# <phase> is `phase_name(raw event)`: the canonical metric (`forward`, `input_wait`, ...,
# `traced_step_time` for the whole traced step), else a user region's own name.
# Seconds, as OpenTelemetry's conventions use for durations; the unit is declared
# here (OTLP attributes have no unit field) and never spelled in the name.
EVENT_ATTR_PREFIX = "traceml.phase."
EVENT_FIELD_CPU = "cpu.duration"
EVENT_FIELD_GPU = "gpu.duration"
EVENT_FIELD_COUNT = "count"
EVENT_FIELDS: tuple[str, ...] = (EVENT_FIELD_CPU, EVENT_FIELD_GPU, EVENT_FIELD_COUNT)
DURATION_UNIT = "s"
EVENT_FIELD_UNITS: Mapping[str, str] = {EVENT_FIELD_CPU: DURATION_UNIT, EVENT_FIELD_GPU: DURATION_UNIT,
                                        EVENT_FIELD_COUNT: "{occurrence}"}

# What older exporters sent (before these names followed OpenTelemetry's conventions);
# the processor still reads it, into the same rows:
#   traceml.event.<raw event key>.cpu_ms / .gpu_ms   double, milliseconds
#   traceml.event.<raw event key>.count              int
# (<raw event key>: the raw name without `_traceml_internal:`, e.g. `forward_time`.)
LEGACY_EVENT_ATTR_PREFIX = "traceml.event."
LEGACY_DURATION_UNIT = "ms"
LEGACY_EVENT_FIELDS: Mapping[str, tuple[str, str]] = {
    "cpu_ms": (EVENT_FIELD_CPU, LEGACY_DURATION_UNIT),
    "gpu_ms": (EVENT_FIELD_GPU, LEGACY_DURATION_UNIT),
    "count": (EVENT_FIELD_COUNT, EVENT_FIELD_UNITS[EVENT_FIELD_COUNT]),
}  # legacy field -> (current field, unit of the legacy value)
_EVENT_SUFFIXES = tuple((f".{field}", field) for field in EVENT_FIELDS)


def event_attribute(raw_event: str, field: str) -> str:
    """Attribute key for one field of one raw event on a `traceml.step` span:
    (`_traceml_internal:forward_time`, `cpu.duration`) -> `traceml.phase.forward.cpu.duration`."""
    if field not in EVENT_FIELDS:
        raise ValueError(f"unknown event field {field!r} (one of {EVENT_FIELDS})")
    return f"{EVENT_ATTR_PREFIX}{phase_name(raw_event)}.{field}"


def legacy_event_attribute(raw_event: str, field: str) -> str:
    """The key an older exporter sent: (`_traceml_internal:forward_time`, `cpu_ms`) ->
    `traceml.event.forward_time.cpu_ms` (for fixtures of such exporters)."""
    if field not in LEGACY_EVENT_FIELDS:
        raise ValueError(f"unknown legacy event field {field!r} (one of {tuple(LEGACY_EVENT_FIELDS)})")
    return f"{LEGACY_EVENT_ATTR_PREFIX}{raw_event_key(raw_event)}.{field}"


def parse_event_attribute(key: str) -> tuple[str, str, str] | None:
    """A step span's event attribute, current or legacy -> (raw event, current field, unit
    of the value), else None:
    `traceml.phase.forward.cpu.duration` -> (`_traceml_internal:forward_time`, `cpu.duration`, `s`);
    `traceml.event.forward_time.cpu_ms` -> (`_traceml_internal:forward_time`, `cpu.duration`, `ms`)."""
    if key.startswith(EVENT_ATTR_PREFIX):
        rest = key[len(EVENT_ATTR_PREFIX):]
        for suffix, field in _EVENT_SUFFIXES:
            if rest.endswith(suffix) and len(rest) > len(suffix):
                return raw_event_of_phase(rest[:-len(suffix)]), field, EVENT_FIELD_UNITS[field]
        return None
    if key.startswith(LEGACY_EVENT_ATTR_PREFIX):
        name, dot, legacy = key[len(LEGACY_EVENT_ATTR_PREFIX):].rpartition(".")
        spec = LEGACY_EVENT_FIELDS.get(legacy)
        if not dot or not name or spec is None:
            return None
        return raw_event_from_key(name), spec[0], spec[1]
    return None


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
# (traces, metrics: all it sends) and the processor's record counts (all three it
# receives) carry one in ATTR_SIGNAL. Logs are received only: the original TraceML's
# step records arrive as OTLP log records (docs/wire-format.md, "Log records received").
Signal = Literal["traces", "metrics", "logs"]
SIGNAL_TRACES: Signal = "traces"
SIGNAL_METRICS: Signal = "metrics"
SIGNAL_LOGS: Signal = "logs"
SIGNALS: tuple[Signal, ...] = (SIGNAL_TRACES, SIGNAL_METRICS, SIGNAL_LOGS)
"""Every signal the processor receives and counts."""
EXPORTED_SIGNALS: tuple[Signal, ...] = (SIGNAL_TRACES, SIGNAL_METRICS)
"""The signals TraceML's exporter sends."""

# Final counts on the `traceml.run.end` span (besides ATTR_STEPS_COMPLETED and,
# when any step was published, ATTR_STEP = the last step number).
RUN_END_DROPPED_PREFIX = "traceml.telemetry.dropped."
ATTR_RUN_END_EXPORT_FAILURES = "traceml.telemetry.export.failures"
ATTR_RUN_END_EXPORT_RETRIES = "traceml.telemetry.export.retries"
# How the rank process ended, on the `traceml.run.end` span when known (values:
# `schema.endings.MARKER_OUTCOMES`); the exit status the script's ending implies.
ATTR_RUN_END_OUTCOME = "traceml.run.outcome"
ATTR_RUN_END_EXIT_CODE = "traceml.run.exit_code"


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
ATTR_REASON = "traceml.reason"
"""Why an export request was refused (one of `REFUSAL_REASONS`); absent on accepted ones."""
ATTR_HOST = "traceml.host"
"""The host (`host.name` of its ranks) a fleet series is about: bounded by the fleet's host count."""

# The processor's self-metric values: closed sets, so every series is bounded
# (processor/self_telemetry.py counts them, as the Collector's obsreport does).
METRIC_PROCESSOR_RECORDS = "traceml.processor.records"
METRIC_PROCESSOR_REQUESTS = "traceml.processor.requests"
RECORD_ACCEPTED = "accepted"
RECORD_DUPLICATE = "duplicate"
RECORD_REJECTED = "rejected"
RECORD_IGNORED = "ignored"
RECORD_OUTCOMES: tuple[str, ...] = (RECORD_ACCEPTED, RECORD_DUPLICATE, RECORD_REJECTED, RECORD_IGNORED)
REQUEST_ACCEPTED = "accepted"
REQUEST_REFUSED = "refused"
REFUSED_UNAUTHENTICATED = "unauthenticated"  # HTTP 401, gRPC UNAUTHENTICATED
REFUSED_OVER_LIMIT = "over_limit"  # more concurrent requests than the limit: 429 / UNAVAILABLE + RetryInfo
REFUSED_BACKPRESSURE = "backpressure"  # the ingest queue is full: 429 / UNAVAILABLE + RetryInfo
REFUSED_UNAVAILABLE = "unavailable"  # not committed (store failure, shutdown): 503 / UNAVAILABLE + RetryInfo
REFUSED_UNDECODABLE = "undecodable"  # not OTLP: 400 / INVALID_ARGUMENT
REFUSED_TOO_LARGE = "too_large"  # HTTP 413 (gRPC's own size limit answers before the processor sees the call)
REFUSED_UNSUPPORTED = "unsupported_media"  # HTTP 415: content type or encoding
REFUSAL_REASONS: tuple[str, ...] = (REFUSED_UNAUTHENTICATED, REFUSED_OVER_LIMIT, REFUSED_BACKPRESSURE,
                                    REFUSED_UNAVAILABLE, REFUSED_UNDECODABLE, REFUSED_TOO_LARGE,
                                    REFUSED_UNSUPPORTED)

METRIC_PROCESSOR_HTTP_CONNECTION_EVENTS = "traceml.processor.http.connection.events"
ATTR_CONNECTION_EVENT = "traceml.connection.event"
"""What the OTLP/HTTP front did to a connection (one of `HTTP_CONNECTION_EVENTS`)."""
HTTP_CONNECTION_EVENTS: tuple[str, ...] = (
    "refused_at_cap",  # the connection cap was reached and every connection was being answered: 503, closed
    # At the cap, the connection that made the least progress is closed to make room:
    "evicted_idle",  # no request at all (a new connection, a kept-alive one, a stalled TLS handshake)
    "evicted_slow_head",  # a request head still arriving (a slow-header flood)
    "evicted_slow_body",  # a request body arriving slowest (only when nothing waits for a head)
    "header_timeout", "body_timeout", "write_timeout",  # a slow or stalled client, closed
    "framing_error",  # bad HTTP framing (chunking, Content-Length with Transfer-Encoding): 400, closed
    "hung_up",  # the client closed the connection mid-request
    "tls_failed",  # the TLS handshake failed or never came
    "accept_out_of_descriptors",  # accept() met EMFILE/ENFILE: accepting paused for a second
)

# The processor's other own series (specs: PROCESSOR_METRICS below): per-run refresh figures,
# the run count, failed summary pushes, series left out by the series limit.
METRIC_PROCESSOR_ANALYSIS_DURATION = "traceml.processor.analysis.duration"
METRIC_PROCESSOR_RUN_LAG = "traceml.processor.run.lag"
METRIC_PROCESSOR_RUNS = "traceml.processor.runs"
METRIC_PROCESSOR_EXPORT_FAILURES = "traceml.processor.export.failures"
METRIC_PROCESSOR_SERIES_LEFT_OUT = "traceml.processor.series.left_out"

# Repeat offenders across runs (processor/fleet.py): per host that was a confirmed culprit in a
# run this processor summarised within the fleet period. One series per such host and name, so
# the count is bounded by the fleet's host count, not by runs; each replica exports its own runs
# and the recording rules sum them (deploy/prometheus).
METRIC_FLEET_HOST_FLAGGED_RUNS = "traceml.fleet.host.flagged_runs"
METRIC_FLEET_HOST_RUNS = "traceml.fleet.host.runs"
METRIC_FLEET_HOST_LOST_TIME = "traceml.fleet.host.lost_time"

# The summary metrics' names (specs: SUMMARY_METRICS below). Every module that builds,
# renders or queries one of these series names it through these constants.
METRIC_WINDOW_METRIC = "traceml.window.metric"
METRIC_WINDOW_SKEW = "traceml.window.skew"
METRIC_RANK_METRIC = "traceml.rank.metric"
METRIC_WINDOW_STEPS = "traceml.window.steps"
METRIC_WINDOW_RANKS = "traceml.window.ranks"
METRIC_WINDOW_LAST_STEP = "traceml.window.last_step"
METRIC_RUN_FIRST_STEP = "traceml.run.first_step"
METRIC_RUN_FRESH = "traceml.run.fresh"
METRIC_RANK_MEMORY_PEAK = "traceml.rank.memory.peak"
METRIC_DIAGNOSIS_ACTIVE = "traceml.diagnosis.active"
METRIC_RANK_TELEMETRY_DROPPED = "traceml.rank.telemetry.dropped"
METRIC_RUN_TELEMETRY_DROPPED = "traceml.run.telemetry.dropped"
METRIC_RUN_MEMORY_PEAK = "traceml.run.memory.peak"
METRIC_RUN_EXPORTED_RANKS = "traceml.run.exported_ranks"
METRIC_RUN_PROCESS_CPU_UTILIZATION = "traceml.run.process.cpu.utilization"
METRIC_RUN_PROCESS_MEMORY_USAGE = "traceml.run.process.memory.usage"
METRIC_RUN_GPU_UTILIZATION = "traceml.run.gpu.utilization"
METRIC_RUN_GPU_MEMORY_USAGE = "traceml.run.gpu.memory.usage"
METRIC_RUN_GPU_TEMPERATURE = "traceml.run.gpu.temperature"
METRIC_RUN_GPU_POWER = "traceml.run.gpu.power"
METRIC_RUN_HOST_CPU_UTILIZATION = "traceml.run.host.cpu.utilization"
METRIC_RUN_HOST_MEMORY_UTILIZATION = "traceml.run.host.memory.utilization"
METRIC_RANK_PROCESS_CPU_UTILIZATION = "traceml.rank.process.cpu.utilization"
METRIC_RANK_PROCESS_MEMORY_USAGE = "traceml.rank.process.memory.usage"
METRIC_RANK_GPU_UTILIZATION = "traceml.rank.gpu.utilization"
METRIC_RANK_GPU_MEMORY_USAGE = "traceml.rank.gpu.memory.usage"
# Counters over the aligned steps the live analysis counted, one per run (and Step Time metric):
# the series that carry the window's worst step as an exemplar on /metrics, where OpenMetrics
# allows exemplars on counters and histogram buckets only (a gauge's exemplar fails the scrape).
METRIC_RUN_STEPS = "traceml.run.steps"
METRIC_RUN_METRIC_TIME = "traceml.run.metric.time"
METRIC_RUN_BADPUT_TIME = "traceml.run.badput.time"
ATTR_BADPUT_CAUSE = "traceml.badput.cause"
"""A badput-ledger cause (`schema.badput.WINDOW_CAUSES`: five values, so the label stays bounded)."""

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
    MetricSpec(METRIC_WINDOW_METRIC, "s",
               "Step Time metric statistic over the run's common step window (selected clock).",
               (ATTR_RUN_ID, ATTR_METRIC, ATTR_STATISTIC)),
    MetricSpec(METRIC_WINDOW_SKEW, "1",
               "Worst-rank skew of a Step Time metric: (worst - median) / median.",
               (ATTR_RUN_ID, ATTR_METRIC)),
    MetricSpec(METRIC_RANK_METRIC, "s",
               "Per-rank window average of a Step Time metric.",
               (ATTR_RUN_ID, ATTR_RANK, ATTR_METRIC)),
    MetricSpec(METRIC_WINDOW_STEPS, "{step}",
               "Number of aligned steps in the run's common window.", (ATTR_RUN_ID,)),
    MetricSpec(METRIC_WINDOW_RANKS, "{rank}",
               "Number of ranks in the run's rank universe.", (ATTR_RUN_ID,)),
    MetricSpec(METRIC_WINDOW_LAST_STEP, "{step}",
               "Latest aligned step id in the window.", (ATTR_RUN_ID,)),
    MetricSpec(METRIC_RUN_FIRST_STEP, "{step}",
               "Lowest step id stored for the run: above 0 when the processor first saw the run part-way "
               "(started after the job, or received the run after a rebalance).", (ATTR_RUN_ID,)),
    MetricSpec(METRIC_RUN_FRESH, "1",
               "1 for the run's current freshness state (cold, live, bridged, expired).",
               (ATTR_RUN_ID, ATTR_FRESHNESS)),
    MetricSpec(METRIC_RANK_MEMORY_PEAK, "By",
               "Latest per-step peak allocated memory of a rank's tracked device.",
               (ATTR_RUN_ID, ATTR_RANK)),
    MetricSpec(METRIC_DIAGNOSIS_ACTIVE, "1",
               "Active diagnosis issue; the value is its score (0 where none applies).",
               (ATTR_RUN_ID, ATTR_DIAGNOSIS_KIND, ATTR_DIAGNOSIS_SEVERITY,
                ATTR_DIAGNOSIS_STATUS, ATTR_CULPRIT_RANK)),
    MetricSpec(METRIC_RANK_TELEMETRY_DROPPED, "{record}",
               "Telemetry records a rank reported dropped, by queue.",
               (ATTR_RUN_ID, ATTR_RANK, ATTR_QUEUE), kind="counter"),
    # Job-level aggregates over every rank: the per-rank series above exist only for the
    # ranks that matter (processor/reporting/summary_metrics.py says which).
    MetricSpec(METRIC_RUN_TELEMETRY_DROPPED, "{record}",
               "Telemetry records all ranks of the run reported dropped, summed over ranks, by queue.",
               (ATTR_RUN_ID, ATTR_QUEUE), kind="counter"),
    MetricSpec(METRIC_RUN_MEMORY_PEAK, "By",
               "Latest per-step peak allocated memory over all ranks of the run (median/worst/average rank).",
               (ATTR_RUN_ID, ATTR_STATISTIC)),
    MetricSpec(METRIC_RUN_EXPORTED_RANKS, "{rank}",
               "Ranks of the run that have per-rank series (culprits, worst, representative, top-k by score).",
               (ATTR_RUN_ID,)),
    MetricSpec(METRIC_RUN_STEPS, "{step}",
               "Aligned steps of the run the live analysis counted (every rank completed them); the exemplar "
               "is the window's worst step (its step time, trace and span id).", (ATTR_RUN_ID,), kind="counter"),
    MetricSpec(METRIC_RUN_METRIC_TIME, "s",
               "A Step Time metric's per-step median over ranks, summed over the counted aligned steps; the "
               "exemplar is the window's worst step for that metric (its value, trace and span id).",
               (ATTR_RUN_ID, ATTR_METRIC), kind="counter"),
    MetricSpec(METRIC_RUN_BADPUT_TIME, "s",
               "Rank-seconds the run lost to a badput-ledger cause, added for each counted aligned step at the "
               "live window's per-step rate; the exemplar is the window's worst step (its step time, trace and "
               "span id).", (ATTR_RUN_ID, ATTR_BADPUT_CAUSE), kind="counter"),
    # Resource figures over the window (the analysis's `ResourceWindow`; which figure feeds which
    # name: processor/reporting/summary_metrics.py): the median and the worst rank or host of the
    # run, per rank for the exported ranks only. Under `traceml.run.` / `traceml.rank.`, never the
    # semantic conventions' own names (`process.cpu.utilization`, `hw.gpu.utilization`, ...), which
    # a Collector's hostmetrics or DCGM pipeline may carry into the same backend.
    MetricSpec(METRIC_RUN_PROCESS_CPU_UTILIZATION, "1",
               "Mean CPU utilisation of the run's rank processes over the window (median/worst rank).",
               (ATTR_RUN_ID, ATTR_STATISTIC)),
    MetricSpec(METRIC_RUN_PROCESS_MEMORY_USAGE, "By",
               "Highest resident set size of the run's rank processes over the window (median/worst rank).",
               (ATTR_RUN_ID, ATTR_STATISTIC)),
    MetricSpec(METRIC_RUN_GPU_UTILIZATION, "1",
               "Mean utilisation of the ranks' GPUs over the window (median rank; worst: the least busy).",
               (ATTR_RUN_ID, ATTR_STATISTIC)),
    MetricSpec(METRIC_RUN_GPU_MEMORY_USAGE, "By",
               "Highest memory in use on the ranks' GPUs over the window (median/worst rank).",
               (ATTR_RUN_ID, ATTR_STATISTIC)),
    MetricSpec(METRIC_RUN_GPU_TEMPERATURE, "Cel",
               "Highest temperature of the ranks' GPUs over the window (median/worst rank).",
               (ATTR_RUN_ID, ATTR_STATISTIC)),
    MetricSpec(METRIC_RUN_GPU_POWER, "W",
               "Mean power draw of the ranks' GPUs over the window (median/worst rank).",
               (ATTR_RUN_ID, ATTR_STATISTIC)),
    MetricSpec(METRIC_RUN_HOST_CPU_UTILIZATION, "1",
               "Mean busy fraction of the CPUs of the run's hosts over the window (median/worst host).",
               (ATTR_RUN_ID, ATTR_STATISTIC)),
    MetricSpec(METRIC_RUN_HOST_MEMORY_UTILIZATION, "1",
               "Highest used / total memory of the run's hosts over the window (median/worst host).",
               (ATTR_RUN_ID, ATTR_STATISTIC)),
    MetricSpec(METRIC_RANK_PROCESS_CPU_UTILIZATION, "1",
               "Mean CPU utilisation of a rank's process over the window.", (ATTR_RUN_ID, ATTR_RANK)),
    MetricSpec(METRIC_RANK_PROCESS_MEMORY_USAGE, "By",
               "Highest resident set size of a rank's process over the window.", (ATTR_RUN_ID, ATTR_RANK)),
    MetricSpec(METRIC_RANK_GPU_UTILIZATION, "1",
               "Mean utilisation of a rank's GPU over the window.", (ATTR_RUN_ID, ATTR_RANK)),
    MetricSpec(METRIC_RANK_GPU_MEMORY_USAGE, "By",
               "Highest memory in use on a rank's GPU over the window.", (ATTR_RUN_ID, ATTR_RANK)),
)
RESOURCE_STATISTICS: tuple[str, ...] = STATISTICS[:2]
"""The statistics of the run-level resource gauges: the median and the worst member (no average:
the worst member is what a dashboard or an alert looks for)."""

PROCESSOR_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(METRIC_PROCESSOR_RECORDS, "{record}",
               "Records in the export requests the processor accepted, by outcome (accepted, duplicate, "
               "rejected, ignored).",
               (ATTR_OUTCOME, ATTR_SIGNAL), kind="counter"),
    MetricSpec(METRIC_PROCESSOR_REQUESTS, "{request}",
               "OTLP export requests answered by the receivers, by outcome (accepted, refused) and, when "
               "refused, reason (unauthenticated, over_limit, backpressure, unavailable, undecodable, "
               "too_large, unsupported_media).",
               (ATTR_OUTCOME, ATTR_SIGNAL, ATTR_REASON), kind="counter"),
    MetricSpec(METRIC_PROCESSOR_HTTP_CONNECTION_EVENTS, "{event}",
               "What the HTTP fronts (OTLP/HTTP, the web view, /metrics) did to connections they could "
               "not serve as asked, by event (refused_at_cap, evicted_idle, evicted_slow_head, "
               "evicted_slow_body, header/body/write timeouts, framing_error, hung_up, tls_failed, "
               "accept_out_of_descriptors).",
               (ATTR_CONNECTION_EVENT,), kind="counter"),
    MetricSpec(METRIC_PROCESSOR_ANALYSIS_DURATION, "s",
               "Duration of the latest live analysis refresh of a run.", (ATTR_RUN_ID,)),
    MetricSpec(METRIC_PROCESSOR_RUN_LAG, "s",
               "Seconds between now and the newest step end received for a run.", (ATTR_RUN_ID,)),
    MetricSpec(METRIC_PROCESSOR_RUNS, "{run}", "Runs currently tracked.", ()),
    MetricSpec(METRIC_PROCESSOR_EXPORT_FAILURES, "{request}",
               "Summary-metric pushes to the OTLP export endpoint that failed after their retries.",
               (), kind="counter"),
    MetricSpec(METRIC_PROCESSOR_SERIES_LEFT_OUT, "{series}",
               "Series left out of the latest /metrics scrape or push because the series limit was reached "
               "(whole runs, the most recently first seen first).", ()),
    MetricSpec(METRIC_FLEET_HOST_FLAGGED_RUNS, "{run}",
               "Runs summarised by this processor within the fleet period whose confirmed straggler ran on "
               "the host (hosts that were a culprit at least once in the period).", (ATTR_HOST,)),
    MetricSpec(METRIC_FLEET_HOST_RUNS, "{run}",
               "Runs summarised by this processor within the fleet period that had a rank on the host "
               "(for the hosts of the flagged-runs series).", (ATTR_HOST,)),
    MetricSpec(METRIC_FLEET_HOST_LOST_TIME, "s",
               "Rank-seconds the other ranks lost waiting for the host's culprit ranks (the badput ledger's "
               "straggler wait over each flagged run) within the fleet period.", (ATTR_HOST,)),
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

_UNIT_SUFFIX = {"s": "seconds", "By": "bytes", "1": "ratio", "ms": "milliseconds", "Cel": "celsius",
                "W": "watts"}
"""OpenTelemetry unit -> Prometheus base-unit suffix (the Collector's Prometheus translation:
`Cel` -> `celsius`, `W` -> `watts`)."""


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


def prometheus_unit(unit: str) -> str | None:
    """The unit a Prometheus name carries as its suffix (OpenMetrics `# UNIT`); None for annotations."""
    return _UNIT_SUFFIX.get(unit)


def prometheus_label(attribute_key: str) -> str:
    """OpenTelemetry attribute key -> Prometheus label name."""
    return attribute_key.replace(".", "_").replace("-", "_")
