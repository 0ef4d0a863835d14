"""What the resource analysis hands to diagnosis and every surface (standard library only).

`ResourceWindow` summarises a run's resource samples over the same window the step
analysis chose (its first to last aligned step, on the wall clock): per rank, per
node (host), the median and worst rank or node of each figure, and a memory trend
per rank. Every figure is None when nothing measured it (no psutil, no GPU, no
NVML, no sample in the window); a measured zero stays 0.0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

# Per-rank figures (window statistics of the rank's own samples).
CPU_UTILIZATION = "cpu_utilization"  # mean process CPU / CPUs available to it, 0..1
RSS_BYTES = "rss_bytes"  # highest process RSS in the window
GPU_UTILIZATION = "gpu_utilization"  # mean NVML utilization of the rank's GPU, 0..1
GPU_MEMORY_USED_BYTES = "gpu_memory_used_bytes"  # highest device memory in use
GPU_MEMORY_TOTAL_BYTES = "gpu_memory_total_bytes"
GPU_TEMPERATURE_C = "gpu_temperature_c"  # highest
GPU_POWER_W = "gpu_power_w"  # mean
CUDA_ALLOCATED_BYTES = "cuda_allocated_bytes"  # highest allocator figure sampled
CUDA_RESERVED_BYTES = "cuda_reserved_bytes"
RANK_FIGURES: tuple[str, ...] = (
    CPU_UTILIZATION, RSS_BYTES, GPU_UTILIZATION, GPU_MEMORY_USED_BYTES, GPU_MEMORY_TOTAL_BYTES,
    GPU_TEMPERATURE_C, GPU_POWER_W, CUDA_ALLOCATED_BYTES, CUDA_RESERVED_BYTES,
)

# Per-node figures (the host's samples, from its local rank 0 or a foreign sender).
HOST_CPU_UTILIZATION = "cpu_utilization"  # mean busy fraction of the host's CPUs, 0..1
HOST_CPU_COUNT = "cpu_count"
HOST_MEMORY_USED_BYTES = "memory_used_bytes"  # highest
HOST_MEMORY_TOTAL_BYTES = "memory_total_bytes"
HOST_MEMORY_UTILIZATION = "memory_utilization"  # highest used / total, 0..1
NODE_FIGURES: tuple[str, ...] = (
    HOST_CPU_UTILIZATION, HOST_CPU_COUNT, HOST_MEMORY_USED_BYTES, HOST_MEMORY_TOTAL_BYTES,
    HOST_MEMORY_UTILIZATION,
)

FIGURE_UNITS: Mapping[str, str] = {
    CPU_UTILIZATION: "1", RSS_BYTES: "By", GPU_UTILIZATION: "1", GPU_MEMORY_USED_BYTES: "By",
    GPU_MEMORY_TOTAL_BYTES: "By", GPU_TEMPERATURE_C: "Cel", GPU_POWER_W: "W", CUDA_ALLOCATED_BYTES: "By",
    CUDA_RESERVED_BYTES: "By", HOST_CPU_COUNT: "{cpu}", HOST_MEMORY_USED_BYTES: "By",
    HOST_MEMORY_TOTAL_BYTES: "By", HOST_MEMORY_UTILIZATION: "1",
}
LOWER_IS_WORSE: frozenset[str] = frozenset({GPU_UTILIZATION})
"""Figures whose worst member is the lowest (an idle GPU); for every other the highest."""

TREND_PEAK_ALLOCATED = "peak_allocated"  # per-step peak allocated memory (CUDA), from the step spans
TREND_RSS = "rss"  # process RSS samples mapped onto steps
TREND_SIGNALS: tuple[str, ...] = (TREND_PEAK_ALLOCATED, TREND_RSS)


@dataclass(frozen=True, slots=True)
class FigureStat:
    """One figure over the ranks (or nodes) that measured it: the median member and the worst.

    `median_member` is the real member nearest the median (then lower value, then lower key),
    as the step metrics' representative rank; `worst` is the highest value (lowest for
    `LOWER_IS_WORSE`)."""

    figure: str
    unit: str
    values: Mapping[object, float]  # rank (int) or host (str) -> its window figure
    median: float | None
    median_member: object | None
    worst: float | None
    worst_member: object | None


@dataclass(frozen=True, slots=True)
class RankResources:
    """One rank's resource figures over the window (`RANK_FIGURES` keys; None: not measured)."""

    rank: int
    host: str | None
    device: str | None  # the GPU's hw.id (NVML UUID) when known, else its `cuda:N`, else None
    figures: Mapping[str, float | None]
    samples: int  # resource samples of this rank in the window (its own and joined foreign ones)


@dataclass(frozen=True, slots=True)
class NodeResources:
    """One host's figures over the window (`NODE_FIGURES` keys; None: not measured)."""

    host: str
    ranks: tuple[int, ...]
    figures: Mapping[str, float | None]
    samples: int
    sources: tuple[str, ...]  # `schema.resources.SOURCES` that sent this host's samples


@dataclass(frozen=True, slots=True)
class MemoryTrend:
    """A rank's memory over the window's steps, fitted flat-then-rising (a hinge at `onset_step`).

    `slope_bytes_per_step` is the rise after the onset; `growth_bytes` the fitted rise from
    the onset to the window's last step, `growth_ratio` that over the level at the onset.
    `fit_r2`: how much of the series' variance the hinge explains."""

    rank: int
    signal: str  # TREND_SIGNALS
    first_step: int
    last_step: int
    points: int
    onset_step: int
    level_bytes: float  # the fitted level before the onset
    slope_bytes_per_step: float
    growth_bytes: float
    growth_ratio: float | None
    fit_r2: float | None
    rising_fraction: float  # share of consecutive (smoothed) differences after the onset that rise
    late_slope_bytes_per_step: float | None = None  # least-squares slope over the last half after the onset


@dataclass(frozen=True)
class ResourceWindow:
    """Resource facts of one run over its analysis window; `empty()` when none were stored."""

    run_id: str
    start_time: float | None  # unix seconds: the window's first step start
    end_time: float | None  # its last step end
    ranks: Mapping[int, RankResources] = field(default_factory=dict)
    nodes: Mapping[str, NodeResources] = field(default_factory=dict)
    rank_stats: Mapping[str, FigureStat] = field(default_factory=dict)  # RANK_FIGURES measured by any rank
    node_stats: Mapping[str, FigureStat] = field(default_factory=dict)  # NODE_FIGURES measured on any host
    memory_trends: Mapping[int, MemoryTrend] = field(default_factory=dict)  # fitted ranks (the likeliest to creep)
    memory_growth_estimates: Mapping[int, float] = field(default_factory=dict)
    """Every rank with a memory series: its last third's median over its first third's, minus 1
    (a cheap estimate: the fit runs only for the ranks that grew most)."""
    sources: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.ranks and not self.nodes and not self.memory_trends

    def rank_figure(self, figure: str) -> FigureStat | None:
        return self.rank_stats.get(figure)

    def node_figure(self, figure: str) -> FigureStat | None:
        return self.node_stats.get(figure)

    @classmethod
    def empty(cls, run_id: str) -> "ResourceWindow":
        return cls(run_id=run_id, start_time=None, end_time=None)
