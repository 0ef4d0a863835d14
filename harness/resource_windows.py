"""Hand-built `ResourceWindow`s for surface tests: figures per rank and host in, window out.

The statistics here are a plain-Python reference (statistics.median, max/min), not the
resource analysis: the surfaces are tested on facts stated by hand, as the rule tests
are on `tests/step_time/handbuilt_windows.py`.
"""
from __future__ import annotations

import statistics
from typing import Mapping

from traceml.processor.resources.model import (
    FIGURE_UNITS,
    LOWER_IS_WORSE,
    NODE_FIGURES,
    RANK_FIGURES,
    TREND_RSS,
    FigureStat,
    MemoryTrend,
    NodeResources,
    RankResources,
    ResourceWindow,
)

GiB = float(1 << 30)
MiB = float(1 << 20)


def _key(member) -> tuple:
    return (0, member, "") if isinstance(member, int) else (1, 0, str(member))


def figure_stats(members: Mapping[object, Mapping[str, float | None]], figures) -> dict[str, FigureStat]:
    """Median (the value and the member nearest it) and worst member of each measured figure."""
    out = {}
    for figure in figures:
        values = {k: v for k, f in members.items() if (v := f.get(figure)) is not None}
        if not values:
            continue
        median = float(statistics.median(values.values()))
        near = min(values, key=lambda k: (abs(values[k] - median), values[k], _key(k)))
        sign = 1 if figure in LOWER_IS_WORSE else -1
        worst = min(values, key=lambda k: (sign * values[k], _key(k)))
        out[figure] = FigureStat(figure, FIGURE_UNITS[figure], values, median, near, values[worst], worst)
    return out


def trend(rank: int, *, onset: int = 10, slope: float = 1 * MiB, level: float = 2 * GiB, first: int = 1,
          last: int = 40, signal: str = TREND_RSS) -> MemoryTrend:
    growth = slope * (last - onset)
    return MemoryTrend(rank=rank, signal=signal, first_step=first, last_step=last, points=last - first + 1,
                       onset_step=onset, level_bytes=level, slope_bytes_per_step=slope, growth_bytes=growth,
                       growth_ratio=growth / level, fit_r2=0.97, rising_fraction=0.9,
                       late_slope_bytes_per_step=slope)


def resource_window(run_id: str, ranks: Mapping[int, Mapping[str, float | None]],
                    nodes: Mapping[str, Mapping[str, float | None]] = {}, *,
                    hosts: Mapping[int, str] | None = None, trends: Mapping[int, MemoryTrend] = {},
                    sources: tuple[str, ...] = ("traceml",), start: float = 1_700_000_000.0,
                    end: float = 1_700_000_060.0) -> ResourceWindow:
    """A window from per-rank figures (`RANK_FIGURES` keys; absent = not measured) and per-host ones.

    Ranks are placed on `hosts[rank]` (default: every rank on the first node, else `node0`)."""
    default_host = next(iter(nodes), "node0")
    hosts = hosts or {}
    rank_facts = {
        rank: RankResources(rank=rank, host=hosts.get(rank, default_host),
                            device=f"GPU-{rank:04d}" if figures.get("gpu_utilization") is not None else None,
                            figures={f: figures.get(f) for f in RANK_FIGURES}, samples=12)
        for rank, figures in ranks.items()
    }
    node_facts = {
        host: NodeResources(host=host, ranks=tuple(sorted(r for r, f in rank_facts.items() if f.host == host)),
                            figures={f: figures.get(f) for f in NODE_FIGURES}, samples=12, sources=sources)
        for host, figures in nodes.items()
    }
    return ResourceWindow(
        run_id=run_id, start_time=start, end_time=end, ranks=rank_facts, nodes=node_facts,
        rank_stats=figure_stats({r: f.figures for r, f in rank_facts.items()}, RANK_FIGURES),
        node_stats=figure_stats({h: n.figures for h, n in node_facts.items()}, NODE_FIGURES),
        memory_trends=dict(trends), sources=sources)


def busy_gpu_run(run_id: str = "res-run", hostile_host: str | None = None) -> ResourceWindow:
    """Three ranks on two hosts: rank 2's GPU idles, rank 1's RSS creeps, host b's CPUs are busy.

    Rank 0's power is a measured 0.0 W (a measured zero) and rank 2 has no temperature
    (unmeasured); rank 1's trend rises 12 MiB per step from step 10, rank 0's is flat."""
    host_a, host_b = "node-a", hostile_host or "node-b"
    ranks = {
        0: {"cpu_utilization": 0.45, "rss_bytes": 2 * GiB, "gpu_utilization": 0.91,
            "gpu_memory_used_bytes": 30 * GiB, "gpu_memory_total_bytes": 80 * GiB, "gpu_temperature_c": 70.0,
            "gpu_power_w": 0.0, "cuda_allocated_bytes": 20 * GiB, "cuda_reserved_bytes": 24 * GiB},
        1: {"cpu_utilization": 0.98, "rss_bytes": 3.5 * GiB, "gpu_utilization": 0.62,
            "gpu_memory_used_bytes": 31 * GiB, "gpu_memory_total_bytes": 80 * GiB, "gpu_temperature_c": 81.0,
            "gpu_power_w": 250.0, "cuda_allocated_bytes": 21 * GiB, "cuda_reserved_bytes": 25 * GiB},
        2: {"cpu_utilization": 0.30, "rss_bytes": 2.5 * GiB, "gpu_utilization": 0.12,
            "gpu_memory_used_bytes": 29 * GiB, "gpu_memory_total_bytes": 80 * GiB, "gpu_temperature_c": None,
            "gpu_power_w": 120.0, "cuda_allocated_bytes": 19 * GiB, "cuda_reserved_bytes": 23 * GiB},
    }
    nodes = {
        host_a: {"cpu_utilization": 0.40, "cpu_count": 16.0, "memory_used_bytes": 40 * GiB,
                 "memory_total_bytes": 128 * GiB, "memory_utilization": 40 / 128},
        host_b: {"cpu_utilization": 0.97, "cpu_count": 16.0, "memory_used_bytes": 90 * GiB,
                 "memory_total_bytes": 128 * GiB, "memory_utilization": 90 / 128},
    }
    return resource_window(run_id, ranks, nodes, hosts={0: host_a, 1: host_b, 2: host_b},
                           trends={1: trend(1, onset=10, slope=12 * MiB), 0: trend(0, onset=5, slope=0.0)},
                           sources=("traceml", "hostmetrics"))
