"""SVG charts drawn from a web view model: stacked phase bars, step-time, memory and memory-trend lines.

Pure drawing: geometry only (scales, positions), from values the view already holds.
Every text and attribute goes through `esc` (the values are numbers and labels, but
rank ids and labels come from the wire in the end). No `style` attribute anywhere:
the page's Content-Security-Policy refuses inline styles, so colours are SVG
presentation attributes and classes of the page's own stylesheet.
"""
from __future__ import annotations

import html
import math
from typing import Mapping, Sequence

# Colour of each phase (window metric name), bottom to top of a bar.
PHASE_COLOURS: Mapping[str, str] = {
    "input_wait": "#e4572e",
    "h2d": "#f3a712",
    "forward": "#4c9be8",
    "backward": "#2e5eaa",
    "optimizer_step": "#76b041",
    "residual": "#9e9e9e",
}
LINE_COLOURS: tuple[str, ...] = (
    "#2e5eaa", "#76b041", "#f3a712", "#8e44ad", "#16a085", "#d35400", "#7f8c8d", "#c0392b",
)
CULPRIT_COLOUR = "#d62728"

_WIDTH = 720
_LABEL_W = 70
_ROW_H = 16
_GAP = 4


def esc(value: object) -> str:
    """Text and attribute context alike (quotes escaped)."""
    return html.escape("" if value is None else str(value), quote=True)


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} ms"


def _nice_max(value: float) -> float:
    """A round axis maximum at or above `value` (1, 2 or 5 times a power of ten)."""
    if not (value > 0 and math.isfinite(value)):
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if step * power >= value * (1 - 1e-12):
            return step * power
    return 10 * power  # pragma: no cover


def bar_scale_max(*phase_lists: Sequence[Mapping]) -> float:
    """The longest stacked bar over one or more bar lists (so two panels share one scale)."""
    longest = 0.0
    for phases in phase_lists:
        for row in phases:
            longest = max(longest, sum(v for v in row["values"].values() if isinstance(v, (int, float))))
    return _nice_max(longest)


def phase_bars(phases: Sequence[Mapping], phase_order: Sequence[Mapping], *, culprit: int | None = None,
               scale_max: float | None = None, title: str = "Phases per rank (window average, ms)") -> str:
    """One horizontal stacked bar per rank: input wait, H2D, forward, backward, optimizer, residual."""
    top = 22
    height = top + len(phases) * (_ROW_H + _GAP) + 24
    scale = scale_max or bar_scale_max(phases)
    plot_w = _WIDTH - _LABEL_W - 20
    out = [f'<svg class="chart phase-bars" viewBox="0 0 {_WIDTH} {height}" width="{_WIDTH}" height="{height}" '
           f'role="img" aria-label="{esc(title)}" xmlns="http://www.w3.org/2000/svg">',
           f'<text class="chart-title" x="0" y="14">{esc(title)}</text>']
    for i, row in enumerate(phases):
        y = top + i * (_ROW_H + _GAP)
        rank = row["rank"]
        cls = "bar culprit" if culprit is not None and rank == culprit else "bar"
        out.append(f'<g class="{cls}" data-rank="{esc(rank)}">')
        out.append(f'<text class="axis-label" x="{_LABEL_W - 6}" y="{y + _ROW_H - 4}" text-anchor="end">'
                   f'rank {esc(rank)}</text>')
        x = float(_LABEL_W)
        for phase in phase_order:
            metric = phase["metric"]
            value = row["values"].get(metric)
            if not isinstance(value, (int, float)) or value <= 0:
                continue
            w = plot_w * value / scale
            out.append(f'<rect class="seg" data-phase="{esc(metric)}" x="{x:.2f}" y="{y}" width="{w:.2f}" '
                       f'height="{_ROW_H}" fill="{PHASE_COLOURS.get(metric, "#999")}">'
                       f'<title>rank {esc(rank)} {esc(phase["label"])}: {_ms(value)}</title></rect>')
            x += w
        if x == _LABEL_W:  # nothing measured: a thin outline keeps the row visible
            out.append(f'<rect class="seg empty" x="{x}" y="{y}" width="2" height="{_ROW_H}" fill="#ccc">'
                       f'<title>rank {esc(rank)}: no phase measured</title></rect>')
        if culprit is not None and rank == culprit:
            out.append(f'<rect class="culprit-mark" x="{_LABEL_W - 3}" y="{y}" width="2" height="{_ROW_H}" '
                       f'fill="{CULPRIT_COLOUR}"/>')
        out.append("</g>")
    axis_y = top + len(phases) * (_ROW_H + _GAP) + 4
    out.append(f'<line class="axis" x1="{_LABEL_W}" y1="{axis_y}" x2="{_LABEL_W + plot_w}" y2="{axis_y}" '
               f'stroke="#888"/>')
    for frac in (0.0, 0.5, 1.0):
        out.append(f'<text class="axis-label" x="{_LABEL_W + plot_w * frac:.1f}" y="{axis_y + 14}" '
                   f'text-anchor="middle">{scale * frac:g} ms</text>')
    out.append("</svg>")
    return "".join(out)


def phase_legend(phase_order: Sequence[Mapping]) -> str:
    items = "".join(
        f'<li><svg width="10" height="10" aria-hidden="true"><rect width="10" height="10" '
        f'fill="{PHASE_COLOURS.get(p["metric"], "#999")}"/></svg> {esc(p["label"])}</li>'
        for p in phase_order)
    return f'<ul class="legend">{items}</ul>'


def _path(points: Sequence[tuple[float, float] | None]) -> str:
    """An SVG path through the points; a None breaks the line (a step not measured)."""
    parts, pen_down = [], False
    for point in points:
        if point is None:
            pen_down = False
            continue
        parts.append(f'{"L" if pen_down else "M"}{point[0]:.1f},{point[1]:.1f}')
        pen_down = True
    return " ".join(parts)


def _axes(css: str, title: str, height: int, top: int, plot_w: float, plot_h: float, y_max: float,
          unit: str, first_step, last_step) -> list[str]:
    """A chart's opening: the svg element, its title, both axes, three y labels (0, half, top in
    `unit`) and the first and last step under the x axis (none when `first_step` is None)."""
    left = _LABEL_W
    out = [f'<svg class="chart {esc(css)}" viewBox="0 0 {_WIDTH} {height}" width="{_WIDTH}" height="{height}" '
           f'role="img" aria-label="{esc(title)}" xmlns="http://www.w3.org/2000/svg">',
           f'<text class="chart-title" x="0" y="14">{esc(title)}</text>',
           f'<line class="axis" x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#888"/>',
           f'<line class="axis" x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#888"/>']
    for frac in (0.0, 0.5, 1.0):
        y = top + plot_h - plot_h * frac
        out.append(f'<text class="axis-label" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">'
                   f'{y_max * frac:g} {esc(unit)}</text>')
    if first_step is not None:
        out.append(f'<text class="axis-label" x="{left}" y="{height - 10}" text-anchor="start">step {esc(first_step)}</text>')
        out.append(f'<text class="axis-label" x="{left + plot_w}" y="{height - 10}" text-anchor="end">'
                   f'step {esc(last_step)}</text>')
    return out


def line_chart(step_ids: Sequence[int], by_rank: Mapping[str, Sequence[float | None]], *,
               median: Sequence[float | None] = (), culprit: int | None = None, title: str,
               unit: str = "ms", divisor: float = 1.0, css: str = "step-chart") -> str:
    """One line per rank over the last steps (x: step id, y: value / divisor in `unit`)."""
    height, top, bottom, left, right = 220, 22, 30, _LABEL_W, 20
    plot_w, plot_h = _WIDTH - left - right, height - top - bottom
    values = [v / divisor for series in (*by_rank.values(), median) for v in series
              if isinstance(v, (int, float))]
    y_max = _nice_max(max(values) if values else 1.0)
    n = len(step_ids)

    def xy(i: int, v: float | None) -> tuple[float, float] | None:
        if not isinstance(v, (int, float)):
            return None
        x = left + (plot_w * i / (n - 1) if n > 1 else plot_w / 2)
        return x, top + plot_h - plot_h * (v / divisor) / y_max

    out = _axes(css, title, height, top, plot_w, plot_h, y_max, unit,
                step_ids[0] if n else None, step_ids[-1] if n else None)
    for k, (rank, series) in enumerate(by_rank.items()):
        is_culprit = culprit is not None and str(culprit) == str(rank)
        colour = CULPRIT_COLOUR if is_culprit else LINE_COLOURS[k % len(LINE_COLOURS)]
        d = _path([xy(i, v) for i, v in enumerate(series)])
        out.append(f'<path class="line{" culprit" if is_culprit else ""}" data-rank="{esc(rank)}" d="{d}" '
                   f'fill="none" stroke="{colour}" stroke-width="{2.5 if is_culprit else 1.2}">'
                   f'<title>rank {esc(rank)}</title></path>')
    if median:
        d = _path([xy(i, v) for i, v in enumerate(median)])
        out.append(f'<path class="line median" d="{d}" fill="none" stroke="#000" stroke-width="1" '
                   f'stroke-dasharray="4 3"><title>median over ranks</title></path>')
    out.append("</svg>")
    return "".join(out)


def trend_chart(trends: Sequence[Mapping], *, title: str, culprit: int | None = None) -> str:
    """Each memory trend's fitted line over its steps: flat at `level_bytes` up to `onset_step`,
    then rising to `level_bytes + growth_bytes` at `last_step` (MiB; x: step number)."""
    drawn = [t for t in trends if isinstance(t.get("level_bytes"), (int, float))
             and isinstance(t.get("growth_bytes"), (int, float))]
    height, top, bottom, left, right = 200, 22, 30, _LABEL_W, 20
    plot_w, plot_h = _WIDTH - left - right, height - top - bottom
    if not drawn:
        return ""
    x_min = min(t["first_step"] for t in drawn)
    x_max = max(t["last_step"] for t in drawn)
    mib = float(2**20)
    ends = [(t["level_bytes"] + max(0.0, t["growth_bytes"])) / mib for t in drawn]
    starts = [t["level_bytes"] / mib for t in drawn]
    y_max = _nice_max(max(ends + starts))
    span = max(1, x_max - x_min)

    def xy(step: float, value_bytes: float) -> tuple[float, float]:
        return (left + plot_w * (step - x_min) / span, top + plot_h - plot_h * (value_bytes / mib) / y_max)

    out = _axes("trend-chart", title, height, top, plot_w, plot_h, y_max, "MiB", x_min, x_max)
    for k, t in enumerate(drawn):
        rank = t["rank"]
        is_culprit = culprit is not None and rank == culprit
        colour = CULPRIT_COLOUR if is_culprit else LINE_COLOURS[k % len(LINE_COLOURS)]
        level, onset = float(t["level_bytes"]), max(t["first_step"], min(t["onset_step"], t["last_step"]))
        d = _path([xy(t["first_step"], level), xy(onset, level), xy(t["last_step"], level + float(t["growth_bytes"]))])
        out.append(f'<path class="line{" culprit" if is_culprit else ""}" data-rank="{esc(rank)}" d="{d}" '
                   f'fill="none" stroke="{colour}" stroke-width="{2.5 if is_culprit else 1.2}">'
                   f'<title>rank {esc(rank)} {esc(t["signal"])}: onset step {esc(t["onset_step"])}</title></path>')
    out.append("</svg>")
    return "".join(out)


__all__ = ["PHASE_COLOURS", "bar_scale_max", "esc", "line_chart", "phase_bars", "phase_legend", "trend_chart"]
