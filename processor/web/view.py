"""The web view model: one analysed run -> the JSON-safe dict the page and the report draw.

Pure presenter. It formats what the analysis and the run facts already hold and
never loads SQLite, aligns steps, computes a statistic or diagnoses: the issues,
the window metadata, the metric statistics, the resource figures and the telemetry
section come from `project_final_summary` (the projector every surface shares), the per-rank bars and
series from the window's typed rank facts, the per-step memory from what the
feed read beside the analysis.

Its size is bounded by what is drawn, not by ranks x steps: at most
`MAX_DRAWN_RANKS` ranks get bars and series (the ranks the diagnosis names, the
worst and representative ranks of Step Time, then the slowest), the others are
counted; the series cover the last `LAST_STEPS` aligned steps; a list in evidence
or telemetry longer than `MAX_LIST_ITEMS` is shown as its first items and its length.
"""
from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from traceml.processor.reporting.final_summary import PUBLIC_METRICS, project_final_summary
from traceml.processor.reporting.public_number import public_number
from traceml.processor.reporting.inputs import RankMemory, RunMetadata, RunTelemetry
from traceml.processor.reporting.source_note import source_lines
from traceml.processor.reporting.resources import GPU_LINE, HOST_LINE, RANK_LINE, steepest_trend
from traceml.processor.resources.model import (
    CUDA_ALLOCATED_BYTES,
    GPU_MEMORY_TOTAL_BYTES,
    HOST_CPU_COUNT,
    HOST_MEMORY_TOTAL_BYTES,
    HOST_MEMORY_USED_BYTES,
)
from traceml.processor.step_time.model import StepTimeAnalysis

VIEW_SCHEMA = "traceml.web.run/1"

MAX_DRAWN_RANKS = 32
"""Ranks drawn as bars and lines; beyond this the page says how many are not drawn."""
LAST_STEPS = 100
"""Aligned steps the step-time and memory charts cover (the live window's length)."""
MAX_LIST_ITEMS = 16
"""Longer lists (cohort ranks, finished ranks) are shown as their first items plus a count."""
MAX_SHOWN_CAPTURES = 4
"""Captures a run's page shows, newest first (the final summary lists them all)."""

# (window metric, label) of the stacked phase bar, bottom to top. Together they add up
# to Step Time (residual = traced - h2d - forward - backward - optimizer, floored at 0).
# Collective wait is measured but is no segment here: it lies inside the phase that holds it
# (DDP's all-reduce, in backward) or, between phases, is taken out of the residual
# (docs/DIAGNOSIS.md); the statistics table shows it.
PHASES: tuple[tuple[str, str], ...] = (
    ("input_wait", "Input wait"),
    ("h2d", "H2D"),
    ("forward", "Forward"),
    ("backward", "Backward"),
    ("optimizer_step", "Optimizer"),
    ("residual", "Residual"),
)

# (public key, window metric, label) of the statistics table, in the live view's order.
TABLE_METRICS: tuple[tuple[str, str, str], ...] = (
    ("step_time_ms", "step_time", "Step Time"),
    ("input_wait_ms", "input_wait", "Input Wait"),
    ("h2d_ms", "h2d", "H2D"),
    ("forward_ms", "forward", "Forward"),
    ("backward_ms", "backward", "Backward"),
    ("optimizer_ms", "optimizer_step", "Optimizer"),
    ("compute_ms", "compute", "Compute"),
    ("residual_ms", "residual", "Residual"),
    ("traced_step_time_ms", "traced_step_time", "Traced Step Time"),
    ("collective_wait_ms", "collective_wait", "Collective wait"),
)


# (scope, figure, label) of the resource table: the card's lines' figures, then the rest.
RESOURCE_TABLE: tuple[tuple[str, str, str], ...] = (
    *(("ranks", f, label) for f, label in (*RANK_LINE, *GPU_LINE)),
    ("ranks", GPU_MEMORY_TOTAL_BYTES, "GPU memory size"),
    ("ranks", CUDA_ALLOCATED_BYTES, "CUDA allocated"),
    *(("nodes", f, label) for f, label in HOST_LINE),
    ("nodes", HOST_MEMORY_USED_BYTES, "host memory used"),
    ("nodes", HOST_MEMORY_TOTAL_BYTES, "host memory size"),
    ("nodes", HOST_CPU_COUNT, "host CPUs"),
)
# (figure, label) columns of the per-rank and per-host resource tables.
RANK_RESOURCE_COLUMNS: tuple[tuple[str, str], ...] = (*RANK_LINE, *GPU_LINE)
NODE_RESOURCE_COLUMNS: tuple[tuple[str, str], ...] = (
    *HOST_LINE, (HOST_MEMORY_USED_BYTES, "memory used"), (HOST_CPU_COUNT, "CPUs"),
)


@dataclass(frozen=True)
class StepMemory:
    """Per-step peak allocated bytes of the drawn ranks, read by the feed beside the analysis."""

    by_rank: Mapping[int, Mapping[int, int | None]] = field(default_factory=dict)  # rank -> step -> bytes


@dataclass(frozen=True)
class ViewInputs:
    """Everything a view is made of besides the analysis (typed, from the feed or the report)."""

    freshness: str = "live"
    age_s: float | None = None
    error: str | None = None
    profile: str = "live"  # "live" (web view) or "summary" (HTML report)
    max_steps: int | None = None
    generated_at: float | None = None  # unix seconds
    memory: Sequence[RankMemory] = ()
    telemetry: RunTelemetry = RunTelemetry()
    step_memory: StepMemory = StepMemory()
    captures: Sequence = ()  # the run's `processor.capture.model.CaptureRecord`s (the capture book's)
    capture_action: bool = False  # the page may ask for a capture (the live view of a processor with a book)


def _round(value: float | None, digits: int = 3) -> float | None:
    return public_number(value, digits)


def bounded(value: object, limit: int = MAX_LIST_ITEMS) -> object:
    """Lists and mappings longer than `limit` (nested too) -> {"items": the first `limit`,
    "total": their length}; shorter ones unchanged."""
    if isinstance(value, Mapping):
        entries = list(value.items())
        out = {str(k): bounded(v, limit) for k, v in entries[:limit]}
        return out if len(entries) <= limit else {"items": out, "total": len(entries)}
    if isinstance(value, (list, tuple)):
        items = [bounded(v, limit) for v in value[:limit]]
        return items if len(value) <= limit else {"items": items, "total": len(value)}
    return value


def choose_ranks(universe: Sequence[int], named: Sequence[int | None], step_time: Mapping[int, float],
                 limit: int = MAX_DRAWN_RANKS) -> tuple[int, ...]:
    """Which ranks get bars and lines: all of them up to `limit`, else a chosen subset.

    The choice only orders values already computed: the `named` ranks (those an
    issue names, Step Time's worst and representative ranks), then the slowest by
    window-average Step Time (rank id breaks ties), then the rest in rank order.
    Drawn in rank order.
    """
    universe = tuple(universe)
    if len(universe) <= limit:
        return universe
    known = set(universe)
    chosen: list[int] = []
    ordered = [r for r in named if r is not None]
    ordered += [r for r, _ in sorted(step_time.items(), key=lambda kv: (-kv[1], kv[0]))]
    for rank in (*ordered, *universe):
        if len(chosen) >= limit:
            break
        if rank in known and rank not in chosen:
            chosen.append(rank)
    return tuple(sorted(chosen))


def drawn_ranks(analysis: StepTimeAnalysis, limit: int = MAX_DRAWN_RANKS) -> tuple[int, ...]:
    """`choose_ranks` over an analysis: issue ranks, Step Time's worst and representative, slowest."""
    window = analysis.window
    step = window.metrics.get("step_time")
    named: list[int | None] = []
    for issue in analysis.diagnosis.issues:
        named += [issue.culprit_rank, issue.victim_rank]
    if step is not None:
        named += [step.worst_rank, step.representative_rank]
    return choose_ranks(window.expected_ranks, named, {} if step is None else step.rank_values, limit)


def _telemetry(section: Mapping) -> dict:
    """The summary's telemetry section, with the per-rank loss maps cut to their non-zero
    entries (as the card shows them) and every long list bounded."""
    out = dict(section)
    for key in ("export_failures", "steps_missing"):
        out[key] = {r: n for r, n in section[key].items() if n}
    return {k: bounded(v) for k, v in out.items()}


def _resources(summary: Mapping, ranks: Sequence[int]) -> dict:
    """The summary's resource section for the page: its figures table, the drawn ranks' own
    figures (their `groups[].resources`), and the hosts and memory trends, bounded."""
    section = summary["resources"]
    glob = section["global"]
    member = {"ranks": "rank", "nodes": "host"}
    table = []
    for scope, figure, label in RESOURCE_TABLE:
        stat = glob[scope][figure]
        table.append({"scope": scope, "figure": figure, "label": label,
                      "median": stat["median"]["value"], "median_member": stat["median"][member[scope]],
                      "worst": stat["worst"]["value"], "worst_member": stat["worst"][member[scope]],
                      "measured": stat["measured"]})
    groups = {g["global_rank"]: g["resources"] for g in summary["groups"]}
    per_rank = [{"rank": r, **groups[r]} for r in ranks if r in groups and groups[r]["samples"]]
    nodes = section["nodes"]
    # Steepest first (ordering only), so a long list shows the rising ones.
    trends = sorted(section["memory_trends"], key=lambda t: (-(t["slope_bytes_per_step"] or 0.0), t["rank"]))
    return {
        "available": section["available"], "window": section["window"], "sources": section["sources"],
        "figures": table, "ranks": per_rank,
        "nodes": nodes[:MAX_LIST_ITEMS], "nodes_total": len(nodes),
        "memory_trends": trends[:MAX_LIST_ITEMS], "memory_trends_total": len(trends),
        "steepest_trend": steepest_trend(section),
    }


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).isoformat().replace("+00:00", "Z")


def build_run_view(analysis: StepTimeAnalysis, inputs: ViewInputs = ViewInputs(), *,
                   max_ranks: int = MAX_DRAWN_RANKS, last_steps: int = LAST_STEPS) -> dict:
    """The run's view model (JSON-safe). Issue order, kinds, ranks and statistics are the
    final summary's projection of the same analysis, so every surface tells one story."""
    window = analysis.window
    summary = project_final_summary(
        analysis,
        RunMetadata(run_id=window.run_id, generated_at=inputs.generated_at, profile=inputs.profile,
                    max_steps=inputs.max_steps),
        memory=inputs.memory, telemetry=inputs.telemetry, captures=inputs.captures)
    glob = summary["global"]
    win = dict(glob["window"])
    win["expected_ranks"] = bounded(win["expected_ranks"])
    primary = summary["diagnosis"]

    stats = []
    for key, metric, label in TABLE_METRICS:
        share = window.shares.get(metric)
        stats.append({
            "key": key, "label": label,
            # The cross-rank median, as the card and the diagnosis sentences quote it; its rank is the
            # representative rank (the real rank nearest it), the card's `near` column.
            "median": glob["cross_rank_median"][key], "median_rank": glob["median"][key]["rank"],
            "worst": glob["worst"][key]["value"], "worst_rank": glob["worst"][key]["rank"],
            "skew": glob["skew"][key],
            "share": None if share is None or metric == "step_time" else _round(share, 4),
            "coverage": glob["window"]["coverage"][key],
        })

    ranks = drawn_ranks(analysis, max_ranks)
    phases = []
    for rank in ranks:
        average = window.rank_facts[rank].average
        phases.append({
            "rank": rank,
            "values": {metric: _round(average.get(metric)) for metric, _ in PHASES},
            "step_time": _round(average.step_time),
        })

    step_ids = list(window.steps[-last_steps:]) if last_steps > 0 else []
    series: dict[str, list[float | None]] = {}
    for rank in ranks:
        facts = window.rank_facts[rank].steps
        tail = list(facts[len(facts) - len(step_ids):]) if step_ids and len(facts) >= len(step_ids) else []
        series[str(rank)] = [_round(s.values.step_time) for s in tail] if tail else [None] * len(step_ids)
    step_metric = window.metrics.get("step_time")
    median_series: list[float | None] = []
    if step_metric is not None and step_ids:
        full = step_metric.series
        median_series = [_round(full[i]) for i in range(len(full) - len(step_ids), len(full))]

    memory_series = {}
    for rank in ranks:
        per_step = inputs.step_memory.by_rank.get(rank)
        if per_step:
            memory_series[str(rank)] = [per_step.get(s) for s in step_ids]

    return {
        "schema": VIEW_SCHEMA,
        "run_id": window.run_id,
        "profile": inputs.profile,
        "generated_at": _iso(inputs.generated_at),
        "training_strategy": window.training_strategy,
        "freshness": {"state": inputs.freshness, "age_s": _round(inputs.age_s, 1), "error": inputs.error},
        "hero": {k: primary[k] for k in ("kind", "severity", "status", "score", "summary",
                                          "culprit_rank", "victim_rank", "component")},
        "issues": [dict(issue, evidence=bounded(issue["evidence"])) for issue in summary["issues"]],
        "window": win,
        "stats": stats,
        "ranks": {"total": len(window.expected_ranks), "drawn": list(ranks),
                  "not_drawn": len(window.expected_ranks) - len(ranks)},
        "phase_order": [{"metric": m, "label": label} for m, label in PHASES],
        "phases": phases,
        "steps": {"ids": step_ids, "by_rank": series, "median": median_series},
        "memory": {
            "available": summary["memory"]["available"],
            "peak_allocated_bytes": summary["memory"]["peak_allocated_bytes"],
            "peak_reserved_bytes": summary["memory"]["peak_reserved_bytes"],
            "steps_by_rank": memory_series,
        },
        "resources": _resources(summary, ranks),
        "telemetry": _telemetry(summary["telemetry"]),
        # Which mapping the steps came through and what it cannot measure (the card's lines).
        "source_notes": source_lines(summary["telemetry"]["sources"]),
        "badput": summary["badput"],  # a fixed set of causes and one what-if per finding: bounded
        # Newest first; each digest holds a bounded number of rows (the digest's top entries).
        "captures": {"items": summary["captures"][::-1][:MAX_SHOWN_CAPTURES], "total": len(summary["captures"]),
                     "ranks": list(ranks) if inputs.capture_action else []},
        "card": summary["card"],
    }


# window metric -> public per-rank key of final_summary.json (groups[].metrics)
_PUBLIC_KEY = {metric: key for key, metric in PUBLIC_METRICS}


def _summary_side(summary: Mapping, max_ranks: int) -> dict:
    """One side of a comparison: its hero and per-rank phase bars, from the public summary."""
    groups = {g["global_rank"]: g for g in summary.get("groups") or () if isinstance(g, Mapping)}
    step_key = _PUBLIC_KEY["step_time"]
    step = {r: g["metrics"][step_key] for r, g in groups.items()
            if isinstance(g.get("metrics"), Mapping) and isinstance(g["metrics"].get(step_key), (int, float))}
    diagnosis = summary.get("diagnosis") or {}
    glob = summary.get("global") or {}
    named = [diagnosis.get("culprit_rank"), diagnosis.get("victim_rank"),
             (glob.get("worst", {}).get(step_key) or {}).get("rank"),
             (glob.get("median", {}).get(step_key) or {}).get("rank")]
    ranks = choose_ranks(sorted(groups), named, step, max_ranks)
    window = glob.get("window") or {}
    return {
        "run_id": (summary.get("metadata") or {}).get("run_id"),
        "hero": {k: diagnosis.get(k) for k in ("kind", "severity", "status", "score", "summary",
                                                "culprit_rank", "victim_rank", "component")},
        "window": {k: window.get(k) for k in ("clock", "steps", "first_step", "last_step", "rank_count")},
        "ranks": {"total": len(groups), "drawn": list(ranks), "not_drawn": len(groups) - len(ranks)},
        "phases": [{"rank": r,
                    "values": {m: (groups[r].get("metrics") or {}).get(_PUBLIC_KEY[m]) for m, _ in PHASES},
                    "step_time": step.get(r)} for r in ranks],
    }


def build_compare_view(comparison: Mapping, a: Mapping, b: Mapping, *,
                       max_ranks: int = MAX_DRAWN_RANKS) -> dict:
    """`traceml compare`'s analysis (`Comparison.to_json()`, material changes decided there)
    beside each summary's own hero and phase bars."""
    return {
        "schema": "traceml.web.compare/1",
        "phase_order": [{"metric": m, "label": label} for m, label in PHASES],
        "a": dict(_summary_side(a, max_ranks), label=comparison["a"]["label"]),
        "b": dict(_summary_side(b, max_ranks), label=comparison["b"]["label"]),
        "comparison": dict(comparison),
    }


__all__ = [
    "LAST_STEPS", "MAX_DRAWN_RANKS", "MAX_LIST_ITEMS", "MAX_SHOWN_CAPTURES", "NODE_RESOURCE_COLUMNS", "PHASES", "RANK_RESOURCE_COLUMNS",
    "RESOURCE_TABLE", "StepMemory", "TABLE_METRICS",
    "VIEW_SCHEMA", "ViewInputs", "bounded", "build_compare_view", "build_run_view", "choose_ranks",
    "drawn_ranks",
]
