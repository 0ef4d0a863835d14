"""Resource samples of a window -> `ResourceWindow`: figures per rank and node, and memory trends.

The window is the step analysis's own (its first to last aligned step), so the
resource figures describe the same steps the phases do. Per rank: mean process CPU,
GPU utilisation and power; the highest RSS, device memory, temperature and
allocator figures. Per host: mean busy CPU (from `system.cpu.utilization`, else
from consecutive `system.cpu.time` totals), the highest memory in use. Median and
worst members as the step metrics have them.

A memory trend is fitted per rank on the per-step peak allocated memory when the
rank measured it (CUDA), else on its RSS samples placed on steps through the
window's step end times: a hinge, flat up to an onset step and rising linearly
after it, chosen by least squares over every onset. The fit only describes; the
diagnosis (`diagnosis.resource_rules`) judges whether it is creep.
"""
from __future__ import annotations

import math
import statistics
from typing import Mapping, Sequence

import numpy as np

from traceml.processor.resources.model import (
    CPU_UTILIZATION,
    CUDA_ALLOCATED_BYTES,
    CUDA_RESERVED_BYTES,
    FIGURE_UNITS,
    GPU_MEMORY_TOTAL_BYTES,
    GPU_MEMORY_USED_BYTES,
    GPU_POWER_W,
    GPU_TEMPERATURE_C,
    GPU_UTILIZATION,
    HOST_CPU_COUNT,
    HOST_CPU_UTILIZATION,
    HOST_MEMORY_TOTAL_BYTES,
    HOST_MEMORY_USED_BYTES,
    HOST_MEMORY_UTILIZATION,
    LOWER_IS_WORSE,
    NODE_FIGURES,
    RANK_FIGURES,
    RSS_BYTES,
    TREND_PEAK_ALLOCATED,
    TREND_RSS,
    FigureStat,
    MemoryTrend,
    NodeResources,
    RankResources,
    ResourceWindow,
)
from traceml.processor.resources.reader import Aggregate, ResourceSamples
from traceml.schema import resources as r

# (figure, stored metric, statistic over the window)
_RANK_SOURCES: tuple[tuple[str, str, str], ...] = (
    (CPU_UTILIZATION, r.PROCESS_CPU_UTILIZATION, "mean"),
    (RSS_BYTES, r.PROCESS_MEMORY_USAGE, "max"),
    (GPU_UTILIZATION, r.GPU_UTILIZATION, "mean"),
    (GPU_MEMORY_USED_BYTES, r.GPU_MEMORY_USAGE, "max"),
    (GPU_MEMORY_TOTAL_BYTES, r.GPU_MEMORY_LIMIT, "max"),
    (GPU_TEMPERATURE_C, r.HW_TEMPERATURE, "max"),
    (GPU_POWER_W, r.HW_POWER, "mean"),
    (CUDA_ALLOCATED_BYTES, r.CUDA_MEMORY_ALLOCATED, "max"),
    (CUDA_RESERVED_BYTES, r.CUDA_MEMORY_RESERVED, "max"),
)
_NODE_SOURCES: tuple[tuple[str, str, str], ...] = (
    (HOST_CPU_UTILIZATION, r.SYSTEM_CPU_UTILIZATION, "mean"),
    (HOST_CPU_COUNT, r.SYSTEM_CPU_LOGICAL_COUNT, "max"),
    (HOST_MEMORY_USED_BYTES, r.SYSTEM_MEMORY_USAGE, "max"),
    (HOST_MEMORY_TOTAL_BYTES, r.SYSTEM_MEMORY_LIMIT, "max"),
)

MIN_TREND_POINTS = 6
"""Fewer points than this give no trend: a hinge has three parameters."""
MAX_TREND_POINTS = 512
"""Longer series are reduced to this many block medians before the fit (the fit is quadratic)."""


def resource_window(samples: ResourceSamples, steps: Sequence[int],
                    step_end_times: Sequence[float]) -> ResourceWindow:
    """The window's figures and trends (`ResourceWindow.empty` shape when nothing was stored)."""
    ranks: dict[int, RankResources] = {}
    for rank in sorted(set(samples.rank_figures) | set(samples.peak_allocated) | set(samples.rss)):
        aggregates = samples.rank_figures.get(rank, {})
        placement = samples.placements.get(rank)
        ranks[rank] = RankResources(
            rank=rank, host=placement.host if placement else None, device=samples.rank_devices.get(rank),
            figures={figure: _stat(aggregates.get(metric), how) for figure, metric, how in _RANK_SOURCES},
            samples=sum(a.count for a in aggregates.values()))
    nodes: dict[str, NodeResources] = {}
    by_host: dict[str, list[int]] = {}
    for placement in samples.placements.values():
        if placement.host:
            by_host.setdefault(placement.host, []).append(placement.rank)
    for host in sorted(set(samples.host_figures) | set(samples.host_series)):
        aggregates = samples.host_figures.get(host, {})
        figures = {figure: _stat(aggregates.get(metric), how) for figure, metric, how in _NODE_SOURCES}
        if figures[HOST_CPU_UTILIZATION] is None:
            series = samples.host_series.get(host, {})
            figures[HOST_CPU_UTILIZATION] = _busy_from_times(series.get(r.SYSTEM_CPU_TIME_BUSY),
                                                             series.get(r.SYSTEM_CPU_TIME_TOTAL))
        used, total = figures[HOST_MEMORY_USED_BYTES], figures[HOST_MEMORY_TOTAL_BYTES]
        figures[HOST_MEMORY_UTILIZATION] = used / total if used is not None and total else None
        nodes[host] = NodeResources(host=host, ranks=tuple(sorted(by_host.get(host, ()))),
                                    figures={f: figures.get(f) for f in NODE_FIGURES},
                                    samples=sum(a.count for a in aggregates.values()),
                                    sources=samples.host_sources.get(host, ()))
    trends, estimates = _trends(samples, steps, step_end_times)
    return ResourceWindow(
        run_id=samples.run_id, start_time=samples.start_time, end_time=samples.end_time,
        ranks=ranks, nodes=nodes,
        rank_stats=_figure_stats({rank: rr.figures for rank, rr in ranks.items()}, RANK_FIGURES),
        node_stats=_figure_stats({host: nr.figures for host, nr in nodes.items()}, NODE_FIGURES),
        memory_trends=trends, memory_growth_estimates=estimates,
        sources=tuple(sorted({s for srcs in samples.host_sources.values() for s in srcs})))


def _stat(aggregate: Aggregate | None, how: str) -> float | None:
    if aggregate is None or not aggregate.count:
        return None
    return aggregate.max if how == "max" else aggregate.mean


def _busy_from_times(busy, total) -> float | None:
    """Busy CPU fraction from cumulative busy and total CPU seconds (hostmetrics' `system.cpu.time`):
    the sum of busy deltas over the sum of total deltas of consecutive samples (a counter reset,
    a negative delta, is skipped)."""
    if busy is None or total is None:
        return None
    by_time = dict(zip(*busy))
    pairs = [(by_time[t], v) for t, v in zip(*total) if t in by_time]
    d_busy = d_total = 0.0
    for (b0, t0), (b1, t1) in zip(pairs, pairs[1:]):
        if t1 > t0 and b1 >= b0:
            d_busy += b1 - b0
            d_total += t1 - t0
    return min(1.0, d_busy / d_total) if d_total > 0 else None


def _figure_stats(members: Mapping[object, Mapping[str, float | None]], figures: Sequence[str]
                  ) -> dict[str, FigureStat]:
    stats: dict[str, FigureStat] = {}
    for figure in figures:
        values = {key: value for key, f in members.items() if (value := f.get(figure)) is not None}
        if not values:
            continue
        median = float(statistics.median(values.values()))
        median_member = min(values, key=lambda k: (abs(values[k] - median), values[k], _key(k)))
        if figure in LOWER_IS_WORSE:
            worst_member = min(values, key=lambda k: (values[k], _key(k)))
        else:
            worst_member = min(values, key=lambda k: (-values[k], _key(k)))
        stats[figure] = FigureStat(figure, FIGURE_UNITS[figure], values, median, median_member,
                                   values[worst_member], worst_member)
    return stats


def _key(member) -> tuple:
    return (0, member, "") if isinstance(member, int) else (1, 0, str(member))


# --- Memory trends -------------------------------------------------------------------------


TREND_CANDIDATES = 8
"""Ranks fitted per window: the ones whose memory grew most by a cheap estimate (the fit is the
costly part; a job of 1,024 ranks fits 8, not 1,024)."""


def _trends(samples: ResourceSamples, steps: Sequence[int], end_times: Sequence[float]
            ) -> tuple[dict[int, MemoryTrend], dict[int, float]]:
    """Trends of the candidate ranks, and every rank's estimated growth (last third's median over
    the first third's, minus 1), from per-step peaks where measured, else RSS placed on steps."""
    placer = _StepPlacer(steps, end_times)
    series: dict[int, tuple[str, np.ndarray, np.ndarray]] = {}
    for rank in sorted(set(samples.peak_allocated) | set(samples.rss)):
        peaks = samples.peak_allocated.get(rank)
        if peaks is not None and len(peaks[0]) >= MIN_TREND_POINTS:
            series[rank] = (TREND_PEAK_ALLOCATED, np.asarray(peaks[0]), np.asarray(peaks[1]))
            continue
        rss = samples.rss.get(rank)
        if rss is not None:
            x, y = placer.place(np.asarray(rss[0]), np.asarray(rss[1]))
            if x.size >= MIN_TREND_POINTS:
                series[rank] = (TREND_RSS, x, y)
    estimates = {rank: growth for rank, (_, _, y) in series.items() if (growth := _growth_estimate(y)) is not None}
    candidates = sorted(estimates, key=lambda rank: (-estimates[rank], rank))[:TREND_CANDIDATES]
    trends = {}
    for rank in sorted(candidates):
        signal, x, y = series[rank]
        trend = fit_trend(rank, signal, x, y)
        if trend is not None:
            trends[rank] = trend
    return trends, estimates


def _growth_estimate(y: np.ndarray) -> float | None:
    third = y.size // 3
    if third < 1:
        return None
    values = y.tolist()
    before = statistics.median(values[:third])
    return statistics.median(values[-third:]) / before - 1.0 if before > 0 else None


class _StepPlacer:
    """Wall-clock times -> (fractional) step numbers, through the window's step end times."""

    def __init__(self, steps: Sequence[int], end_times: Sequence[float]):
        ends = np.asarray(end_times, dtype=np.float64)
        known = ~np.isnan(ends) if ends.size else np.zeros(0, dtype=bool)
        self._steps = np.asarray(steps, dtype=np.float64)[known] if ends.size == len(steps) else np.zeros(0)
        self._ends = ends[known] if ends.size == len(steps) else np.zeros(0)
        order = np.argsort(self._ends, kind="stable")
        self._ends, self._steps = self._ends[order], self._steps[order]

    def place(self, times: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Samples inside the window's first to last step end, on the step axis."""
        if self._ends.size < 2:
            return np.zeros(0), np.zeros(0)
        inside = (times >= self._ends[0]) & (times <= self._ends[-1])
        return np.interp(times[inside], self._ends, self._steps), values[inside]


def fit_trend(rank: int, signal: str, x: np.ndarray, y: np.ndarray) -> MemoryTrend | None:
    """The least-squares hinge y = a + b * max(0, x - x_k) over every onset k (see the module
    docstring); None when the series is too short or flat on the step axis."""
    finite = np.isfinite(x) & np.isfinite(y)
    x, y = x[finite].astype(np.float64), y[finite].astype(np.float64)
    if x.size < MIN_TREND_POINTS or float(x.max() - x.min()) <= 0:
        return None
    order = np.argsort(x, kind="stable")
    x, y = _reduce(x[order], y[order])
    n = x.size
    # Onsets: every point but the last two (a rise needs three points after the onset to be a line).
    onsets = x[: n - 2]
    z = np.maximum(0.0, x[None, :] - onsets[:, None])  # (K, n)
    z_mean = z.mean(axis=1)
    zc = z - z_mean[:, None]
    yc = y - y.mean()
    var = (zc * zc).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        b = np.where(var > 0, (zc * yc[None, :]).sum(axis=1) / var, 0.0)
    a = y.mean() - b * z_mean
    sse = ((y[None, :] - (a[:, None] + b[:, None] * z)) ** 2).sum(axis=1)
    k = int(np.argmin(sse))
    sst = float((yc * yc).sum())
    level, slope, onset = float(a[k]), float(b[k]), float(onsets[k])
    growth = slope * float(x[-1] - onset)
    after = x >= onset
    smoothed = _rolling_median(y[after], 3)
    diffs = np.diff(smoothed)
    rising = float((diffs > 0).mean()) if diffs.size else 0.0
    late = _late_slope(x[after], y[after])
    return MemoryTrend(
        rank=rank, signal=signal, first_step=int(math.floor(x[0])), last_step=int(math.ceil(x[-1])),
        points=int(n), onset_step=int(round(onset)), level_bytes=level, slope_bytes_per_step=slope,
        growth_bytes=growth, growth_ratio=(growth / level) if level > 0 else None,
        fit_r2=(1.0 - float(sse[k]) / sst) if sst > 0 else None, rising_fraction=rising,
        late_slope_bytes_per_step=late)


def _reduce(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if x.size <= MAX_TREND_POINTS:
        return x, y
    blocks = np.array_split(np.arange(x.size), MAX_TREND_POINTS)
    return (np.array([float(np.median(x[b])) for b in blocks]),
            np.array([float(np.median(y[b])) for b in blocks]))


def _rolling_median(y: np.ndarray, width: int) -> np.ndarray:
    if y.size < width:
        return y
    windows = np.lib.stride_tricks.sliding_window_view(y, width)
    return np.sort(windows, axis=1)[:, width // 2]


def _late_slope(x: np.ndarray, y: np.ndarray) -> float | None:
    half = x.size // 2
    xs, ys = x[half:], y[half:]
    if xs.size < 3 or float(xs.max() - xs.min()) <= 0:
        return None
    xc = xs - xs.mean()
    return float((xc * (ys - ys.mean())).sum() / (xc * xc).sum())
