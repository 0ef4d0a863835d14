"""One outgoing metric value: the shape every series the processor exports is built from.

The summary projection (`reporting.summary_metrics`), the run monitor's and the
service's own series, and both surfaces that carry them (`prometheus_exposition`
and the OTLP push, through `summary_export`'s series grouping) all speak this
one type, so a point built on one side is read on the other without conversion.
Names and attribute keys are the wire vocabulary's (`SUMMARY_METRICS`,
`PROCESSOR_METRICS`); this module restates none of them. Standard library and
`traceml.schema` only: nothing here renders, exports or reads a store.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from traceml.schema import vocabulary as v

SPECS: Mapping[str, v.MetricSpec] = {s.name: s for s in (*v.SUMMARY_METRICS, *v.PROCESSOR_METRICS)}
"""Every series the processor exports, by name: the summary metrics and its own."""


@dataclass(frozen=True, slots=True)
class StepExemplar:
    """The step a point stands for: the window's worst step, as an exemplar (OpenMetrics on
    `/metrics` for counters, OTLP on the push for any point) leading to its span in a trace backend."""

    trace_id: str  # 32 lower-case hex digits (W3C / OTLP)
    span_id: str  # 16 hex digits: the step span (`traceml.step`) of that rank and step
    value: float  # the step's value of the point's metric, in the point's unit
    time: float  # unix seconds: the step's end
    rank: int
    step: int


@dataclass(frozen=True, slots=True)
class MetricPoint:
    """One gauge or counter value with its data-point attributes (keys in the spec's order), and
    the step it stands for when one is known (`exemplar`)."""

    name: str
    attributes: Mapping[str, str]
    value: float
    exemplar: StepExemplar | None = None

    def check(self) -> "MetricPoint":
        """Raise ValueError unless the name and attribute keys are exactly an exported spec's."""
        spec = SPECS.get(self.name)
        if spec is None:
            raise ValueError(f"{self.name!r} is not a metric the processor exports")
        if tuple(self.attributes) != spec.attributes:
            raise ValueError(f"{self.name}: attributes {tuple(self.attributes)} != {spec.attributes}")
        return self


def make_point(name: str, attributes: Mapping[str, str], value: float) -> MetricPoint:
    """A checked point, for callers that build their own (the projection builds from specs)."""
    return MetricPoint(name, dict(attributes), float(value)).check()
