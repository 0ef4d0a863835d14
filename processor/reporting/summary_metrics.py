"""Pure projection of a `StepTimeAnalysis` to low-cardinality summary metric points.

Only the names and attribute keys of `schema.vocabulary.SUMMARY_METRICS` are
used, and no point carries a step attribute. Renderers (Prometheus text, OTLP)
take these points as they are; they decide nothing.

Attribute values are strings (ranks too), so one label value reads the same in
Prometheus and in OTLP. Time values are converted to seconds (`s`).

Per-rank series are bounded by design: a run of 16,384 ranks exporting every rank
made about 197,000 series per run. Only the ranks that matter get them
(`exported_ranks`: culprits and victims of the run's diagnosis issues, the worst
and the representative rank of step time, and the top-k ranks by deviation
score), so a run carries at most k + 2 + 2 x issues ranks' series whatever its
size; job-level aggregates (`traceml.run.*`) cover every rank. All ranks stay in
SQLite and in the final summary, which this module does not build.
"""
from __future__ import annotations

import math
import statistics
from typing import Mapping, Sequence

from traceml.processor.metric_point import SPECS, MetricPoint, StepExemplar
from traceml.processor.settings import RANK_SERIES_TOP_K
from traceml.processor.reporting.final_summary import PUBLIC_METRICS
from traceml.processor.reporting.inputs import RankMemory, RankTelemetry
from traceml.processor.reporting.resources import resource_window_of
from traceml.processor.resources import model as res
from traceml.schema.diagnosis import STRAGGLER_KINDS
from traceml.processor.step_time.model import FRESHNESS_STATES, StepTimeAnalysis, StepTimeWindow, finite_ratio
from traceml.schema.vocabulary import (
    ATTR_BADPUT_CAUSE,
    ATTR_CULPRIT_RANK,
    ATTR_DIAGNOSIS_KIND,
    ATTR_DIAGNOSIS_SEVERITY,
    ATTR_DIAGNOSIS_STATUS,
    ATTR_FRESHNESS,
    ATTR_METRIC,
    ATTR_QUEUE,
    ATTR_RANK,
    ATTR_RUN_ID,
    ATTR_STATISTIC,
    METRIC_DIAGNOSIS_ACTIVE,
    METRIC_RANK_GPU_MEMORY_USAGE,
    METRIC_RANK_GPU_UTILIZATION,
    METRIC_RANK_MEMORY_PEAK,
    METRIC_RANK_METRIC,
    METRIC_RANK_PROCESS_CPU_UTILIZATION,
    METRIC_RANK_PROCESS_MEMORY_USAGE,
    METRIC_RANK_TELEMETRY_DROPPED,
    METRIC_RUN_EXPORTED_RANKS,
    METRIC_RUN_FIRST_STEP,
    METRIC_RUN_FRESH,
    METRIC_RUN_GPU_MEMORY_USAGE,
    METRIC_RUN_GPU_POWER,
    METRIC_RUN_GPU_TEMPERATURE,
    METRIC_RUN_GPU_UTILIZATION,
    METRIC_RUN_HOST_CPU_UTILIZATION,
    METRIC_RUN_HOST_MEMORY_UTILIZATION,
    METRIC_RUN_MEMORY_PEAK,
    METRIC_RUN_PROCESS_CPU_UTILIZATION,
    METRIC_RUN_BADPUT_TIME,
    METRIC_RUN_METRIC_TIME,
    METRIC_RUN_PROCESS_MEMORY_USAGE,
    METRIC_RUN_STEPS,
    METRIC_RUN_TELEMETRY_DROPPED,
    METRIC_STEP_TIME,
    METRIC_WINDOW_LAST_STEP,
    METRIC_WINDOW_METRIC,
    METRIC_WINDOW_RANKS,
    METRIC_WINDOW_SKEW,
    METRIC_WINDOW_STEPS,
    QUEUE_NAMES,
    RESOURCE_STATISTICS,
    STATISTICS,
)

# The analysis's resource figures (`processor.resources.model`) -> the summary metric each feeds.
# Rank figures and node figures are separate maps: they share keys (`cpu_utilization`). Left
# out on purpose: capacities (GPU memory size, host CPUs and memory), which describe the
# machine rather than the run, and the allocator figures, which `traceml.run.memory.peak`
# already carries from the step spans.
RUN_RANK_FIGURE_METRICS: Mapping[str, str] = {
    res.CPU_UTILIZATION: METRIC_RUN_PROCESS_CPU_UTILIZATION,
    res.RSS_BYTES: METRIC_RUN_PROCESS_MEMORY_USAGE,
    res.GPU_UTILIZATION: METRIC_RUN_GPU_UTILIZATION,
    res.GPU_MEMORY_USED_BYTES: METRIC_RUN_GPU_MEMORY_USAGE,
    res.GPU_TEMPERATURE_C: METRIC_RUN_GPU_TEMPERATURE,
    res.GPU_POWER_W: METRIC_RUN_GPU_POWER,
}
RUN_NODE_FIGURE_METRICS: Mapping[str, str] = {
    res.HOST_CPU_UTILIZATION: METRIC_RUN_HOST_CPU_UTILIZATION,
    res.HOST_MEMORY_UTILIZATION: METRIC_RUN_HOST_MEMORY_UTILIZATION,
}
RANK_FIGURE_METRICS: Mapping[str, str] = {
    res.CPU_UTILIZATION: METRIC_RANK_PROCESS_CPU_UTILIZATION,
    res.RSS_BYTES: METRIC_RANK_PROCESS_MEMORY_USAGE,
    res.GPU_UTILIZATION: METRIC_RANK_GPU_UTILIZATION,
    res.GPU_MEMORY_USED_BYTES: METRIC_RANK_GPU_MEMORY_USAGE,
}

DEFAULT_RANK_SERIES_TOP_K = RANK_SERIES_TOP_K.default
"""Ranks per run exported by deviation score, beyond the culprits, victims, worst and
representative rank (`--rank-series-top-k`, `TRACEML_PROCESSOR_RANK_SERIES_TOP_K`)."""

# The attribute order each point below is built in; checked against the vocabulary at import
# so that a vocabulary change cannot silently shift values onto the wrong keys.
_BUILT_ORDER: Mapping[str, tuple[str, ...]] = {
    METRIC_WINDOW_METRIC: (ATTR_RUN_ID, ATTR_METRIC, ATTR_STATISTIC),
    METRIC_WINDOW_SKEW: (ATTR_RUN_ID, ATTR_METRIC),
    METRIC_RANK_METRIC: (ATTR_RUN_ID, ATTR_RANK, ATTR_METRIC),
    METRIC_WINDOW_STEPS: (ATTR_RUN_ID,),
    METRIC_WINDOW_RANKS: (ATTR_RUN_ID,),
    METRIC_WINDOW_LAST_STEP: (ATTR_RUN_ID,),
    METRIC_RUN_FIRST_STEP: (ATTR_RUN_ID,),
    METRIC_RUN_FRESH: (ATTR_RUN_ID, ATTR_FRESHNESS),
    METRIC_RANK_MEMORY_PEAK: (ATTR_RUN_ID, ATTR_RANK),
    METRIC_DIAGNOSIS_ACTIVE: (ATTR_RUN_ID, ATTR_DIAGNOSIS_KIND, ATTR_DIAGNOSIS_SEVERITY,
                              ATTR_DIAGNOSIS_STATUS, ATTR_CULPRIT_RANK),
    METRIC_RANK_TELEMETRY_DROPPED: (ATTR_RUN_ID, ATTR_RANK, ATTR_QUEUE),
    METRIC_RUN_TELEMETRY_DROPPED: (ATTR_RUN_ID, ATTR_QUEUE),
    METRIC_RUN_MEMORY_PEAK: (ATTR_RUN_ID, ATTR_STATISTIC),
    METRIC_RUN_EXPORTED_RANKS: (ATTR_RUN_ID,),
    METRIC_RUN_STEPS: (ATTR_RUN_ID,),
    METRIC_RUN_METRIC_TIME: (ATTR_RUN_ID, ATTR_METRIC),
    METRIC_RUN_BADPUT_TIME: (ATTR_RUN_ID, ATTR_BADPUT_CAUSE),
    **{name: (ATTR_RUN_ID, ATTR_STATISTIC)
       for name in (*RUN_RANK_FIGURE_METRICS.values(), *RUN_NODE_FIGURE_METRICS.values())},
    **{name: (ATTR_RUN_ID, ATTR_RANK) for name in RANK_FIGURE_METRICS.values()},
}
for _name, _order in _BUILT_ORDER.items():
    if SPECS[_name].attributes != _order:  # pragma: no cover - guards a vocabulary edit
        raise ImportError(f"summary metric {_name}: vocabulary attributes {SPECS[_name].attributes} "
                          f"no longer match the projection's {_order}")

EXPORTED_METRICS: tuple[str, ...] = tuple(metric for _, metric in PUBLIC_METRICS)
"""Window metric names re-exported as the `traceml.metric` attribute: the final summary's public
metrics, in its order, so the two surfaces cannot carry different sets."""

NO_RANK = ""
"""`traceml.diagnosis.culprit_rank` of an issue that names no rank (an absent Prometheus label)."""


def _point(name: str, values: tuple, value: float, exemplar: StepExemplar | None = None) -> MetricPoint:
    """Attributes zipped from the spec's own keys: correct by construction, no per-point check."""
    return MetricPoint(name, dict(zip(SPECS[name].attributes, values)), value, exemplar)


def _s(ms: float) -> float:
    return float(ms) / 1000.0


def rank_scores(window: StepTimeWindow) -> dict[int, float]:
    """Each measured rank's deviation score: how unlike the median rank it is.

    The largest distance, over the exported metrics, between the rank's window
    average and the median rank's, as a share of the median step time (the unit of
    the diagnosis scores). A straggler scores high through its longer phase, the
    ranks that wait for it through their longer visible phase, and the rank that
    arrives last through its shorter one. Ranks without a measured metric score 0.
    """
    step = window.metrics.get(METRIC_STEP_TIME)
    base = None if step is None or step.median is None else float(step.median)
    scores: dict[int, float] = {}
    if base is None:
        return scores
    for metric in EXPORTED_METRICS:
        stats = window.metrics.get(metric)
        if stats is None or stats.median is None:
            continue
        median = float(stats.median)
        for rank, value in stats.rank_values.items():
            score = finite_ratio(abs(float(value) - median), base)
            if score is not None and score > scores.get(rank, 0.0):
                scores[rank] = score
    return scores


def exported_ranks(analysis: StepTimeAnalysis, top_k: int = DEFAULT_RANK_SERIES_TOP_K,
                   universe: Sequence[int] = ()) -> tuple[int, ...]:
    """The ranks that get per-rank series, ascending; the one rule for which ranks matter.

    Always: the culprit and victim rank of every diagnosis issue, the worst and the
    representative (median) rank of step time. Then the `top_k` highest
    deviation scores (`rank_scores`; ties: lower rank first) among the window's
    ranks and `universe` (ranks known from memory or telemetry only score 0), so a
    run of at most `top_k` ranks exports every rank.
    """
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, not {top_k}")
    window = analysis.window
    chosen: set[int] = set()
    for issue in analysis.diagnosis.issues:
        chosen.update(r for r in (issue.culprit_rank, issue.victim_rank) if r is not None)
    step = window.metrics.get(METRIC_STEP_TIME)
    if step is not None:
        chosen.update(r for r in (step.worst_rank, step.representative_rank) if r is not None)
    scores = rank_scores(window)
    candidates = set(window.expected_ranks) | set(window.rank_facts) | set(universe)
    chosen.update(sorted(candidates, key=lambda r: (-scores.get(r, 0.0), r))[:top_k])
    return tuple(sorted(chosen))


def summary_metric_points(
    analysis: StepTimeAnalysis,
    *,
    freshness: str | None = None,
    memory: Sequence[RankMemory] = (),
    telemetry: Sequence[RankTelemetry] = (),
    first_step_stored: int | None = None,
    top_k: int = DEFAULT_RANK_SERIES_TOP_K,
    exemplars: Mapping[str, StepExemplar] | None = None,
    totals=None,
) -> tuple[MetricPoint, ...]:
    """Every summary point for one run, diagnosis points in issue order.

    Unmeasured statistics produce no point (absence, not 0); measured zeros do.
    `first_step_stored` (the run's lowest stored step, `RunTelemetry`) becomes
    `traceml.run.first_step`: above 0 for a run the processor first saw part-way.
    Per-rank points (`traceml.rank.*`) exist for `exported_ranks(analysis, top_k)`
    only; memory, resources and drops of every rank reach the `traceml.run.*` aggregates.
    `exemplars`: per Step Time metric, the window's worst step (`reporting.step_exemplars`),
    carried by that metric's window points, the straggler findings (step time's) and the
    counters of `totals` (a `StepTotals`; None: no counters).
    """
    exemplars = exemplars or {}
    window = analysis.window
    run = window.run_id
    points: list[MetricPoint] = []
    ranks = exported_ranks(analysis, top_k, universe=[m.global_rank for m in memory]
                           + [t.global_rank for t in telemetry])
    exported = frozenset(ranks)

    for metric in EXPORTED_METRICS:
        stats = window.metrics.get(metric)
        if stats is None:
            continue
        for statistic in ("median", "worst", "average"):
            value = getattr(stats, statistic)
            if value is not None:
                points.append(_point(METRIC_WINDOW_METRIC, (run, metric, statistic), _s(value),
                                     exemplars.get(metric)))
        if stats.skew is not None:
            points.append(_point(METRIC_WINDOW_SKEW, (run, metric), float(stats.skew)))

    rank_keys = SPECS[METRIC_RANK_METRIC].attributes
    for rank in ranks:
        facts = window.rank_facts.get(rank)
        if facts is None:
            continue
        label = str(rank)
        average = facts.average
        for metric in EXPORTED_METRICS:
            value = getattr(average, metric)
            if value is not None:
                points.append(MetricPoint(METRIC_RANK_METRIC, dict(zip(rank_keys, (run, label, metric))),
                                          value / 1000.0))

    points.append(_point(METRIC_WINDOW_STEPS, (run,), float(window.step_count)))
    points.append(_point(METRIC_WINDOW_RANKS, (run,), float(len(window.expected_ranks))))
    points.append(_point(METRIC_RUN_EXPORTED_RANKS, (run,), float(len(ranks))))
    if totals is not None and totals.steps:
        points.append(_point(METRIC_RUN_STEPS, (run,), float(totals.steps), exemplars.get(METRIC_STEP_TIME)))
        for metric, total_ms in totals.metric_ms.items():
            points.append(_point(METRIC_RUN_METRIC_TIME, (run, metric), _s(total_ms), exemplars.get(metric)))
        for cause, lost_s in totals.lost_s.items():
            points.append(_point(METRIC_RUN_BADPUT_TIME, (run, cause), float(lost_s), exemplars.get(METRIC_STEP_TIME)))
    if window.steps:
        points.append(_point(METRIC_WINDOW_LAST_STEP, (run,), float(window.steps[-1])))
    if first_step_stored is not None:
        points.append(_point(METRIC_RUN_FIRST_STEP, (run,), float(first_step_stored)))

    if freshness is not None:
        if freshness not in FRESHNESS_STATES:
            raise ValueError(f"unknown freshness {freshness!r}")
        for state in FRESHNESS_STATES:
            points.append(_point(METRIC_RUN_FRESH, (run, state), 1.0 if state == freshness else 0.0))

    peaks = []
    for m in sorted(memory, key=lambda m: m.global_rank):
        if m.peak_allocated_bytes is None:
            continue
        peaks.append(float(m.peak_allocated_bytes))
        if m.global_rank in exported:
            points.append(_point(METRIC_RANK_MEMORY_PEAK, (run, str(m.global_rank)), float(m.peak_allocated_bytes)))
    if peaks:
        median, worst, average = STATISTICS
        for statistic, value in ((median, statistics.median(peaks)), (worst, max(peaks)),
                                 (average, statistics.fmean(peaks))):
            points.append(_point(METRIC_RUN_MEMORY_PEAK, (run, statistic), float(value)))

    points += _resource_points(analysis, run, ranks)

    for issue in analysis.diagnosis.issues:
        culprit = NO_RANK if issue.culprit_rank is None else str(issue.culprit_rank)
        points.append(_point(METRIC_DIAGNOSIS_ACTIVE, (run, issue.kind, issue.severity, issue.status, culprit),
                             float(issue.score or 0.0),
                             exemplars.get(METRIC_STEP_TIME) if issue.kind in STRAGGLER_KINDS else None))

    totals = dict.fromkeys(QUEUE_NAMES, 0)
    for t in sorted(telemetry, key=lambda t: t.global_rank):
        for queue in QUEUE_NAMES:
            count = int(t.dropped.get(queue, 0))
            totals[queue] += count
            if t.global_rank in exported:
                points.append(_point(METRIC_RANK_TELEMETRY_DROPPED, (run, str(t.global_rank), queue), float(count)))
    if telemetry:
        for queue in QUEUE_NAMES:
            points.append(_point(METRIC_RUN_TELEMETRY_DROPPED, (run, queue), float(totals[queue])))
    return tuple(points)


def _resource_points(analysis: StepTimeAnalysis, run: str, ranks: Sequence[int]) -> list[MetricPoint]:
    """The resource figures: median and worst member per run, and the exported ranks' own.

    The statistics are the analysis's (`FigureStat`: the worst GPU is the least busy);
    a figure nobody measured sends no point, a measured zero does."""
    window = resource_window_of(analysis)
    points: list[MetricPoint] = []
    for stats, names in ((window.rank_stats, RUN_RANK_FIGURE_METRICS), (window.node_stats, RUN_NODE_FIGURE_METRICS)):
        for figure, name in names.items():
            stat = stats.get(figure)
            if stat is None:
                continue
            median, worst = RESOURCE_STATISTICS
            for statistic, value in ((median, stat.median), (worst, stat.worst)):
                if value is not None and math.isfinite(value):
                    points.append(_point(name, (run, statistic), float(value)))
    for rank in ranks:
        facts = window.ranks.get(rank)
        if facts is None:
            continue
        for figure, name in RANK_FIGURE_METRICS.items():
            value = facts.figures.get(figure)
            if value is not None and math.isfinite(value):
                points.append(_point(name, (run, str(rank)), float(value)))
    return points
