"""Prometheus names of the processor's metrics, derived from the wire vocabulary (never typed).

The dashboard generator (`deploy/grafana/generate_dashboards.py`) and the alert
rule generator (`deploy/prometheus/generate_rules.py`) build every PromQL string
from these objects, so a vocabulary rename changes the generated files and the
"committed == generated" tests point at them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from traceml.processor.diagnosis.policy import DEFAULT_POLICY
from traceml.processor.metric_point import SPECS
from traceml.processor.reporting.step_exemplars import EXEMPLAR_METRICS
from traceml.processor.settings import REPEAT_OFFENDER_RUNS as REPEAT_OFFENDER_RUNS_SETTING
from traceml.processor.step_time.model import FRESHNESS_STATES
from traceml.schema import diagnosis as d
from traceml.schema import vocabulary as v

TRAINING_SPECS: Mapping[str, v.MetricSpec] = {s.name: s for s in v.TRAINING_METRICS}

# Prometheus job that scrapes the processor(s) (deploy/prometheus/prometheus.yml).
PROCESSOR_JOB = "traceml-processor"


def metric(otel_name: str) -> str:
    """Prometheus name of a re-exported metric; KeyError for a name the processor does not export."""
    return SPECS[otel_name].prometheus_name


def label(attribute_key: str) -> str:
    return v.prometheus_label(attribute_key)


@dataclass(frozen=True)
class Names:
    window_metric: str = metric(v.METRIC_WINDOW_METRIC)
    window_skew: str = metric(v.METRIC_WINDOW_SKEW)
    rank_metric: str = metric(v.METRIC_RANK_METRIC)
    window_steps: str = metric(v.METRIC_WINDOW_STEPS)
    window_ranks: str = metric(v.METRIC_WINDOW_RANKS)
    window_last_step: str = metric(v.METRIC_WINDOW_LAST_STEP)
    run_first_step: str = metric(v.METRIC_RUN_FIRST_STEP)
    run_fresh: str = metric(v.METRIC_RUN_FRESH)
    rank_memory_peak: str = metric(v.METRIC_RANK_MEMORY_PEAK)
    diagnosis_active: str = metric(v.METRIC_DIAGNOSIS_ACTIVE)
    rank_dropped: str = metric(v.METRIC_RANK_TELEMETRY_DROPPED)
    run_dropped: str = metric(v.METRIC_RUN_TELEMETRY_DROPPED)
    run_memory_peak: str = metric(v.METRIC_RUN_MEMORY_PEAK)
    run_exported_ranks: str = metric(v.METRIC_RUN_EXPORTED_RANKS)
    run_process_cpu: str = metric(v.METRIC_RUN_PROCESS_CPU_UTILIZATION)
    run_process_memory: str = metric(v.METRIC_RUN_PROCESS_MEMORY_USAGE)
    run_gpu_utilization: str = metric(v.METRIC_RUN_GPU_UTILIZATION)
    run_gpu_memory: str = metric(v.METRIC_RUN_GPU_MEMORY_USAGE)
    run_gpu_temperature: str = metric(v.METRIC_RUN_GPU_TEMPERATURE)
    run_gpu_power: str = metric(v.METRIC_RUN_GPU_POWER)
    run_host_cpu: str = metric(v.METRIC_RUN_HOST_CPU_UTILIZATION)
    run_host_memory: str = metric(v.METRIC_RUN_HOST_MEMORY_UTILIZATION)
    rank_process_cpu: str = metric(v.METRIC_RANK_PROCESS_CPU_UTILIZATION)
    rank_process_memory: str = metric(v.METRIC_RANK_PROCESS_MEMORY_USAGE)
    rank_gpu_utilization: str = metric(v.METRIC_RANK_GPU_UTILIZATION)
    rank_gpu_memory: str = metric(v.METRIC_RANK_GPU_MEMORY_USAGE)
    records: str = metric(v.METRIC_PROCESSOR_RECORDS)
    requests: str = metric(v.METRIC_PROCESSOR_REQUESTS)
    http_connection_events: str = metric(v.METRIC_PROCESSOR_HTTP_CONNECTION_EVENTS)
    analysis_duration: str = metric(v.METRIC_PROCESSOR_ANALYSIS_DURATION)
    run_lag: str = metric(v.METRIC_PROCESSOR_RUN_LAG)
    runs: str = metric(v.METRIC_PROCESSOR_RUNS)
    export_failures: str = metric(v.METRIC_PROCESSOR_EXPORT_FAILURES)
    series_left_out: str = metric(v.METRIC_PROCESSOR_SERIES_LEFT_OUT)
    run_steps: str = metric(v.METRIC_RUN_STEPS)
    run_metric_time: str = metric(v.METRIC_RUN_METRIC_TIME)
    run_badput_time: str = metric(v.METRIC_RUN_BADPUT_TIME)
    fleet_flagged_runs: str = metric(v.METRIC_FLEET_HOST_FLAGGED_RUNS)
    fleet_runs: str = metric(v.METRIC_FLEET_HOST_RUNS)
    fleet_lost_time: str = metric(v.METRIC_FLEET_HOST_LOST_TIME)


@dataclass(frozen=True)
class Labels:
    run: str = label(v.ATTR_RUN_ID)
    rank: str = label(v.ATTR_RANK)
    metric: str = label(v.ATTR_METRIC)
    statistic: str = label(v.ATTR_STATISTIC)
    kind: str = label(v.ATTR_DIAGNOSIS_KIND)
    severity: str = label(v.ATTR_DIAGNOSIS_SEVERITY)
    status: str = label(v.ATTR_DIAGNOSIS_STATUS)
    culprit: str = label(v.ATTR_CULPRIT_RANK)
    freshness: str = label(v.ATTR_FRESHNESS)
    outcome: str = label(v.ATTR_OUTCOME)
    signal: str = label(v.ATTR_SIGNAL)
    queue: str = label(v.ATTR_QUEUE)
    reason: str = label(v.ATTR_REASON)
    connection_event: str = label(v.ATTR_CONNECTION_EVENT)
    step: str = label(v.ATTR_STEP)
    host: str = label(v.ATTR_HOST)
    cause: str = label(v.ATTR_BADPUT_CAUSE)


M = Names()
L = Labels()

# Values of labels used in queries (from the schema, never typed here).
STEP_TIME = v.METRIC_STEP_TIME
INPUT_WAIT = v.METRIC_INPUT_WAIT
BACKWARD = v.METRIC_BACKWARD
PHASES: tuple[str, ...] = (v.METRIC_INPUT_WAIT, v.METRIC_H2D, v.METRIC_FORWARD, v.METRIC_BACKWARD,
                           v.METRIC_OPTIMIZER_STEP, v.METRIC_RESIDUAL)
EXEMPLAR_PHASES: tuple[str, ...] = tuple(m for m in EXEMPLAR_METRICS if m != v.METRIC_STEP_TIME)
"""The phases with step counters (`traceml_run_metric_time_seconds_total`), which carry exemplars."""
MEDIAN, WORST, AVERAGE = v.STATISTICS
STRAGGLER_KINDS = d.STRAGGLER_KINDS
MEMORY_CREEP, LOW_GPU_UTILIZATION = d.MEMORY_CREEP, d.LOW_GPU_UTILIZATION
RESOURCE_FINDINGS: tuple[str, ...] = (d.MEMORY_CREEP, d.LOW_GPU_UTILIZATION, d.INPUT_BOUND, d.INPUT_STRAGGLER)
"""The findings that read resource evidence: memory creep, idle GPUs, and the input findings,
which say whether their hosts' CPUs were saturated."""
SEVERITY_CRIT, SEVERITY_WARN = d.SEVERITY_CRIT, d.SEVERITY_WARN
FRESHNESS = FRESHNESS_STATES
OUTCOME_REJECTED = "rejected"
WARN_SHARE = DEFAULT_POLICY.warn_share
CRIT_SHARE = DEFAULT_POLICY.crit_share
GPU_UTIL_WARN = DEFAULT_POLICY.gpu_util_warn
GPU_UTIL_CRIT = DEFAULT_POLICY.gpu_util_crit
REPEAT_OFFENDER_RUNS = REPEAT_OFFENDER_RUNS_SETTING.default
"""K of the repeat-offender rule: the alert's threshold on the runs flagged across replicas."""


def sel(**matchers: str) -> str:
    """`{a="x",b=~"y"}` from keyword matchers; a value starting with `~` is a regex match."""
    parts = []
    for key, value in matchers.items():
        name = getattr(L, key, key)
        if value.startswith("~"):
            parts.append(f'{name}=~"{value[1:]}"')
        else:
            parts.append(f'{name}="{value}"')
    return "{" + ",".join(parts) + "}"


def regex(values) -> str:
    return "|".join(values)
