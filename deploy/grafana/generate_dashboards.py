"""Generate the TraceML Grafana dashboards (JSON under deploy/grafana/dashboards/).

    .venv/bin/python deploy/grafana/generate_dashboards.py          # rewrite the JSON files
    .venv/bin/python deploy/grafana/generate_dashboards.py --check  # exit 1 if they are stale

Every metric and label name comes from `deploy/promql_names.py`, which derives
them from `traceml.schema.vocabulary`; tests/deploy checks the committed files
equal this output and runs every query against a real Prometheus.

Panels use the `${datasource}` variable (default: the provisioned datasource uid
below), so the files work under file provisioning, where `${DS_...}` inputs are
not resolved.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from grafana_foundation_sdk.builders import bargauge, common as common_b, dashboard as dash  # noqa: E402
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, timeseries  # noqa: E402
from grafana_foundation_sdk.cog.encoder import JSONEncoder  # noqa: E402
from grafana_foundation_sdk.models import common  # noqa: E402
from grafana_foundation_sdk.models.dashboard import (  # noqa: E402
    DataSourceRef, FieldColorModeId, Threshold, ThresholdsMode, VariableOption, VariableRefresh, VariableSort)

import promql_names as n  # noqa: E402
from generated import generator_main  # noqa: E402
from promql_names import L, M, sel  # noqa: E402

OUT = HERE / "dashboards"
DATASOURCE_UID = "traceml-prometheus"  # deploy/grafana/provisioning/datasources/prometheus.yml
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
RUN = "$run"
RANK = "~$rank"  # multi-value: Grafana expands to a regex alternation
TAGS = ["traceml"]


# --- small builders ---------------------------------------------------------------------------


def q(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DS)
    if legend:
        query = query.legend_format(legend)
    return query.instant() if instant else query.range()


def thresholds(*steps: tuple[float | None, str]) -> dash.ThresholdsConfig:
    return dash.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(
        [Threshold(value=value, color=color) for value, color in steps])


SHARE_THRESHOLDS = ((None, "green"), (n.WARN_SHARE, "orange"), (n.CRIT_SHARE, "red"))
GPU_UTIL_THRESHOLDS = ((None, "red"), (n.GPU_UTIL_CRIT, "orange"), (n.GPU_UTIL_WARN, "green"))
"""Below the low-GPU-utilisation rule's warn and crit figures (the diagnosis policy's own)."""


def kpi(title: str, expr: str, unit: str, description: str, legend: str = "",
        steps=((None, "blue"),), width: int = 4) -> stat.Panel:
    return (stat.Panel().title(title).description(description).datasource(DS).unit(unit)
            .with_target(q(expr, legend)).thresholds(thresholds(*steps))
            .graph_mode(common.BigValueGraphMode.AREA).color_mode(common.BigValueColorMode.VALUE)
            .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
            .height(5).span(width))


def series(title: str, description: str, unit: str, *targets: prometheus.Dataquery,
           stacked: bool = False, width: int = 12, steps=None) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).datasource(DS).unit(unit)
             .height(8).span(width).line_width(1).fill_opacity(10)
             .legend(common_b.VizLegendOptions().display_mode(common.LegendDisplayMode.TABLE)
                     .placement(common.LegendPlacement.BOTTOM).show_legend(True).calcs(["lastNotNull", "max"])))
    for target in targets:
        panel = panel.with_target(target)
    if stacked:
        panel = panel.stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(60)
    if steps:
        panel = panel.thresholds(thresholds(*steps)).thresholds_style(
            common_b.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.DASHED))
    return panel


def datasource_variable() -> dash.DatasourceVariable:
    return (dash.DatasourceVariable("datasource").label("Data source").type("prometheus")
            .current(VariableOption(selected=True, text="TraceML Prometheus", value=DATASOURCE_UID)))


def run_variable() -> dash.QueryVariable:
    return (dash.QueryVariable("run").label("Run").datasource(DS)
            .query(f"label_values({M.window_steps}, {L.run})")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_DESC))


def rank_variable() -> dash.QueryVariable:
    return (dash.QueryVariable("rank").label("Rank").datasource(DS)
            .query(f'label_values({M.rank_metric}{sel(run=RUN)}, {L.rank})')
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.NUMERICAL_ASC)
            .multi(True).include_all(True).all_value(".*"))


def window(metric: str, statistic: str) -> str:
    return f"{M.window_metric}{sel(run=RUN, metric=metric, statistic=statistic)}"


def per_step(metric: str) -> str:
    """Mean per-step time of `metric` (a value, or `~regex`) over the rate interval: the run's summed
    per-step medians over its counted steps; the counters carry the worst step as an exemplar."""
    rate = "[$__rate_interval]"
    return (f"rate({M.run_metric_time}{sel(run=RUN, metric=metric)}{rate}) / ignoring({L.metric}) group_left "
            f"rate({M.run_steps}{sel(run=RUN)}{rate})")


def per_rank_and_run(rank_name: str, run_name: str, worst_legend: str = "worst rank") -> list[prometheus.Dataquery]:
    """A resource figure of the selected ranks (exported ranks only) beside the run's median and
    worst rank (every rank)."""
    return [q(f"{rank_name}{sel(run=RUN, rank=RANK)}", f"rank {{{{{L.rank}}}}}"),
            q(f"{run_name}{sel(run=RUN, statistic=n.MEDIAN)}", "median rank", ref="B"),
            q(f"{run_name}{sel(run=RUN, statistic=n.WORST)}", worst_legend, ref="C")]


def run_statistics(run_name: str, member: str = "rank") -> list[prometheus.Dataquery]:
    return [q(f"{run_name}{sel(run=RUN, statistic=n.MEDIAN)}", f"median {member}"),
            q(f"{run_name}{sel(run=RUN, statistic=n.WORST)}", f"worst {member}", ref="B")]


# --- the run dashboard -----------------------------------------------------------------------


def run_dashboard() -> dash.Dashboard:
    verdict = (
        statetimeline.Panel().title("Verdict ribbon").datasource(DS)
        .description("The run's active diagnosis issues over time (the first row is the verdict the "
                     "summary reports). Value = the issue's score; colour: warn at "
                     f"{n.WARN_SHARE:g}, crit at {n.CRIT_SHARE:g}. Legend: kind, severity, status, culprit rank.")
        .with_target(q(f"{M.diagnosis_active}{sel(run=RUN)}",
                       f"{{{{{L.kind}}}}} {{{{{L.severity}}}}} ({{{{{L.status}}}}}) culprit={{{{{L.culprit}}}}}"))
        .thresholds(thresholds(*SHARE_THRESHOLDS))
        .color_scheme(dash.FieldColor().mode(FieldColorModeId.THRESHOLDS))
        .show_value(common.VisibilityMode.AUTO).merge_values(True).height(6).span(24))
    step_median = window(n.STEP_TIME, n.MEDIAN)
    d = (
        dash.Dashboard("TraceML run").uid("traceml-run").tags(TAGS).time("now-1h", "now").refresh("10s")
        .timezone("browser").editable()
        .description("One training run as the TraceML processor sees it: verdict, KPIs, per-rank phases, "
                     "stragglers, process, GPU and host resources, and memory. Values are over the live "
                     "window of aligned steps.")
        .with_variable(datasource_variable()).with_variable(run_variable()).with_variable(rank_variable())
        .with_row(dash.Row("Overview"))
        .with_panel(verdict)
        .with_panel(kpi("Step time (median rank)", step_median, "s",
                        "Median over ranks of the per-rank average step time in the window (selected clock)."))
        .with_panel(kpi("Throughput", f"1 / {step_median}", "none",
                        "Steps per second per rank: 1 / median step time. Multiply by the global batch "
                        "size for samples per second.", legend="steps/s", width=3))
        .with_panel(kpi("Worst-rank skew", f"{M.window_skew}{sel(run=RUN, metric=n.STEP_TIME)}", "percentunit",
                        "(worst rank - median rank) / median rank of step time. Above "
                        f"{n.WARN_SHARE:.0%} one rank holds the others back.", steps=SHARE_THRESHOLDS))
        .with_panel(kpi("Input share",
                        f"{window(n.INPUT_WAIT, n.MEDIAN)} / ignoring({L.metric}) {step_median}", "percentunit",
                        "Median-rank input wait / median-rank step time: time the step waits on the data "
                        f"loader. The input-bound rule warns at {n.WARN_SHARE:.0%}, crit at {n.CRIT_SHARE:.0%}.",
                        steps=SHARE_THRESHOLDS))
        .with_panel(kpi("Aligned steps", f"{M.window_steps}{sel(run=RUN)}", "none",
                        "Steps every rank has reported in the live window (crit needs at least 20).", width=3))
        .with_panel(kpi("Ranks", f"{M.window_ranks}{sel(run=RUN)}", "none", "Ranks in the run's rank universe.", width=3)
                    .with_target(q(f"{M.run_exported_ranks}{sel(run=RUN)}", "with per-rank series", ref="B")))
        .with_panel(kpi("Covered from step", f"{M.run_first_step}{sel(run=RUN)}", "none",
                        "Lowest step the processor holds for the run. Above 0: the processor first saw the "
                        "run part-way (it started after the job, or received the run after a rebalance), "
                        "so every figure covers the run from this step on.", steps=((None, "green"), (1, "orange")),
                        width=3))
        .with_panel(series("Step time by statistic", "Median, worst and average rank step time over time.", "s",
                           q(f"{M.window_metric}{sel(run=RUN, metric=n.STEP_TIME)}", f"{{{{{L.statistic}}}}}"),
                           width=8))
        .with_panel(series(
            "Time per step, linked to the worst step's trace",
            "Mean per-step time over the last rate interval (median over ranks) of step time and each phase, "
            "from the run's step counters. Exemplars (dots) are the window's worst step of each: hover for its "
            "trace and span id, click to open that step's span in the trace data source (Tempo or Jaeger, "
            "docs/deployment.md). Needs Prometheus with --enable-feature=exemplar-storage.", "s",
            q(per_step(n.STEP_TIME), "step time").exemplar(True),
            q(per_step("~" + n.regex(n.EXEMPLAR_PHASES)), f"{{{{{L.metric}}}}}", ref="B").exemplar(True),
            width=8))
        .with_panel(series(
            "Rank-time lost per cause",
            "Rank-seconds lost per second of the run, by badput-ledger cause (straggler wait, input stall, H2D, "
            "communication, drift): how many ranks' worth of time each cause costs. From the run's badput "
            "counters; exemplars are the window's worst step (click for its span). docs/DIAGNOSIS.md, "
            "\"Badput ledger\".", "none",
            q(f"sum by ({L.cause}) (rate({M.run_badput_time}{sel(run=RUN)}[$__rate_interval]))",
              f"{{{{{L.cause}}}}}").exemplar(True), stacked=True, width=8))
        .with_panel(series("Progress (aligned steps per second)",
                           "Rate at which the latest aligned step advances: the whole job's step rate, "
                           "held back by its slowest rank. Flat zero while the run is stalled.", "none",
                           q(f"deriv({M.window_last_step}{sel(run=RUN)}[$__rate_interval])", "steps/s"), width=8))
        .with_panel(
            statetimeline.Panel().title("Freshness").datasource(DS)
            .description("live: new steps within the bridge TTL; bridged: showing the last window while "
                         "data pauses; expired: no data for longer; cold: not enough data yet.")
            .with_target(q(f"{M.run_fresh}{sel(run=RUN)} == 1", f"{{{{{L.freshness}}}}}"))
            .show_value(common.VisibilityMode.NEVER).merge_values(True).height(8).span(8))
        .with_row(dash.Row("Per-rank phase breakdown"))
        .with_panel(
            bargauge.Panel().title("Phase time per rank (window average)").datasource(DS)
            .description("Average time per step of each phase on each selected rank. residual = step "
                         "time not covered by input, H2D or compute.")
            .with_target(q(f"{M.rank_metric}{sel(run=RUN, rank=RANK, metric='~' + n.regex(n.PHASES))}",
                           f"rank {{{{{L.rank}}}}} {{{{{L.metric}}}}}", instant=True))
            .unit("s").display_mode(common.BarGaugeDisplayMode.GRADIENT)
            .orientation(common.VizOrientation.HORIZONTAL)
            .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
            .height(10).span(12))
        .with_panel(series("Phases over time (stacked, selected ranks)",
                           "Per-rank phase averages stacked: the stack height is about the rank's step time.",
                           "s", q(f"{M.rank_metric}{sel(run=RUN, rank=RANK, metric='~' + n.regex(n.PHASES))}",
                                  f"rank {{{{{L.rank}}}}} {{{{{L.metric}}}}}"), stacked=True))
        .with_row(dash.Row("Stragglers"))
        .with_panel(series(
            "Rank step time / median rank",
            "Each rank's average step time divided by the median rank's; a rank far from 1.0 "
            "is slow (>1) or waits for the others (<1).", "none",
            q(f"{M.rank_metric}{sel(run=RUN, rank=RANK, metric=n.STEP_TIME)}"
              f" / on({L.run}, {L.metric}) group_left() {window(n.STEP_TIME, n.MEDIAN)}",
              f"rank {{{{{L.rank}}}}}")))
        .with_panel(series(
            "Worst-rank skew by phase",
            "(worst - median) / median per phase; the straggler rule compares the visible phase "
            "(backward under DDP) across ranks.", "percentunit",
            q(f"{M.window_skew}{sel(run=RUN, metric='~' + n.regex((n.STEP_TIME, *n.PHASES)))}",
              f"{{{{{L.metric}}}}}"), steps=SHARE_THRESHOLDS))
        .with_panel(series(
            "Straggler score and culprit", "Score of active straggler findings; the legend names the "
            "culprit rank (the one the others wait for).", "percentunit",
            q(f"{M.diagnosis_active}{sel(run=RUN, kind='~' + n.regex(n.STRAGGLER_KINDS))}",
              f"{{{{{L.kind}}}}} culprit={{{{{L.culprit}}}}}"), width=24, steps=SHARE_THRESHOLDS))
        .with_row(dash.Row("Resources"))
        .with_panel(series("Process CPU per rank",
                           "Mean CPU utilisation of each selected rank's process over the window (CPU time / "
                           "elapsed time x the CPUs available to it), beside the run's median and busiest rank. "
                           "Absent when the ranks send no resource samples.", "percentunit",
                           *per_rank_and_run(M.rank_process_cpu, M.run_process_cpu, "busiest rank")))
        .with_panel(series("Process memory (RSS) per rank",
                           "Highest resident set size of each selected rank's process over the window, beside "
                           "the run's median and largest rank. A line that keeps rising is what the memory "
                           "creep finding looks for.", "bytes",
                           *per_rank_and_run(M.rank_process_memory, M.run_process_memory, "largest rank")))
        .with_panel(series("GPU utilisation per rank",
                           "Mean fraction of the window a kernel ran on each selected rank's GPU (NVML or "
                           "DCGM), beside the run's median rank and least busy rank. The low GPU utilisation "
                           f"finding warns below {n.GPU_UTIL_WARN:.0%} (crit below {n.GPU_UTIL_CRIT:.0%}) when "
                           "no input or H2D finding explains it. Absent without a GPU or NVML, never 0.",
                           "percentunit",
                           *per_rank_and_run(M.rank_gpu_utilization, M.run_gpu_utilization, "least busy rank"),
                           steps=GPU_UTIL_THRESHOLDS))
        .with_panel(series("GPU memory in use per rank",
                           "Highest device memory in use on each selected rank's GPU over the window (every "
                           "process's, as NVML counts it), beside the run's median and largest rank.", "bytes",
                           *per_rank_and_run(M.rank_gpu_memory, M.run_gpu_memory, "largest rank")))
        .with_panel(series("GPU temperature", "Highest GPU temperature over the window: the run's median "
                           "and hottest rank.", "celsius", *run_statistics(M.run_gpu_temperature), width=8))
        .with_panel(series("GPU power", "Mean GPU power draw over the window: the run's median and most "
                           "drawing rank.", "watt", *run_statistics(M.run_gpu_power), width=8))
        .with_panel(series("Host CPU and memory",
                           "Mean busy fraction of the CPUs and highest memory used / total of the run's hosts "
                           "(from each node's local rank 0, or the Collector's hostmetrics receiver): the "
                           "median and busiest host. Saturated CPUs beside an input finding mean more "
                           "DataLoader workers will not help.", "percentunit",
                           q(f"{M.run_host_cpu}{sel(run=RUN)}", f"CPU {{{{{L.statistic}}}}} host"),
                           q(f"{M.run_host_memory}{sel(run=RUN)}", f"memory {{{{{L.statistic}}}}} host", ref="B"),
                           width=8))
        .with_panel(series(
            "Resource findings", "Score of the active findings that read resource evidence: memory creep "
            "(growth over the level at its onset; the legend names the rank when one rank leaks), low GPU "
            "utilisation (1 - the median rank's GPU utilisation) and the input findings, whose evidence says "
            "whether their hosts' CPUs were saturated (final_summary.json, the card).", "percentunit",
            q(f"{M.diagnosis_active}{sel(run=RUN, kind='~' + n.regex(n.RESOURCE_FINDINGS))}",
              f"{{{{{L.kind}}}}} {{{{{L.severity}}}}} culprit={{{{{L.culprit}}}}}"), width=24))
        .with_row(dash.Row("Memory and telemetry"))
        .with_panel(series("Peak memory per rank", "Peak allocated bytes of the latest step on each rank's "
                           "device (CUDA only: absent on CPU ranks, never shown as 0).", "bytes",
                           q(f"{M.rank_memory_peak}{sel(run=RUN, rank=RANK)}", f"rank {{{{{L.rank}}}}}"),
                           q(f"{M.run_memory_peak}{sel(run=RUN, statistic=n.WORST)}", "worst of all ranks",
                             ref="B")))
        .with_panel(series("Telemetry dropped on the training side",
                           "Records all ranks reported dropped from their bounded queues, summed per queue "
                           "(every rank, also those without per-rank series; a non-zero value means the "
                           "analysis is missing some steps).", "none",
                           q(f"{M.run_dropped}{sel(run=RUN)}", f"all ranks {{{{{L.queue}}}}}"),
                           q(f"{M.rank_dropped}{sel(run=RUN, rank=RANK)}", f"rank {{{{{L.rank}}}}} {{{{{L.queue}}}}}",
                             ref="B")))
    )
    return d


# --- the processor dashboard ---------------------------------------------------------------


def processor_dashboard() -> dash.Dashboard:
    rejected = sel(outcome=n.OUTCOME_REJECTED)
    return (
        dash.Dashboard("TraceML processor").uid("traceml-processor").tags(TAGS).time("now-1h", "now")
        .refresh("10s").timezone("browser").editable()
        .description("Health of the traceml-processor replicas: scrape status, ingest outcomes, rejects, "
                     "tracked runs, analysis cost and lag.")
        .with_variable(datasource_variable())
        .with_panel(kpi("Processors up", f'sum(up{{job="{n.PROCESSOR_JOB}"}})', "none",
                        "Processor replicas Prometheus scrapes successfully.", steps=((None, "red"), (1, "green")),
                        width=6))
        .with_panel(kpi("Runs tracked", f"sum({M.runs})", "none", "Runs the processors currently watch.", width=6))
        .with_panel(kpi("Records accepted / s", f'sum(rate({M.records}{sel(outcome="accepted")}[$__rate_interval]))',
                        "none", "Spans and metric points committed to SQLite per second.", width=6))
        .with_panel(kpi("Records rejected (range)", f"sum(increase({M.records}{rejected}[$__range])) or vector(0)",
                        "none", "Records refused (bad or incomplete data) over the dashboard range; the "
                        "processor logs the reasons.", steps=((None, "green"), (1, "red")), width=6))
        .with_panel(series("Ingest outcomes / s", "Records per second by outcome and signal.", "none",
                           q(f"sum by ({L.outcome}, {L.signal}) (rate({M.records}[$__rate_interval]))",
                             f"{{{{{L.outcome}}}}} {{{{{L.signal}}}}}"), stacked=True))
        .with_panel(series("Run lag", "Seconds since the newest step end received per open run; growing "
                           "lag means a stalled job or a broken pipeline.", "s",
                           q(f"{M.run_lag}", f"{{{{{L.run}}}}} {{{{instance}}}}")))
        .with_panel(series("Live analysis duration", "Time of the latest live analysis refresh per run.", "s",
                           q(f"{M.analysis_duration}", f"{{{{{L.run}}}}} {{{{instance}}}}")))
        .with_panel(series("Runs per replica", "Runs tracked by each processor replica (scale-out: runs are "
                           "sharded by run id).", "none", q(f"{M.runs}", "{{instance}}")))
        .with_panel(series("Summary export failures", "Pushes of the summary metrics to the OTLP export "
                           "endpoint that failed after their retries, per replica (always 0 without "
                           "--export-endpoint); the downstream backend misses those intervals.", "none",
                           q(f"increase({M.export_failures}[$__rate_interval])", "{{instance}}"),
                           steps=((None, "green"), (1, "red"))))
        .with_panel(series("Export requests / s", "OTLP export requests the receivers answered per second, by "
                           "outcome, signal and, when refused, reason (unauthenticated, over_limit, backpressure, "
                           "unavailable, ...): refusals a client retries show up here before any record is lost.",
                           "none", q(f"sum by ({L.outcome}, {L.signal}, {L.reason}) (rate({M.requests}[$__rate_interval]))",
                                     f"{{{{{L.outcome}}}}} {{{{{L.signal}}}}} {{{{{L.reason}}}}}"), stacked=True))
        .with_panel(series("HTTP connection events / s", "What the HTTP fronts (OTLP/HTTP, web view, /metrics) did "
                           "to connections they could not serve as asked, per second, by event: refused at the "
                           "connection cap, or closed there for making the least progress (idle, slow head, slow "
                           "body), "
                           "header/body/write timeouts (slow or stalled clients), framing errors, hang-ups, failed "
                           "TLS handshakes, accept out of descriptors.", "none",
                           q(f"sum by ({L.connection_event}) (rate({M.http_connection_events}[$__rate_interval]))",
                             f"{{{{{L.connection_event}}}}}"), stacked=True))
        .with_panel(series("Series left out", "Series the latest scrape left out because the series limit "
                           "(--max-series) was reached, per replica: whole runs, the most recently first seen "
                           "first. Always 0 unless the processor tracks very many runs.", "none",
                           q(f"{M.series_left_out}", "{{instance}}"), steps=((None, "green"), (1, "red"))))
    )


DASHBOARDS = {"traceml-run.json": run_dashboard, "traceml-processor.json": processor_dashboard}


def render(builder: dash.Dashboard) -> str:
    model = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    for number, panel in enumerate(model["panels"], start=1):  # stable, unique panel ids
        panel["id"] = number
    return json.dumps(model, sort_keys=True, indent=2) + "\n"


def generate() -> dict[str, str]:
    return {name: render(make()) for name, make in DASHBOARDS.items()}


def main(argv=None) -> int:
    return generator_main(__doc__.splitlines()[0], generate, OUT, "dashboards", "deploy/grafana/generate_dashboards.py", argv)


if __name__ == "__main__":
    sys.exit(main())
