"""Pure projection of a `StepTimeAnalysis` to low-cardinality summary metric points.

Only the names and attribute keys of `schema.vocabulary.SUMMARY_METRICS` are
used, and no point carries a step attribute. Renderers (Prometheus text, OTLP)
take these points as they are; they decide nothing.

Attribute values are strings (ranks too), so one label value reads the same in
Prometheus and in OTLP. Time values are converted to seconds (`s`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from traceml.processor.reporting.inputs import RankMemory, RankTelemetry
from traceml.processor.step_time.model import FRESHNESS_STATES, StepTimeAnalysis
from traceml.schema.vocabulary import (
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
    QUEUE_NAMES,
    SUMMARY_METRICS,
    MetricSpec,
)

WINDOW_METRIC = "traceml.window.metric"
WINDOW_SKEW = "traceml.window.skew"
RANK_METRIC = "traceml.rank.metric"
WINDOW_STEPS = "traceml.window.steps"
WINDOW_RANKS = "traceml.window.ranks"
WINDOW_LAST_STEP = "traceml.window.last_step"
RUN_FIRST_STEP = "traceml.run.first_step"
RUN_FRESH = "traceml.run.fresh"
RANK_MEMORY_PEAK = "traceml.rank.memory.peak"
DIAGNOSIS_ACTIVE = "traceml.diagnosis.active"
RANK_TELEMETRY_DROPPED = "traceml.rank.telemetry.dropped"

SPECS: Mapping[str, MetricSpec] = {spec.name: spec for spec in SUMMARY_METRICS}

# The attribute order each point below is built in; checked against the vocabulary at import
# so that a vocabulary change cannot silently shift values onto the wrong keys.
_BUILT_ORDER: Mapping[str, tuple[str, ...]] = {
    WINDOW_METRIC: (ATTR_RUN_ID, ATTR_METRIC, ATTR_STATISTIC),
    WINDOW_SKEW: (ATTR_RUN_ID, ATTR_METRIC),
    RANK_METRIC: (ATTR_RUN_ID, ATTR_RANK, ATTR_METRIC),
    WINDOW_STEPS: (ATTR_RUN_ID,),
    WINDOW_RANKS: (ATTR_RUN_ID,),
    WINDOW_LAST_STEP: (ATTR_RUN_ID,),
    RUN_FIRST_STEP: (ATTR_RUN_ID,),
    RUN_FRESH: (ATTR_RUN_ID, ATTR_FRESHNESS),
    RANK_MEMORY_PEAK: (ATTR_RUN_ID, ATTR_RANK),
    DIAGNOSIS_ACTIVE: (ATTR_RUN_ID, ATTR_DIAGNOSIS_KIND, ATTR_DIAGNOSIS_SEVERITY, ATTR_DIAGNOSIS_STATUS,
                       ATTR_CULPRIT_RANK),
    RANK_TELEMETRY_DROPPED: (ATTR_RUN_ID, ATTR_RANK, ATTR_QUEUE),
}
for _name, _order in _BUILT_ORDER.items():
    if SPECS[_name].attributes != _order:  # pragma: no cover - guards a vocabulary edit
        raise ImportError(f"summary metric {_name}: vocabulary attributes {SPECS[_name].attributes} "
                          f"no longer match the projection's {_order}")

# Window metric names re-exported as the `traceml.metric` attribute (canonical names).
EXPORTED_METRICS: tuple[str, ...] = (
    "step_time", "input_wait", "traced_step_time", "step_time_cpu", "step_time_gpu",
    "traced_step_time_cpu", "traced_step_time_gpu", "dataloader_fetch_cpu", "h2d",
    "forward", "backward", "optimizer_step", "compute", "residual",
)

NO_RANK = ""
"""`traceml.diagnosis.culprit_rank` of an issue that names no rank (an absent Prometheus label)."""


@dataclass(frozen=True, slots=True)
class MetricPoint:
    """One gauge or counter value with its data-point attributes (keys in the spec's order)."""

    name: str
    attributes: Mapping[str, str]
    value: float

    def check(self) -> "MetricPoint":
        """Raise ValueError unless the name and attribute keys are exactly a SUMMARY_METRICS spec's."""
        spec = SPECS.get(self.name)
        if spec is None:
            raise ValueError(f"{self.name!r} is not a summary metric")
        if tuple(self.attributes) != spec.attributes:
            raise ValueError(f"{self.name}: attributes {tuple(self.attributes)} != {spec.attributes}")
        return self


def make_point(name: str, attributes: Mapping[str, str], value: float) -> MetricPoint:
    """A checked point, for callers that build their own (the projection builds from specs)."""
    return MetricPoint(name, dict(attributes), float(value)).check()


def _point(name: str, values: tuple, value: float) -> MetricPoint:
    """Attributes zipped from the spec's own keys: correct by construction, no per-point check."""
    return MetricPoint(name, dict(zip(SPECS[name].attributes, values)), value)


def _s(ms: float) -> float:
    return float(ms) / 1000.0


def summary_metric_points(
    analysis: StepTimeAnalysis,
    *,
    freshness: str | None = None,
    memory: Sequence[RankMemory] = (),
    telemetry: Sequence[RankTelemetry] = (),
    first_step_stored: int | None = None,
) -> tuple[MetricPoint, ...]:
    """Every summary point for one run, diagnosis points in issue order.

    Unmeasured statistics produce no point (absence, not 0); measured zeros do.
    `first_step_stored` (the run's lowest stored step, `RunTelemetry`) becomes
    `traceml.run.first_step`: above 0 for a run the processor first saw part-way.
    """
    window = analysis.window
    run = window.run_id
    points: list[MetricPoint] = []

    for metric in EXPORTED_METRICS:
        stats = window.metrics.get(metric)
        if stats is None:
            continue
        for statistic in ("median", "worst", "average"):
            value = getattr(stats, statistic)
            if value is not None:
                points.append(_point(WINDOW_METRIC, (run, metric, statistic), _s(value)))
        if stats.skew is not None:
            points.append(_point(WINDOW_SKEW, (run, metric), float(stats.skew)))

    rank_keys = SPECS[RANK_METRIC].attributes
    for rank in window.expected_ranks:
        facts = window.rank_facts.get(rank)
        if facts is None:
            continue
        label = str(rank)
        average = facts.average
        for metric in EXPORTED_METRICS:
            value = getattr(average, metric)
            if value is not None:
                points.append(MetricPoint(RANK_METRIC, dict(zip(rank_keys, (run, label, metric))),
                                          value / 1000.0))

    points.append(_point(WINDOW_STEPS, (run,), float(window.step_count)))
    points.append(_point(WINDOW_RANKS, (run,), float(len(window.expected_ranks))))
    if window.steps:
        points.append(_point(WINDOW_LAST_STEP, (run,), float(window.steps[-1])))
    if first_step_stored is not None:
        points.append(_point(RUN_FIRST_STEP, (run,), float(first_step_stored)))

    if freshness is not None:
        if freshness not in FRESHNESS_STATES:
            raise ValueError(f"unknown freshness {freshness!r}")
        for state in FRESHNESS_STATES:
            points.append(_point(RUN_FRESH, (run, state), 1.0 if state == freshness else 0.0))

    for m in sorted(memory, key=lambda m: m.global_rank):
        if m.peak_allocated_bytes is not None:
            points.append(_point(RANK_MEMORY_PEAK, (run, str(m.global_rank)), float(m.peak_allocated_bytes)))

    for issue in analysis.diagnosis.issues:
        culprit = NO_RANK if issue.culprit_rank is None else str(issue.culprit_rank)
        points.append(_point(DIAGNOSIS_ACTIVE, (run, issue.kind, issue.severity, issue.status, culprit),
                             float(issue.score or 0.0)))

    for t in sorted(telemetry, key=lambda t: t.global_rank):
        for queue in QUEUE_NAMES:
            count = int(t.dropped.get(queue, 0))
            points.append(_point(RANK_TELEMETRY_DROPPED, (run, str(t.global_rank), queue), float(count)))
    return tuple(points)
