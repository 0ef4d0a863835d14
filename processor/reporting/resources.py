"""The resource evidence of an analysis as every surface shows it: the public section and its text.

`project_resources` turns the analysis's `ResourceWindow` (process, host and GPU
figures over the step window, `processor.resources.model`) into the `resources`
section of `final_summary.json`; `rank_resources` is one rank's entry of its
`groups`. `resource_lines` writes the card's (and the live view's) lines from that
section, so the card, the live view, the web view and the JSON cannot disagree:
each reads the same projected numbers.

Pure and presenting only: it never reads samples, computes a statistic or decides
whether a figure is good or bad (which member is the median or the worst, and the
trends, are the analysis's; whether they matter is the diagnosis's). The shape
never changes with what was measured: every figure key is always present, null
when nothing measured it, a measured zero 0.0; a run without resource samples has
the section with nulls and empty lists.
"""
from __future__ import annotations

import datetime as _dt
import math
from typing import Mapping, Sequence

from traceml.processor.presenters.terminal_text import printable
from traceml.processor.resources.model import (
    CPU_UTILIZATION,
    FIGURE_UNITS,
    GPU_MEMORY_USED_BYTES,
    GPU_POWER_W,
    GPU_TEMPERATURE_C,
    GPU_UTILIZATION,
    HOST_CPU_UTILIZATION,
    HOST_MEMORY_UTILIZATION,
    NODE_FIGURES,
    RANK_FIGURES,
    RSS_BYTES,
    FigureStat,
    MemoryTrend,
    ResourceWindow,
)

_RATIO_DIGITS = 4
_READING_DIGITS = 3  # temperature (Cel), power (W)
_INTEGER_UNITS = frozenset({"By", "{cpu}"})

TREND_KEYS: tuple[str, ...] = (
    "rank", "signal", "first_step", "last_step", "points", "onset_step", "level_bytes",
    "slope_bytes_per_step", "late_slope_bytes_per_step", "growth_bytes", "growth_ratio", "fit_r2",
    "rising_fraction",
)
"""Public keys of one `resources.memory_trends[]` entry (MemoryTrend's fields, in this order)."""

UNITS: Mapping[str, str] = {
    "*_utilization": "ratio 0..1 (busy fraction of the sample period)",
    "*_c": "degrees Celsius",
    "*_w": "watts",
    "cpu_count": "logical CPUs",
    "slope_bytes_per_step": "bytes per aligned step",
    "late_slope_bytes_per_step": "bytes per aligned step",
    "growth_ratio": "ratio of the fitted level at the onset",
    "fit_r2": "share of the series' variance the fit explains (0..1)",
    "rising_fraction": "ratio of consecutive differences after the onset",
    "start_time": "ISO 8601, UTC",
    "end_time": "ISO 8601, UTC",
}
"""The units block's entries for the resource keys (`final_summary.UNITS` adds them)."""


def resource_window_of(analysis) -> ResourceWindow:
    """The analysis's `ResourceWindow`, or an empty one when it was made without (a bare snapshot)."""
    resources = getattr(analysis, "resources", None)
    if isinstance(resources, ResourceWindow):
        return resources
    return ResourceWindow.empty(analysis.window.run_id)


def figure_value(figure: str, value: float | None) -> float | int | None:
    """A figure for the public file: bytes and counts as integers, ratios to 4 decimals,
    temperature and power to 3; None (and anything not finite) stays null."""
    if value is None:
        return None
    f = float(value)
    if not math.isfinite(f):
        return None
    unit = FIGURE_UNITS.get(figure)
    if unit in _INTEGER_UNITS:
        return int(round(f))
    return round(f, _RATIO_DIGITS if unit == "1" else _READING_DIGITS) + 0.0


def _iso(ts: float | None) -> str | None:
    if ts is None or not math.isfinite(float(ts)):
        return None
    return _dt.datetime.fromtimestamp(float(ts), tz=_dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _member(value: object) -> object:
    return None if value is None else (int(value) if isinstance(value, int) else str(value))


def _stat(figure: str, stat: FigureStat | None, member_key: str) -> dict:
    if stat is None:
        return {"median": {"value": None, member_key: None}, "worst": {"value": None, member_key: None},
                "measured": 0}
    return {
        "median": {"value": figure_value(figure, stat.median),
                   member_key: None if stat.median is None else _member(stat.median_member)},
        "worst": {"value": figure_value(figure, stat.worst),
                  member_key: None if stat.worst is None else _member(stat.worst_member)},
        "measured": len(stat.values),
    }


def _number(value: float | None, digits: int = _RATIO_DIGITS) -> float | None:
    if value is None or not math.isfinite(float(value)):
        return None
    return round(float(value), digits) + 0.0


def _trend(trend: MemoryTrend) -> dict:
    def by(value: float | None) -> int | None:
        return None if value is None or not math.isfinite(float(value)) else int(round(float(value)))

    out = {
        "rank": int(trend.rank), "signal": trend.signal, "first_step": int(trend.first_step),
        "last_step": int(trend.last_step), "points": int(trend.points), "onset_step": int(trend.onset_step),
        "level_bytes": by(trend.level_bytes),
        "slope_bytes_per_step": _number(trend.slope_bytes_per_step, 3),
        "late_slope_bytes_per_step": _number(getattr(trend, "late_slope_bytes_per_step", None), 3),
        "growth_bytes": by(trend.growth_bytes), "growth_ratio": _number(trend.growth_ratio),
        "fit_r2": _number(trend.fit_r2), "rising_fraction": _number(trend.rising_fraction),
    }
    assert tuple(out) == TREND_KEYS
    return out


def rank_resources(window: ResourceWindow, rank: int) -> dict:
    """`groups[rank].resources`: the rank's host, device, samples and every `RANK_FIGURES` key."""
    facts = window.ranks.get(rank)
    figures = {} if facts is None else facts.figures
    return {
        "host": None if facts is None else facts.host,
        "device": None if facts is None else facts.device,
        "samples": 0 if facts is None else int(facts.samples),
        **{figure: figure_value(figure, figures.get(figure)) for figure in RANK_FIGURES},
    }


def project_resources(window: ResourceWindow) -> dict:
    """The `resources` section of `final_summary.json` (docs/SCHEMA.md)."""
    nodes = []
    for host in sorted(window.nodes):
        node = window.nodes[host]
        nodes.append({
            "host": node.host, "ranks": sorted(int(r) for r in node.ranks), "samples": int(node.samples),
            "sources": list(node.sources),
            **{figure: figure_value(figure, node.figures.get(figure)) for figure in NODE_FIGURES},
        })
    return {
        "available": bool(window.rank_stats or window.node_stats or window.memory_trends),
        "window": {"start_time": _iso(window.start_time), "end_time": _iso(window.end_time)},
        "sources": list(window.sources),
        "global": {
            "ranks": {f: _stat(f, window.rank_figure(f), "rank") for f in RANK_FIGURES},
            "nodes": {f: _stat(f, window.node_figure(f), "host") for f in NODE_FIGURES},
        },
        "nodes": nodes,
        "memory_trends": [_trend(window.memory_trends[r]) for r in sorted(window.memory_trends)],
    }


# --- Text: the card's and the live view's resource lines ------------------------------------


def fmt_figure(figure: str, value: float | int | None) -> str:
    """One figure as people read it: `45%`, `2.1 GiB`, `81 °C`, `250 W`, `—` when unmeasured."""
    if value is None:
        return "—"
    unit = FIGURE_UNITS.get(figure)
    if unit == "1":
        return f"{float(value):.0%}"
    if unit == "By":
        return fmt_bytes(value)
    if unit == "Cel":
        return f"{float(value):.0f} °C"
    if unit == "W":
        return f"{float(value):.0f} W"
    return f"{float(value):g}"


def fmt_bytes(value: float | int | None) -> str:
    if value is None:
        return "—"
    size, sign = abs(float(value)), "-" if float(value) < 0 else ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{sign}{int(size)} B" if unit == "B" else f"{sign}{size:.1f} {unit}"
        size /= 1024
    return ""  # pragma: no cover


def _who(member: object) -> str:
    if member is None:
        return "—"
    return f"r{member}" if isinstance(member, int) else printable(member)


def _median_worst(label: str, figure: str, stat: Mapping, member_key: str) -> str | None:
    """`GPU util median 62% (r1), worst 12% (r3)`; None when nothing measured it. With one
    measuring member the median and the worst are the same member: said once."""
    med, worst = stat["median"], stat["worst"]
    if med["value"] is None and worst["value"] is None:
        return None
    text = f"{label} median {fmt_figure(figure, med['value'])} ({_who(med[member_key])})"
    if stat["measured"] > 1:
        text += f", worst {fmt_figure(figure, worst['value'])} ({_who(worst[member_key])})"
    return text


RANK_LINE: tuple[tuple[str, str], ...] = (
    (CPU_UTILIZATION, "process CPU"), (RSS_BYTES, "RSS"),
)
GPU_LINE: tuple[tuple[str, str], ...] = (
    (GPU_UTILIZATION, "GPU util"), (GPU_MEMORY_USED_BYTES, "GPU memory"),
    (GPU_TEMPERATURE_C, "GPU temp"), (GPU_POWER_W, "GPU power"),
)
HOST_LINE: tuple[tuple[str, str], ...] = (
    (HOST_CPU_UTILIZATION, "host CPU"), (HOST_MEMORY_UTILIZATION, "host memory"),
)
"""(figure, label) of each resource line, in the order the card and the live view show them."""


def steepest_trend(section: Mapping) -> Mapping | None:
    """The memory trend with the largest slope (ties: lower rank): the one line the card has room for."""
    trends = [t for t in section["memory_trends"] if t["slope_bytes_per_step"] is not None]
    if not trends:
        return None
    return min(trends, key=lambda t: (-t["slope_bytes_per_step"], t["rank"]))


def trend_text(trend: Mapping) -> str:
    """`r2 rss +1.2 MiB/step from step 40 (+120.0 MiB, +35%, fit r² 0.97)`."""
    slope = trend["slope_bytes_per_step"]
    parts = [("+" if slope >= 0 else "") + fmt_bytes(slope)]
    if trend["growth_bytes"] is not None:
        parts.append(("+" if trend["growth_bytes"] >= 0 else "") + fmt_bytes(trend["growth_bytes"]))
    if trend["growth_ratio"] is not None:
        parts.append(f"{trend['growth_ratio']:+.0%}")
    if trend["fit_r2"] is not None:
        parts.append(f"fit r² {trend['fit_r2']:.2f}")
    return (f"r{trend['rank']} {printable(trend['signal'])} {parts[0]}/step from step {trend['onset_step']}"
            + (f" ({', '.join(parts[1:])})" if len(parts) > 1 else ""))


def resource_lines(section: Mapping) -> list[str]:
    """The card's resource lines from the projected section: process, GPU, host, memory trend.

    A line whose figures nobody measured is left out; with nothing measured at all,
    one line says so. Host names came from the wire: each passes `printable`."""
    ranks, nodes = section["global"]["ranks"], section["global"]["nodes"]
    lines = []
    for group, stats, member in ((RANK_LINE, ranks, "rank"), (GPU_LINE, ranks, "rank"),
                                 (HOST_LINE, nodes, "host")):
        parts = [p for figure, label in group if (p := _median_worst(label, figure, stats[figure], member))]
        if parts:
            lines.append(" | ".join(parts))
    trend = steepest_trend(section)
    if trend is not None:
        lines.append(f"memory trend (steepest rank): {trend_text(trend)}")
    if not lines:
        return ["Resources: not measured (no process, host or GPU sample in the window)"]
    return ["Resources: " + lines[0], *(f"  {line}" for line in lines[1:])]


def live_resource_text(section: Mapping) -> str | None:
    """One compact line for the live view's plain output: `cpu 45%/98% r3 | gpu 62%/12% r3 | host cpu 97%`;
    None when nothing was measured."""
    ranks, nodes = section["global"]["ranks"], section["global"]["nodes"]
    parts = []
    for label, stats, figure, member in (("cpu", ranks, CPU_UTILIZATION, "rank"),
                                         ("rss", ranks, RSS_BYTES, "rank"),
                                         ("gpu", ranks, GPU_UTILIZATION, "rank"),
                                         ("host cpu", nodes, HOST_CPU_UTILIZATION, "host")):
        stat = stats[figure]
        if stat["median"]["value"] is None:
            continue
        text = f"{label} {fmt_figure(figure, stat['median']['value'])}"
        if stat["measured"] > 1:
            text += f"/{fmt_figure(figure, stat['worst']['value'])} {_who(stat['worst'][member])}"
        parts.append(text)
    return " | ".join(parts) if parts else None


__all__ = [
    "GPU_LINE", "HOST_LINE", "RANK_LINE", "TREND_KEYS", "UNITS", "figure_value", "fmt_bytes", "fmt_figure",
    "live_resource_text", "project_resources", "rank_resources", "resource_lines", "resource_window_of",
    "steepest_trend", "trend_text",
]
