"""Diagnosis thresholds: the one place they live. Live view and final summary share them."""
from __future__ import annotations

from dataclasses import dataclass

from traceml.schema.diagnosis import SEVERITY_CRIT, SEVERITY_WARN, Severity


@dataclass(frozen=True)
class DiagnosisPolicy:
    """Every threshold, gate and cap a rule reads (see docs/DIAGNOSIS.md)."""

    warn_share: float = 0.10
    """Input, H2D and residual shares, and the straggler score, warn at or above this."""
    crit_share: float = 0.20
    """... and are critical at or above this (subject to the caps)."""
    compute_bound_share: float = 0.90
    """Compute share at or above which COMPUTE_BOUND (info) is reported."""
    straggler_attribution: float = 0.80
    """A straggler cause is named when its excess covers at least this fraction of the gap."""
    collective_warn_share: float = 0.15
    """COLLECTIVE_BOUND warns when every rank's collective wait is at least this share of its
    step (xprof's high flag for collectives, 15 %; its 3 % notice level is below every warn here)."""
    collective_crit_share: float = 0.30
    """... and is critical at or above this (twice the warn level, like the other share rules)."""
    drift_warn: float = 0.15
    """STEP_TIME_DRIFT warns when the steps after the change point are at least this much slower
    (median over median) than the steps before it."""
    drift_crit: float = 0.30
    """... and is critical at or above this (NVIDIA's straggler detection flags a rank whose
    performance score falls below 0.7 of its own best, i.e. about 30 % slower)."""
    drift_min_segment: int = 10
    """Each side of the change point needs at least this many aligned steps (with 5, the last
    few steps of a run on a busy machine, a neighbour's burst or the shutdown, read as drift)."""
    creep_warn_growth: float = 0.10
    """MEMORY_CREEP warns when a rank's memory rose by at least this fraction of its level at the
    onset (the original TraceML's early-creep gate is 4-6 % over 800 or more steps and 512 MiB;
    ours judges a live window of 100 steps, so it asks for more growth and less history)."""
    creep_crit_growth: float = 0.50
    """... and is critical when it rose by at least this fraction ..."""
    creep_warn_bytes: float = 64.0 * 2**20
    """... and by at least this many bytes (64 MiB: a rise smaller than an allocator block pool is noise)."""
    creep_crit_bytes: float = 2.0**30
    """... critical also needs at least 1 GiB (the original's confirmed-creep figure)."""
    creep_min_fit_r2: float = 0.80
    """The flat-then-rising fit must explain at least this share of the series' variance."""
    creep_min_rising: float = 0.60
    """At least this share of the (3-point median) steps after the onset must rise: one allocation
    that jumps and stays is not creep."""
    creep_min_late_slope: float = 0.50
    """The last half after the onset must still rise at least this fraction of the fitted slope:
    a warm-up that plateaus is not creep."""
    creep_min_steps: int = 10
    """The rise must span at least this many steps after the onset."""
    gpu_util_warn: float = 0.70
    """LOW_GPU_UTILIZATION warns when the median rank's GPU was busy less than this fraction of the
    window (the original TraceML's moderate band ends at 70 %)..."""
    gpu_util_crit: float = 0.30
    """... and is critical below this (its low band: the GPU mostly idle)."""
    host_cpu_saturated: float = 0.80
    """An input finding's hosts count as saturated when their CPUs were at least this busy (the
    original TraceML's high-CPU level); below it the idle CPUs are named."""
    min_steps: int = 2
    """Below this many aligned steps the diagnosis is WARMUP and no rule runs."""
    crit_min_steps: int = 20
    """Critical severity needs at least this many aligned steps; fewer caps at warn."""
    phase_floor_ms: float = 0.0
    """Optional floor: input/H2D/residual findings need a median at least this large (0 = off)."""
    tolerance: float = 1e-9
    """Comparisons at a threshold forgive this much float rounding (0.2 - 1e-12 still counts)."""

    def at_least(self, value: float, threshold: float) -> bool:
        return value >= threshold - self.tolerance

    def severity_for(self, score: float) -> Severity | None:
        """Uncapped severity of a share or straggler score; None below the warn threshold."""
        if self.at_least(score, self.crit_share):
            return SEVERITY_CRIT
        if self.at_least(score, self.warn_share):
            return SEVERITY_WARN
        return None


DEFAULT_POLICY = DiagnosisPolicy()
"""Used by both the live and the summary profile."""

__all__ = ["DiagnosisPolicy", "DEFAULT_POLICY"]
