"""Public diagnosis vocabulary: issue kinds, severities, statuses and components.

These strings are public values: they appear in `final_summary.json`, in the live
view, and as attribute values of the re-exported `traceml.diagnosis.active`
metric (so alert rules match on them). Standard library only.
`docs/DIAGNOSIS.md` explains each one.
"""
from __future__ import annotations

from typing import Literal

# --- Kinds ----------------------------------------------------------------------
INPUT_BOUND = "INPUT_BOUND"
H2D_BOUND = "H2D_BOUND"
RESIDUAL_HEAVY = "RESIDUAL_HEAVY"
COMPUTE_BOUND = "COMPUTE_BOUND"
COLLECTIVE_BOUND = "COLLECTIVE_BOUND"
"""Every rank spends a large share of its step waiting in collectives, more than any straggler explains."""
STEP_TIME_DRIFT = "STEP_TIME_DRIFT"
"""A rank, or the whole job, became slower than its own earlier steps of the same window."""
MEMORY_CREEP = "MEMORY_CREEP"
"""A rank's memory (per-step peak allocated, else process RSS) rises steadily over the window."""
LOW_GPU_UTILIZATION = "LOW_GPU_UTILIZATION"
"""The GPUs idle for much of the window while no input or H2D finding explains it."""
INPUT_STRAGGLER = "INPUT_STRAGGLER"
H2D_STRAGGLER = "H2D_STRAGGLER"
COMPUTE_STRAGGLER = "COMPUTE_STRAGGLER"
STRAGGLER = "STRAGGLER"
REPEAT_OFFENDER_HOST = "REPEAT_OFFENDER_HOST"
"""The run's confirmed straggler ran on a host (or GPU) that was the culprit in at least K of the
host's last N runs this processor summarised: a node to drain or check, not code to debug."""
WARMUP = "WARMUP"
NO_STEPS = "NO_STEPS"
INCOMPLETE_DATA = "INCOMPLETE_DATA"
BALANCED = "BALANCED"

STRAGGLER_KINDS: tuple[str, ...] = (INPUT_STRAGGLER, H2D_STRAGGLER, COMPUTE_STRAGGLER, STRAGGLER)
SHARE_KINDS: tuple[str, ...] = (INPUT_BOUND, H2D_BOUND, RESIDUAL_HEAVY)
DIAGNOSIS_KINDS: tuple[str, ...] = (
    *STRAGGLER_KINDS, *SHARE_KINDS, COMPUTE_BOUND, COLLECTIVE_BOUND, STEP_TIME_DRIFT, MEMORY_CREEP,
    LOW_GPU_UTILIZATION, REPEAT_OFFENDER_HOST, INCOMPLETE_DATA,
    NO_STEPS, WARMUP, BALANCED,
)

# --- Severities (ascending) -----------------------------------------------------------
Severity = Literal["info", "warn", "crit"]
SEVERITY_INFO: Severity = "info"
SEVERITY_WARN: Severity = "warn"
SEVERITY_CRIT: Severity = "crit"
SEVERITIES: tuple[Severity, ...] = (SEVERITY_INFO, SEVERITY_WARN, SEVERITY_CRIT)

# --- Statuses: how far an issue can be trusted ------------------------------------------
STATUS_CONFIRMED = "confirmed"
"""A finding over a window long enough for critical severity (>= 20 aligned steps)."""
STATUS_PROVISIONAL = "provisional"
"""A finding over a short window (2..19 aligned steps): it can never be critical."""
STATUS_WARMUP = "warmup"
"""Fewer than 2 aligned steps: no rule was evaluated."""
STATUS_INCOMPLETE = "incomplete"
"""A required signal is measured by no rank: the rules that need it could not run."""
STATUS_BALANCED = "balanced"
"""Rules ran and none fired."""
STATUS_EMPTY = "empty"
"""The run ended with no step stored for any rank: nothing could be analysed (NO_STEPS)."""
DIAGNOSIS_STATUSES: tuple[str, ...] = (
    STATUS_CONFIRMED, STATUS_PROVISIONAL, STATUS_WARMUP, STATUS_INCOMPLETE, STATUS_BALANCED, STATUS_EMPTY,
)

# --- Why a run has no steps (NO_STEPS evidence `reason`), in the order they are tested --
NO_STEPS_FAILED = "script_failed"
NO_STEPS_INTERRUPTED = "interrupted"
NO_STEPS_TELEMETRY_LOST = "telemetry_lost"
NO_STEPS_NONE_MARKED = "no_step_marked"
NO_STEPS_NOTHING_RECEIVED = "nothing_received"
NO_STEPS_REASONS: tuple[str, ...] = (
    NO_STEPS_FAILED, NO_STEPS_INTERRUPTED, NO_STEPS_TELEMETRY_LOST, NO_STEPS_NONE_MARKED,
    NO_STEPS_NOTHING_RECEIVED,
)

# --- Straggler components (which excess explains the gap) -----------------------------
COMPONENT_INPUT_WAIT = "input_wait"
COMPONENT_H2D = "h2d"
COMPONENT_COMPUTE = "compute"
COMPONENT_UNATTRIBUTED = "sync_or_unattributed"
STRAGGLER_COMPONENTS: tuple[str, ...] = (
    COMPONENT_INPUT_WAIT, COMPONENT_H2D, COMPONENT_COMPUTE, COMPONENT_UNATTRIBUTED,
)

# --- Severity caps recorded in evidence -------------------------------------------------
CAP_SHORT_WINDOW = "short_window"
CAP_FSDP = "fsdp"
SEVERITY_CAPS: tuple[str, ...] = (CAP_SHORT_WINDOW, CAP_FSDP)


def severity_rank(severity: str) -> int:
    """info < warn < crit, as an integer for ordering."""
    return SEVERITIES.index(severity)


# --- The host's CPUs beside an input finding (INPUT_BOUND / INPUT_STRAGGLER evidence `host_cpu.state`) --
HOST_CPU_SATURATED = "saturated"
"""The input-bound ranks' hosts had their CPUs busy with work other than the ranks' own processes
(or the ranks' CPU was not measured): more DataLoader workers will not help."""
HOST_CPU_SPARE = "spare"
"""The hosts had idle CPUs: more DataLoader workers (or a faster transform) can use them."""
HOST_CPU_RANKS_BUSY = "ranks_busy"
"""The hosts were busy, but mostly with the training ranks' own processes (whose CPU includes
their waits: gloo spins in a collective): the figures support no advice about workers."""
HOST_CPU_STATES: tuple[str, ...] = (HOST_CPU_SATURATED, HOST_CPU_SPARE, HOST_CPU_RANKS_BUSY)
