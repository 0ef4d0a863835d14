"""Every environment variable TraceML reads, declared and documented once.

Both sides import the names from here; each reads its own at start-up. Standard
OpenTelemetry variables (`OTEL_*`) keep their standard meaning and are read by the
specification's rules (`env_values`); TraceML's own start with `TRACEML_`.
`docs/configuration.md` lists every one of them, with its default, for people
(`tests/schema/test_configuration_doc.py` keeps the two in step).
"""
from __future__ import annotations

from typing import Mapping

from traceml.schema.vocabulary import EXPORTED_SIGNALS

# --- Standard OpenTelemetry variables honoured ---------------------------------
OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
OTEL_RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"

# OTLP exporter options: a generic variable, overridden per signal by its
# OTEL_EXPORTER_OTLP_TRACES_* / OTEL_EXPORTER_OTLP_METRICS_* form (`otlp_value`).
OTEL_EXPORTER_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTEL_EXPORTER_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
OTEL_EXPORTER_OTLP_HEADERS = "OTEL_EXPORTER_OTLP_HEADERS"
OTEL_EXPORTER_OTLP_TIMEOUT = "OTEL_EXPORTER_OTLP_TIMEOUT"
OTEL_EXPORTER_OTLP_COMPRESSION = "OTEL_EXPORTER_OTLP_COMPRESSION"
OTEL_EXPORTER_OTLP_INSECURE = "OTEL_EXPORTER_OTLP_INSECURE"
OTEL_EXPORTER_OTLP_CERTIFICATE = "OTEL_EXPORTER_OTLP_CERTIFICATE"
OTEL_EXPORTER_OTLP_CLIENT_KEY = "OTEL_EXPORTER_OTLP_CLIENT_KEY"
OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE = "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"

OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
OTEL_EXPORTER_OTLP_TRACES_HEADERS = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
OTEL_EXPORTER_OTLP_TRACES_TIMEOUT = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
OTEL_EXPORTER_OTLP_TRACES_COMPRESSION = "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION"
OTEL_EXPORTER_OTLP_TRACES_INSECURE = "OTEL_EXPORTER_OTLP_TRACES_INSECURE"
OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE = "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE"
OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY = "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY"
OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE = "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE"

OTEL_EXPORTER_OTLP_METRICS_ENDPOINT = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
OTEL_EXPORTER_OTLP_METRICS_PROTOCOL = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"
OTEL_EXPORTER_OTLP_METRICS_HEADERS = "OTEL_EXPORTER_OTLP_METRICS_HEADERS"
OTEL_EXPORTER_OTLP_METRICS_TIMEOUT = "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT"
OTEL_EXPORTER_OTLP_METRICS_COMPRESSION = "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION"
OTEL_EXPORTER_OTLP_METRICS_INSECURE = "OTEL_EXPORTER_OTLP_METRICS_INSECURE"
OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE = "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE"
OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY = "OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY"
OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE = "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE"

# Batch span processor and periodic metric reader: mapped onto the exporter's queue,
# batch and intervals (`traceml.exporter.settings`), in milliseconds as the spec gives them.
OTEL_BSP_SCHEDULE_DELAY = "OTEL_BSP_SCHEDULE_DELAY"
OTEL_BSP_EXPORT_TIMEOUT = "OTEL_BSP_EXPORT_TIMEOUT"
OTEL_BSP_MAX_QUEUE_SIZE = "OTEL_BSP_MAX_QUEUE_SIZE"
OTEL_BSP_MAX_EXPORT_BATCH_SIZE = "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"
OTEL_METRIC_EXPORT_INTERVAL = "OTEL_METRIC_EXPORT_INTERVAL"
OTEL_METRIC_EXPORT_TIMEOUT = "OTEL_METRIC_EXPORT_TIMEOUT"

OTLP_SIGNALS = EXPORTED_SIGNALS
"""The signals TraceML exports, each with its per-signal variables."""
OTLP_OPTIONS = ("ENDPOINT", "PROTOCOL", "HEADERS", "TIMEOUT", "COMPRESSION", "INSECURE", "CERTIFICATE",
                "CLIENT_KEY", "CLIENT_CERTIFICATE")
"""The OTLP exporter options that each have a generic and a per-signal variable."""


def otlp_variables(option: str, signal: str) -> tuple[str, str]:
    """(per-signal variable, generic variable) of one OTLP exporter option, e.g.
    `("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")`."""
    if option not in OTLP_OPTIONS or signal not in OTLP_SIGNALS:
        raise KeyError((option, signal))
    return f"OTEL_EXPORTER_OTLP_{signal.upper()}_{option}", f"OTEL_EXPORTER_OTLP_{option}"


def otlp_candidates(environ: Mapping[str, str], option: str, signal: str) -> list[tuple[str, str]]:
    """The one precedence rule of the OTLP exporter specification, for every option.

    Returns (variable, value) for each of the per-signal and the generic variable
    that is set, in that order: the first wins, and a reader that finds it invalid
    (warned about and ignored) falls through to the next. An empty value counts as
    unset, as the specification says.
    """
    out = []
    for name in otlp_variables(option, signal):
        value = environ.get(name)
        if value is not None and value.strip():
            out.append((name, value))
    return out


def otlp_value(environ: Mapping[str, str], option: str, signal: str) -> tuple[str, str] | None:
    """(variable, value) that sets `option` for `signal` (`otlp_candidates`' first), or None."""
    candidates = otlp_candidates(environ, option, signal)
    return candidates[0] if candidates else None


def exporter_candidates(environ: Mapping[str, str], option: str, signal: str) -> list[tuple[str, str]]:
    """What TraceML's exporter reads for one option of one signal: TraceML's own variable
    (`TRACEML_OTLP_<option>`, where one exists and is set), then `otlp_candidates`.

    The job's own OpenTelemetry SDK reads only the `OTEL_*` variables, so `traceml run`
    points TraceML's exporter at its processor with TraceML's own and leaves the job's
    SDK where it was; someone who configures through `OTEL_*` alone sees the
    specification's order unchanged.
    """
    own = TRACEML_OTLP_OPTIONS.get(option)
    value = environ.get(own) if own else None
    first = [(own, value)] if value is not None and value.strip() else []
    return first + otlp_candidates(environ, option, signal)


def exporter_value(environ: Mapping[str, str], option: str, signal: str) -> tuple[str, str] | None:
    """(variable, value) that sets `option` for `signal` in TraceML's exporter, or None."""
    candidates = exporter_candidates(environ, option, signal)
    return candidates[0] if candidates else None


# --- Launcher / rank identity (set by torchrun, SLURM) -------------------------
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
SLURM_JOB_ID = "SLURM_JOB_ID"
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
GROUP_RANK = "GROUP_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
"""Set by torch's elastic agent in each rank: how many times the workers were restarted (0 first)."""
"""torchrun sets it to True: a TCPStore at MASTER_ADDR:MASTER_PORT already serves every rank."""
SLURM_PROCID = "SLURM_PROCID"
SLURM_LOCALID = "SLURM_LOCALID"
SLURM_NODEID = "SLURM_NODEID"
SLURM_NTASKS = "SLURM_NTASKS"
SLURM_NTASKS_PER_NODE = "SLURM_NTASKS_PER_NODE"
SLURM_NNODES = "SLURM_NNODES"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
"""Only read by the resource sampler: maps the rank's CUDA device index (the process's own
numbering) onto the host's NVML device, by index or UUID."""
OMP_NUM_THREADS = "OMP_NUM_THREADS"
"""Only looked at by `traceml run` / `traceml demo`: set to 1 for the ranks when the user has not
set it (torchrun's own default for several local ranks, set quietly)."""

# --- TraceML training side ----------------------------------------------------
TRACEML_DISABLE = "TRACEML_DISABLE"
"""Kill switch: any of 1/true/yes/on makes every TraceML call a no-op (TraceML's own, looser
boolean rule, `env_flag`; OTEL_SDK_DISABLED follows the OpenTelemetry rule: only `true`)."""
TRACEML_RUN_ID = "TRACEML_RUN_ID"
"""Explicit run id; wins over TORCHELASTIC_RUN_ID and SLURM_JOB_ID."""
TRACEML_MODE = "TRACEML_MODE"
"""`auto` (patch DataLoader, forward, backward, H2D, optimizer) or `manual`."""
TRACEML_TRAINING_STRATEGY = "TRACEML_TRAINING_STRATEGY"
"""`ddp` (default with world size > 1), `fsdp` or `single`."""
TRACEML_PHASE_SPANS = "TRACEML_PHASE_SPANS"
"""Emit per-phase child spans for trace viewers (default on)."""
TRACEML_EXPORT_QUEUE_SIZE = "TRACEML_EXPORT_QUEUE_SIZE"
"""Finished steps (and, separately, memory snapshots) the exporter buffers; beyond it new ones are
dropped and counted (default 8192). Wins over OTEL_BSP_MAX_QUEUE_SIZE."""
TRACEML_OTLP_ENDPOINT = "TRACEML_OTLP_ENDPOINT"
"""Where TraceML's own exporter sends both signals; wins over every OTEL_EXPORTER_OTLP_*ENDPOINT
variable, which the job's own OpenTelemetry SDK goes on reading. Same forms as
OTEL_EXPORTER_OTLP_ENDPOINT (a base URL over HTTP). `traceml run` sets it in the ranks."""
TRACEML_OTLP_PROTOCOL = "TRACEML_OTLP_PROTOCOL"
"""The protocol of TraceML's own exporter (`grpc` or `http/protobuf`); wins over the OTEL_* ones."""
PROTOCOL_GRPC = "grpc"
PROTOCOL_HTTP = "http/protobuf"
"""The two OTLP protocols' names, as OTEL_EXPORTER_OTLP_PROTOCOL and TRACEML_OTLP_PROTOCOL spell them."""
TRACEML_OTLP_HEADERS = "TRACEML_OTLP_HEADERS"
"""Headers TraceML's own exporter sends (`k=v,...`, as OTEL_EXPORTER_OTLP_HEADERS); wins over the
OTEL_* ones. `traceml run` puts the job processor's bearer token here, where no SDK of the job reads it."""
TRACEML_OTLP_OPTIONS = {"ENDPOINT": TRACEML_OTLP_ENDPOINT, "PROTOCOL": TRACEML_OTLP_PROTOCOL,
                        "HEADERS": TRACEML_OTLP_HEADERS}
"""OTLP option -> TraceML's own variable for it (`exporter_candidates`)."""
TRACEML_LAUNCHED = "TRACEML_LAUNCHED"
"""Set by `traceml run` in each rank: enable instrumentation without code changes."""
TRACEML_EXIT_AFTER_FLUSH = "TRACEML_EXIT_AFTER_FLUSH"
"""Opt-in for `traceml run`: once the script has returned and telemetry is flushed, run the
atexit handlers, flush stdio and leave with os._exit, skipping interpreter teardown (where
torch 2.13 DDP on gloo can abort under CPU load). Unclosed files are not finalised: opt in
only for scripts that close what they open."""
TRACEML_RESOURCES = "TRACEML_RESOURCES"
"""The resource sampler (process, host and GPU metrics, `traceml.resources`): on by default;
0/false/no/off turns it off; any other value is warned about and ignored."""
TRACEML_RESOURCE_INTERVAL = "TRACEML_RESOURCE_INTERVAL"
"""Seconds between two resource samples (default 5; a positive number, below 0.1 raised to 0.1)."""
TRACEML_CONTROL_ENDPOINT = "TRACEML_CONTROL_ENDPOINT"
"""Deep capture (issue 33): the processor base URLs (comma-separated, e.g. http://127.0.0.1:4318)
whose control endpoint the rank's exporter polls for capture requests, with the exporter's own headers
and TLS settings; unset or empty: no polling. `traceml run` sets it to its embedded processor."""
TRACEML_CONTROL_POLL_INTERVAL = "TRACEML_CONTROL_POLL_INTERVAL"
"""Seconds between two polls of the control endpoint while steps flow (default 2; a positive number,
below 0.1 raised to 0.1)."""

# --- TraceML processor ----------------------------------------------------------
# Their flags, defaults and accepted values are declared once, in `traceml.processor.settings`.
TRACEML_PROCESSOR_DB = "TRACEML_PROCESSOR_DB"
TRACEML_PROCESSOR_OTLP_GRPC = "TRACEML_PROCESSOR_OTLP_GRPC"
TRACEML_PROCESSOR_OTLP_HTTP = "TRACEML_PROCESSOR_OTLP_HTTP"
TRACEML_PROCESSOR_PROMETHEUS = "TRACEML_PROCESSOR_PROMETHEUS"
TRACEML_PROCESSOR_UI = "TRACEML_PROCESSOR_UI"
TRACEML_PROCESSOR_EXPORT_ENDPOINT = "TRACEML_PROCESSOR_EXPORT_ENDPOINT"
TRACEML_PROCESSOR_SUMMARY_DIR = "TRACEML_PROCESSOR_SUMMARY_DIR"
TRACEML_PROCESSOR_AUTH_TOKEN = "TRACEML_PROCESSOR_AUTH_TOKEN"
TRACEML_PROCESSOR_TLS_CERT = "TRACEML_PROCESSOR_TLS_CERT"
TRACEML_PROCESSOR_TLS_KEY = "TRACEML_PROCESSOR_TLS_KEY"
TRACEML_PROCESSOR_IDLE_TIMEOUT = "TRACEML_PROCESSOR_IDLE_TIMEOUT"
"""Seconds without data after which a run is ended and summarised."""
TRACEML_PROCESSOR_REFRESH_INTERVAL = "TRACEML_PROCESSOR_REFRESH_INTERVAL"
"""Seconds between live analysis refreshes of each active run."""
TRACEML_PROCESSOR_EXPORT_INTERVAL = "TRACEML_PROCESSOR_EXPORT_INTERVAL"
"""Seconds between OTLP pushes of the summary metrics."""
TRACEML_PROCESSOR_MAX_RUNS = "TRACEML_PROCESSOR_MAX_RUNS"
"""Runs the processor tracks at once; data of further runs is rejected."""
TRACEML_PROCESSOR_MAX_RANKS_PER_RUN = "TRACEML_PROCESSOR_MAX_RANKS_PER_RUN"
"""Ranks accepted per run; further ranks are rejected."""
TRACEML_PROCESSOR_WORKERS = "TRACEML_PROCESSOR_WORKERS"
"""Ingest processes sharing the receiver ports."""
TRACEML_PROCESSOR_MAPPING_FILE = "TRACEML_PROCESSOR_MAPPING_FILE"
"""A declared foreign-step mapping (TOML): a team's own span names made diagnosable."""
TRACEML_PROCESSOR_RANK_SERIES_TOP_K = "TRACEML_PROCESSOR_RANK_SERIES_TOP_K"
"""Ranks per run with per-rank series by deviation score, beyond the culprits, victims, worst and
representative rank, which always have them."""
TRACEML_PROCESSOR_REPEAT_OFFENDER_RUNS = "TRACEML_PROCESSOR_REPEAT_OFFENDER_RUNS"
"""K: a host (or GPU) named the culprit in at least K of its last N runs gets REPEAT_OFFENDER_HOST."""
TRACEML_PROCESSOR_REPEAT_OFFENDER_WINDOW = "TRACEML_PROCESSOR_REPEAT_OFFENDER_WINDOW"
"""N: how many of a host's latest runs the repeat-offender rule looks at."""
TRACEML_PROCESSOR_FLEET_PERIOD = "TRACEML_PROCESSOR_FLEET_PERIOD"
"""Seconds of culprit history the fleet series (/metrics, the push) and the web view's fleet page cover."""
TRACEML_PROCESSOR_MAX_SERIES = "TRACEML_PROCESSOR_MAX_SERIES"
"""Series one /metrics scrape or summary push carries at most; whole runs beyond it are left out and
counted."""
TRACEML_PROCESSOR_MAX_CONCURRENT_REQUESTS = "TRACEML_PROCESSOR_MAX_CONCURRENT_REQUESTS"
"""Export requests each receiver handles at once; beyond it gRPC UNAVAILABLE with RetryInfo, HTTP 429
with Retry-After."""
TRACEML_PROCESSOR_HTTP_HEADER_TIMEOUT = "TRACEML_PROCESSOR_HTTP_HEADER_TIMEOUT"
"""Seconds an OTLP/HTTP request head may take, from connect (TLS handshake included) or its first byte
on a kept-alive connection; then 408 and closed."""
TRACEML_PROCESSOR_HTTP_BODY_TIMEOUT = "TRACEML_PROCESSOR_HTTP_BODY_TIMEOUT"
"""Seconds an OTLP/HTTP request body may take after its head, and an answer may wait to be read;
then 408 and closed."""
TRACEML_PROCESSOR_HTTP_BODY_CHUNK_TIMEOUT = "TRACEML_PROCESSOR_HTTP_BODY_CHUNK_TIMEOUT"
"""Seconds between two pieces of a request body on any HTTP port; then 408 and closed."""
TRACEML_PROCESSOR_HTTP_KEEPALIVE_TIMEOUT = "TRACEML_PROCESSOR_HTTP_KEEPALIVE_TIMEOUT"
"""Seconds a kept-alive OTLP/HTTP connection may wait for its next request."""
TRACEML_PROCESSOR_HTTP_MAX_CONNECTIONS = "TRACEML_PROCESSOR_HTTP_MAX_CONNECTIONS"
"""OTLP/HTTP connections open at once per process, lowered to leave a quarter of RLIMIT_NOFILE free;
at the cap the longest-idle one is closed, or the newcomer answered 503 + Retry-After."""
TRACEML_PROCESSOR_CAPTURE = "TRACEML_PROCESSOR_CAPTURE"
"""Deep profiler captures (issue 33): auto (a confirmed culprit finding asks), manual (only a person
asks) or off."""
TRACEML_PROCESSOR_CAPTURE_STEPS = "TRACEML_PROCESSOR_CAPTURE_STEPS"
"""Steps one capture records on each of its two ranks."""
TRACEML_PROCESSOR_CAPTURE_COOLDOWN = "TRACEML_PROCESSOR_CAPTURE_COOLDOWN"
"""Seconds after an automatic capture of a run before the diagnosis may ask for another."""
TRACEML_PROCESSOR_CAPTURE_MAX_TRACE_BYTES = "TRACEML_PROCESSOR_CAPTURE_MAX_TRACE_BYTES"
"""The largest gzip'd raw trace a rank may upload per capture; a larger one is not kept."""
TRACEML_PROCESSOR_CAPTURE_DEADLINE = "TRACEML_PROCESSOR_CAPTURE_DEADLINE"
"""Seconds a capture waits for its ranks (from its request, again from its delivery) before it fails."""

TRUE_VALUES = frozenset({"1", "true", "yes", "on"})
FALSE_VALUES = frozenset({"0", "false", "no", "off"})
"""What turns off a TraceML switch that is on by default (`TRACEML_RESOURCES`)."""


def env_flag(value: str | None, default: bool = False) -> bool:
    """TraceML's own switches (`TRACEML_*`): 1/true/yes/on (any case) is true, blank gives `default`.

    Deliberately looser than the OpenTelemetry boolean rule, which standard variables
    follow (`env_values.otel_boolean`: only `true` is true): these are TraceML's own
    variables, documented with this rule since the first release.
    """
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() in TRUE_VALUES
