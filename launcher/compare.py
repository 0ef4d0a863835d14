"""`traceml compare A B`: two final summaries side by side, with "material" changes marked.

A is the baseline, B the candidate. Each side is a `final_summary.json` or a run
folder holding one. The comparison reads only public summary keys
(docs/SCHEMA.md), never a database, so summaries from different machines or
versions compare as long as their schema major version matches.

A change is *material* when it crosses these thresholds (see `Thresholds`):

- Step Time (median, and worst): |delta| >= 5 % of A's median Step Time and >= 1 ms.
- A phase (input wait, H2D, forward, backward, optimizer, compute, residual,
  traced step): |delta| >= 5 % of A's median Step Time and >= 1 ms, that is a
  shift worth 5 % of the whole step, not of the phase.
- Skew of Step Time: |delta| >= 0.10 (ten points of (worst - median) / median).
- Diagnosis: a different primary kind, severity or culprit rank.
- Peak memory (allocated or reserved, largest rank): |delta| >= 10 % of A and
  >= 64 MiB, or available on one side only.
- Lost time (the badput ledger's share of the window's rank-time): |delta| >= 5
  points. Lost rank-time over each run, and each cause's share, are shown beside
  it (a run's total grows with its length, so only the share can be material).
A value measured on one side only is shown but never called material (it is a
coverage difference, reported as such).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

from traceml.schema.summary import FINAL_SUMMARY_FILE

# (public key, label) in display order.
COMPARED_METRICS: tuple[tuple[str, str], ...] = (
    ("step_time_ms", "Step Time"),
    ("input_wait_ms", "Input Wait"),
    ("h2d_ms", "H2D"),
    ("forward_ms", "Forward"),
    ("backward_ms", "Backward"),
    ("optimizer_ms", "Optimizer"),
    ("compute_ms", "Compute"),
    ("residual_ms", "Residual"),
    ("traced_step_time_ms", "Traced Step Time"),
)
BADPUT_CAUSES: tuple[tuple[str, str], ...] = (
    ("straggler_wait", "straggler wait"),
    ("input_stall", "input stall"),
    ("h2d", "H2D"),
    ("communication", "communication"),
    ("drift", "drift"),
    ("restarts", "restarts"),
)
"""The ledger's causes (`traceml.schema.badput.LEDGER_CAUSES`) with their labels, in its order."""
MEMORY_KEYS: tuple[tuple[str, str], ...] = (
    ("peak_allocated_bytes", "Peak allocated"),
    ("peak_reserved_bytes", "Peak reserved"),
)


@dataclass(frozen=True, slots=True)
class Thresholds:
    """What counts as a material change (the module docstring says why these)."""

    step_share: float = 0.05
    min_ms: float = 1.0
    skew_points: float = 0.10
    memory_ratio: float = 0.10
    min_memory_bytes: int = 64 * 1024 * 1024
    lost_share_points: float = 0.05


@dataclass(frozen=True, slots=True)
class Delta:
    name: str
    label: str
    statistic: str  # "median" | "worst" | "skew" | "peak" | "share" | "rank_s"
    a: float | None
    b: float | None
    delta: float | None
    relative: float | None  # delta / a
    material: bool
    note: str = ""


@dataclass(frozen=True, slots=True)
class DiagnosisChange:
    a: dict[str, Any]
    b: dict[str, Any]
    changed: tuple[str, ...]  # which of kind / severity / culprit_rank differ

    @property
    def material(self) -> bool:
        return bool(self.changed)


@dataclass(frozen=True)
class Comparison:
    a_label: str
    b_label: str
    a_run: str | None
    b_run: str | None
    metrics: tuple[Delta, ...]
    memory: tuple[Delta, ...]
    diagnosis: DiagnosisChange
    warnings: tuple[str, ...]
    thresholds: Thresholds
    badput: tuple[Delta, ...] = ()  # lost time before (A) and after (B): the ledger's figures

    @property
    def material_changes(self) -> tuple[str, ...]:
        out = [f"diagnosis {', '.join(self.diagnosis.changed)}"] if self.diagnosis.material else []
        out += [f"{d.label} {d.statistic}" for d in (*self.metrics, *self.memory, *self.badput) if d.material]
        return tuple(out)

    def to_json(self) -> dict[str, Any]:
        return {
            "a": {"label": self.a_label, "run_id": self.a_run},
            "b": {"label": self.b_label, "run_id": self.b_run},
            "diagnosis": {"a": self.diagnosis.a, "b": self.diagnosis.b,
                          "changed": list(self.diagnosis.changed), "material": self.diagnosis.material},
            "metrics": [asdict(d) for d in self.metrics],
            "memory": [asdict(d) for d in self.memory],
            "badput": [asdict(d) for d in self.badput],
            "material_changes": list(self.material_changes),
            "warnings": list(self.warnings),
            "thresholds": asdict(self.thresholds),
        }


class SummaryLoadError(ValueError):
    """A side that is not a readable final summary; the message says which and why."""


def load_summary(path: str | Path) -> tuple[Path, dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / FINAL_SUMMARY_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SummaryLoadError(f"{path} does not exist") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise SummaryLoadError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict) or not {"diagnosis", "global"} <= data.keys():
        raise SummaryLoadError(f"{path} is not a TraceML final summary (no diagnosis/global sections)")
    return path, data


def _get(data: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)
    return data


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _delta(name: str, label: str, statistic: str, a: float | None, b: float | None,
           material_if) -> Delta:
    if a is None or b is None:
        note = "" if a is None and b is None else ("measured in B only" if a is None else "measured in A only")
        return Delta(name, label, statistic, a, b, None, None, False, note)
    delta = b - a
    relative = delta / a if a else None
    return Delta(name, label, statistic, a, b, delta, relative, bool(material_if(delta)))


def _primary(data: Mapping[str, Any]) -> dict[str, Any]:
    d = data.get("diagnosis") or {}
    return {k: d.get(k) for k in ("kind", "severity", "status", "score", "culprit_rank", "summary")}


def compare(a: Mapping[str, Any], b: Mapping[str, Any], *, a_label: str = "A", b_label: str = "B",
            thresholds: Thresholds = Thresholds()) -> Comparison:
    warnings = []
    va, vb = str(a.get("schema_version", "?")), str(b.get("schema_version", "?"))
    if va.split(".")[0] != vb.split(".")[0]:
        warnings.append(f"schema versions differ ({va} vs {vb}): keys may not mean the same")
    clock_a, clock_b = _get(a, "global", "window", "clock"), _get(b, "global", "window", "clock")
    if clock_a != clock_b:
        warnings.append(f"clocks differ ({clock_a} vs {clock_b}): times are not directly comparable")
    ranks_a, ranks_b = _get(a, "global", "window", "rank_count"), _get(b, "global", "window", "rank_count")
    if ranks_a != ranks_b:
        warnings.append(f"rank counts differ ({ranks_a} vs {ranks_b})")
    for label, data in ((a_label, a), (b_label, b)):
        if (_get(data, "global", "window", "steps") or 0) < 20:
            warnings.append(f"{label} has fewer than 20 aligned steps: its figures are provisional")

    base_step = _number(_get(a, "global", "median", "step_time_ms", "value"))
    step_floor = max(thresholds.min_ms, thresholds.step_share * base_step) if base_step else thresholds.min_ms

    def ms_material(delta: float) -> bool:
        return abs(delta) >= step_floor

    metrics: list[Delta] = []
    for key, label in COMPARED_METRICS:
        metrics.append(_delta(key, label, "median",
                              _number(_get(a, "global", "median", key, "value")),
                              _number(_get(b, "global", "median", key, "value")), ms_material))
        if key == "step_time_ms":
            metrics.append(_delta(key, label, "worst",
                                  _number(_get(a, "global", "worst", key, "value")),
                                  _number(_get(b, "global", "worst", key, "value")), ms_material))
            metrics.append(_delta(key, label, "skew",
                                  _number(_get(a, "global", "skew", key)),
                                  _number(_get(b, "global", "skew", key)),
                                  lambda d: abs(d) >= thresholds.skew_points))

    memory: list[Delta] = []
    for key, label in MEMORY_KEYS:
        ma = _number(_get(a, "memory", key, "value"))
        mb = _number(_get(b, "memory", key, "value"))
        if (ma is None) != (mb is None):
            memory.append(Delta(key, label, "peak", ma, mb, None, None, True,
                                "available on one side only"))
            continue
        memory.append(_delta(key, label, "peak", ma, mb, lambda d, base=ma: (
            abs(d) >= thresholds.min_memory_bytes and base is not None
            and abs(d) >= thresholds.memory_ratio * base)))

    badput = [_delta("lost_time", "Lost time", "share",
                     _number(_get(a, "badput", "window", "total_share")),
                     _number(_get(b, "badput", "window", "total_share")),
                     lambda d: abs(d) >= thresholds.lost_share_points - 1e-9),
              _delta("lost_time", "Lost time, run so far", "rank_s",
                     _number(_get(a, "badput", "run", "total_rank_seconds")),
                     _number(_get(b, "badput", "run", "total_rank_seconds")), lambda d: False)]
    for cause, label in BADPUT_CAUSES:
        badput.append(_delta(f"lost_{cause}", f"Lost to {label}", "share",
                             _number(_get(a, "badput", "run", "causes", cause, "share")),
                             _number(_get(b, "badput", "run", "causes", cause, "share")), lambda d: False))

    pa, pb = _primary(a), _primary(b)
    changed = tuple(k for k in ("kind", "severity", "culprit_rank") if pa.get(k) != pb.get(k))
    return Comparison(a_label, b_label, _get(a, "metadata", "run_id"), _get(b, "metadata", "run_id"),
                      tuple(metrics), tuple(memory), DiagnosisChange(pa, pb, changed),
                      tuple(warnings), thresholds, tuple(badput))


# --- Presentation --------------------------------------------------------------------------


def _fmt(value: float | None, statistic: str) -> str:
    if value is None:
        return "—"
    if statistic == "skew":
        return f"{value:+.0%}"
    if statistic == "peak":
        return f"{value / 2**20:,.1f} MiB"
    if statistic == "share":
        return f"{value:.1%}"
    if statistic == "rank_s":
        return f"{value:,.1f} rank-s"
    return f"{value:.2f} ms"


def _fmt_delta(d: Delta) -> str:
    if d.delta is None:
        return d.note or "—"
    if d.statistic == "skew":
        return f"{d.delta * 100:+.1f} pts"
    if d.statistic == "peak":
        return f"{d.delta / 2**20:+,.1f} MiB"
    if d.statistic == "share":
        return f"{d.delta * 100:+.1f} pts"
    if d.statistic == "rank_s":
        return f"{d.delta:+,.1f} rank-s" + ("" if d.relative is None else f" ({d.relative:+.0%})")
    rel = "" if d.relative is None else f" ({d.relative:+.0%})"
    return f"{d.delta:+.2f} ms{rel}"


def _issue(p: Mapping[str, Any]) -> str:
    culprit = "" if p.get("culprit_rank") is None else f" rank {p['culprit_rank']}"
    return f"{p.get('kind')} [{p.get('severity')}]{culprit}"


def render(comparison: Comparison):
    """The comparison as Rich renderables; every string from the summaries is `printable`
    and passed as `Text`, never as markup."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from traceml.processor.api import printable

    title = Text()
    title.append("A ", style="bold")
    title.append(printable(f"{comparison.a_label} (run {comparison.a_run})") + "\n")
    title.append("B ", style="bold")
    title.append(printable(f"{comparison.b_label} (run {comparison.b_run})"))

    diag = Text("Diagnosis: ")
    diag.append(printable(_issue(comparison.diagnosis.a)))
    diag.append(" -> ")
    diag.append(printable(_issue(comparison.diagnosis.b)),
                style="bold yellow" if comparison.diagnosis.material else "")
    diag.append("  (changed: " + ", ".join(comparison.diagnosis.changed) + ")"
                if comparison.diagnosis.material else "  (unchanged)")

    table = Table(show_edge=False, pad_edge=False)
    for column, justify in (("metric", "left"), ("A", "right"), ("B", "right"), ("B - A", "right"),
                            ("material", "center")):
        table.add_column(column, justify=justify)
    for d in (*comparison.metrics, *comparison.memory, *comparison.badput):
        label = d.label if d.statistic in ("median", "peak", "share", "rank_s") else f"{d.label} ({d.statistic})"
        if d.statistic == "share" and d.a is None and d.b is None:
            continue  # a cause neither run could measure (or summaries older than the ledger)
        table.add_row(label, _fmt(d.a, d.statistic), _fmt(d.b, d.statistic), _fmt_delta(d),
                      Text("yes", style="bold yellow") if d.material else "")
    parts = [title, diag, table]
    for warning in comparison.warnings:
        parts.append(Text(printable(f"note: {warning}"), style="dim"))
    material = comparison.material_changes
    parts.append(Text("Material changes: " + (", ".join(material) if material else "none"),
                      style="bold" if material else ""))
    return Group(*parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="traceml compare",
        description="Compare two final summaries (A = baseline, B = candidate): step time and phase "
                    "deltas, diagnosis changes, memory deltas, lost time (badput) before and after, with "
                    "material changes marked.")
    parser.add_argument("a", help="baseline final_summary.json, or a run folder holding one")
    parser.add_argument("b", help="candidate final_summary.json, or a run folder holding one")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.add_argument("--html", nargs="?", const="", default=None, metavar="PATH",
                        help="also write a one-file HTML report: side-by-side phase bars, material changes "
                             "marked (default PATH: ./compare.html)")
    parser.add_argument("--fail-on-material", action="store_true",
                        help="exit with status 1 when any change is material (for CI)")
    return parser


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    out = out or sys.stdout
    options = build_parser().parse_args(list(argv))
    try:
        path_a, a = load_summary(options.a)
        path_b, b = load_summary(options.b)
    except SummaryLoadError as exc:
        from traceml.processor.api import printable

        print(f"traceml compare: {printable(exc)}", file=sys.stderr)
        return 2
    comparison = compare(a, b, a_label=str(path_a), b_label=str(path_b))
    if options.json:
        print(json.dumps(comparison.to_json(), indent=2), file=out)
    else:
        from rich.console import Console

        Console(file=out, width=max(100, Console(file=out).width)).print(render(comparison))
    if options.html is not None:
        from traceml.processor.api import COMPARE_FILENAME, write_compare_report

        html_path = write_compare_report(comparison.to_json(), a, b, options.html or COMPARE_FILENAME)
        print(f"[traceml] HTML report: {html_path}", file=sys.stderr if options.json else out)
    if options.fail_on_material and comparison.material_changes:
        return 1
    return 0
