"""Every environment variable TraceML reads, declared and documented once.

Both sides import the names from here; each reads its own at start-up. Standard
OpenTelemetry variables (`OTEL_*`) keep their standard meaning; TraceML's own
start with `TRACEML_`. `docs/configuration.md` lists them for people.
"""
from __future__ import annotations

# --- Standard OpenTelemetry variables honoured ---------------------------------
OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
OTEL_RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"
OTEL_EXPORTER_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTEL_EXPORTER_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
OTEL_EXPORTER_OTLP_HEADERS = "OTEL_EXPORTER_OTLP_HEADERS"
OTEL_EXPORTER_OTLP_TIMEOUT = "OTEL_EXPORTER_OTLP_TIMEOUT"
OTEL_EXPORTER_OTLP_COMPRESSION = "OTEL_EXPORTER_OTLP_COMPRESSION"
OTEL_EXPORTER_OTLP_INSECURE = "OTEL_EXPORTER_OTLP_INSECURE"
OTEL_EXPORTER_OTLP_CERTIFICATE = "OTEL_EXPORTER_OTLP_CERTIFICATE"

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
"""torchrun sets it to True: a TCPStore at MASTER_ADDR:MASTER_PORT already serves every rank."""
SLURM_PROCID = "SLURM_PROCID"
SLURM_LOCALID = "SLURM_LOCALID"
SLURM_NODEID = "SLURM_NODEID"
SLURM_NTASKS = "SLURM_NTASKS"
SLURM_NTASKS_PER_NODE = "SLURM_NTASKS_PER_NODE"
SLURM_NNODES = "SLURM_NNODES"

# --- TraceML training side ----------------------------------------------------
TRACEML_DISABLE = "TRACEML_DISABLE"
"""Kill switch: any of 1/true/yes/on makes every TraceML call a no-op."""
TRACEML_RUN_ID = "TRACEML_RUN_ID"
"""Explicit run id; wins over TORCHELASTIC_RUN_ID and SLURM_JOB_ID."""
TRACEML_MODE = "TRACEML_MODE"
"""`auto` (patch DataLoader, forward, backward, H2D, optimizer) or `manual`."""
TRACEML_TRAINING_STRATEGY = "TRACEML_TRAINING_STRATEGY"
"""`ddp` (default with world size > 1), `fsdp` or `single`."""
TRACEML_PHASE_SPANS = "TRACEML_PHASE_SPANS"
"""Emit per-phase child spans for trace viewers (default on)."""
TRACEML_EXPORT_QUEUE_SIZE = "TRACEML_EXPORT_QUEUE_SIZE"
"""Finished steps (and, separately, memory snapshots) the exporter buffers; beyond it new ones are dropped and counted (default 8192)."""
TRACEML_LAUNCHED = "TRACEML_LAUNCHED"
"""Set by `traceml run` in each rank: enable instrumentation without code changes."""
TRACEML_EXIT_AFTER_FLUSH = "TRACEML_EXIT_AFTER_FLUSH"
"""Opt-in for `traceml run`: once the script has returned and telemetry is flushed, run the
atexit handlers, flush stdio and leave with os._exit, skipping interpreter teardown (where
torch 2.13 DDP on gloo can abort under CPU load). Unclosed files are not finalised: opt in
only for scripts that close what they open."""

# --- TraceML processor ----------------------------------------------------------
TRACEML_PROCESSOR_DB = "TRACEML_PROCESSOR_DB"
TRACEML_PROCESSOR_OTLP_GRPC = "TRACEML_PROCESSOR_OTLP_GRPC"
TRACEML_PROCESSOR_OTLP_HTTP = "TRACEML_PROCESSOR_OTLP_HTTP"
TRACEML_PROCESSOR_PROMETHEUS = "TRACEML_PROCESSOR_PROMETHEUS"
TRACEML_PROCESSOR_EXPORT_ENDPOINT = "TRACEML_PROCESSOR_EXPORT_ENDPOINT"
TRACEML_PROCESSOR_SUMMARY_DIR = "TRACEML_PROCESSOR_SUMMARY_DIR"
TRACEML_PROCESSOR_AUTH_TOKEN = "TRACEML_PROCESSOR_AUTH_TOKEN"
TRACEML_PROCESSOR_TLS_CERT = "TRACEML_PROCESSOR_TLS_CERT"
TRACEML_PROCESSOR_TLS_KEY = "TRACEML_PROCESSOR_TLS_KEY"
TRACEML_PROCESSOR_IDLE_TIMEOUT = "TRACEML_PROCESSOR_IDLE_TIMEOUT"
"""Seconds without data after which a run is ended and summarised (default 300)."""
TRACEML_PROCESSOR_REFRESH_INTERVAL = "TRACEML_PROCESSOR_REFRESH_INTERVAL"
"""Seconds between live analysis refreshes of each active run (default 0.5)."""
TRACEML_PROCESSOR_EXPORT_INTERVAL = "TRACEML_PROCESSOR_EXPORT_INTERVAL"
"""Seconds between OTLP pushes of the summary metrics (default 5)."""
TRACEML_PROCESSOR_MAX_RUNS = "TRACEML_PROCESSOR_MAX_RUNS"
"""Runs the processor tracks at once; data of further runs is rejected (default 1000)."""
TRACEML_PROCESSOR_MAX_RANKS_PER_RUN = "TRACEML_PROCESSOR_MAX_RANKS_PER_RUN"
"""Ranks accepted per run; further ranks are rejected (default 16384)."""
TRACEML_PROCESSOR_WORKERS = "TRACEML_PROCESSOR_WORKERS"
"""Ingest processes sharing the receiver ports (default 1)."""
OTEL_EXPORTER_OTLP_METRICS_ENDPOINT = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
OTEL_EXPORTER_OTLP_METRICS_PROTOCOL = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"

TRUE_VALUES = frozenset({"1", "true", "yes", "on"})


def env_flag(value: str | None, default: bool = False) -> bool:
    """Parse a boolean environment value the way the OTel SDK does (case-insensitive)."""
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() in TRUE_VALUES
