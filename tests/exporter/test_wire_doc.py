"""docs/wire-format.md documents every name the exporter can emit, as schema/vocabulary.py declares it."""
from __future__ import annotations

import pathlib

from traceml.schema import vocabulary as v

DOC = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "wire-format.md").read_text()


def test_every_emitted_name_is_documented():
    names = [v.SPAN_STEP, v.SPAN_RUN_END, v.SPAN_PHASE_PREFIX, v.INSTRUMENTATION_SCOPE, v.DEFAULT_SERVICE_NAME,
             v.RES_SERVICE_NAME, v.RES_SERVICE_INSTANCE_ID, v.RES_HOST_NAME, v.ATTR_RUN_ID, v.ATTR_RANK,
             v.ATTR_LOCAL_RANK, v.ATTR_NODE_RANK, v.ATTR_WORLD_SIZE, v.ATTR_LOCAL_WORLD_SIZE,
             v.ATTR_TRAINING_STRATEGY, v.ATTR_STEP, v.ATTR_DEVICE, v.ATTR_PHASE, v.ATTR_STEPS_COMPLETED,
             v.ATTR_MEMORY_PEAK_ALLOCATED, v.ATTR_MEMORY_PEAK_RESERVED, *v.LEGACY_MEMORY_METRICS,
             v.ATTR_QUEUE, v.ATTR_SIGNAL, v.ATTR_RUN_END_EXPORT_FAILURES, v.ATTR_RUN_END_EXPORT_RETRIES,
             *v.RAW_EVENTS, *v.QUEUE_NAMES, *v.SIGNALS, *v.TRAINING_STRATEGIES,
             *(v.run_end_dropped_attribute(q) for q in v.QUEUE_NAMES),
             *(f"{v.EVENT_ATTR_PREFIX}<phase>.{f}" for f in v.EVENT_FIELDS),
             *(f"{v.LEGACY_EVENT_ATTR_PREFIX}<event>.{f}" for f in v.LEGACY_EVENT_FIELDS),
             *(v.raw_event_key(e) for e in v.RAW_EVENTS), *v.RAW_EVENT_TO_METRIC.values(),
             *(v.phase_name(e) for e in v.RAW_EVENTS), *v.EVENT_FIELD_UNITS.values(), v.LEGACY_DURATION_UNIT,
             v.LEGACY_ATTR_PHASE, v.RES_TELEMETRY_SDK_NAME, v.RES_TELEMETRY_SDK_LANGUAGE,
             v.RES_TELEMETRY_SDK_VERSION, v.RES_TELEMETRY_DISTRO_NAME, v.RES_TELEMETRY_DISTRO_VERSION,
             v.TELEMETRY_SDK_NAME, v.TELEMETRY_SDK_LANGUAGE, v.TELEMETRY_DISTRO_NAME,
             *v.RESOURCE_ALIASES]
    missing = [n for n in names if f"`{n}" not in DOC]
    assert missing == []


def test_training_metrics_are_documented_with_unit_and_description():
    metrics_section = DOC.split("\n## Metrics", 1)[1].split("\n## ", 1)[0]
    for spec in v.TRAINING_METRICS:
        row = next((line for line in metrics_section.splitlines() if line.startswith(f"| `{spec.name}` |")), None)
        assert row is not None, spec.name
        assert f"`{spec.unit}`" in row and spec.description in row, spec.name


def test_the_documented_step_span_example_keys_are_what_the_builder_makes():
    """The doc's examples are the vocabulary's own output, not a hand-typed spelling."""
    assert f"`{v.event_attribute(v.RAW_FORWARD, v.EVENT_FIELD_CPU)}`" in DOC
    assert f"`{v.legacy_event_attribute(v.RAW_FORWARD, 'cpu_ms')}`" in DOC
    for raw in v.RAW_EVENTS:  # the phase table: each phase name and its child span's name
        assert f"| `{raw}` | `{v.phase_name(raw)}` |" in DOC
        assert raw == v.RAW_STEP_TIME or f"`{v.SPAN_PHASE_PREFIX}{v.phase_name(raw)}`" in DOC
