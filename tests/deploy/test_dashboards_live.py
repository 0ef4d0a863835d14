"""Every dashboard query returns data from a real Prometheus scraping a processor fed by real training.

The processor runs from the Dockerfile's own ENTRYPOINT + CMD (loopback ports, a
temp /data); Prometheus (Debian binary) scrapes it every second with the stack's
job name and loads the generated alert rules. Two gloo ranks train with the real
instrumentation and exporter (tests/processor/test_end_to_end.py's helper; rank 0
has a slow data loader, so an input straggler is diagnosed). Only the GPU is
faked: CPU torch has no allocator peaks, so per-step CUDA memory gauges for the
same run are sent as OTLP the way the exporter does, and so are resource samples of
both ranks (process, GPU and host, as the resource sampler sends them) while they train.
One malformed span makes the reject counter exist. Then each panel query, variables substituted as Grafana
would, is run as Grafana runs it (range or instant) and must return series.
"""
from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from tests.deploy.deploy_files import PROMETHEUS_DIR, EntrypointProcessor, dashboards, panel_queries, promql_names, substitute
from harness.otlp_payloads import memory_request, step_span, trace_request
from harness import free_port
from harness.prometheus_server import PrometheusServer, prometheus_available
from harness.sampler_payloads import sampler_request
from tests.processor.test_end_to_end import train_two_ranks

from traceml.schema import vocabulary as v

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not prometheus_available(), reason="needs the prometheus binary")]

RUN_ID = "deploy-dash"
OPEN_RUN_ID = "deploy-dash-open"  # never sends its end marker
M, L = promql_names.M, promql_names.L


def _post(port: int, path: str, message) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=message.SerializeToString(),
                                     headers={"Content-Type": "application/x-protobuf"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deploy-live")
    processor = EntrypointProcessor(folder / "processor", free_port)
    rules = sorted((PROMETHEUS_DIR / "rules").glob("*.rules.yml"))
    prometheus = PrometheusServer(folder / "prometheus", [f"127.0.0.1:{processor.port(9464)}"],
                                  job=promql_names.PROCESSOR_JOB, rule_files=rules)
    prometheus.start()
    try:
        started = time.time()
        http = processor.port(4318)
        # Fake GPU: per-step peak memory of both ranks, as the exporter sends it on CUDA.
        for rank in (0, 1):
            _post(http, "/v1/metrics", memory_request(RUN_ID, rank, range(5), allocated=(rank + 1) << 28))
        # One span without its step number: refused and counted, the rest of the run unaffected.
        _post(http, "/v1/traces", trace_request(RUN_ID, 0, [step_span(0, 0, drop=[v.ATTR_STEP])]))
        # A run that stays open (no end marker): the health dashboard's lag panel shows open runs only,
        # and the trained run below may end between two scrapes.
        _post(http, "/v1/traces", trace_request(OPEN_RUN_ID, 0, [step_span(0, 0)]))
        prometheus.wait_for(f'{M.run_lag}{{{L.run}="{OPEN_RUN_ID}"}}')
        # Fake GPU (and host): the ranks' resource samples, every 0.25 s while they train, so they
        # fall inside the window of steps the analysis reads them over. 150 steps (about 6 s, rank
        # 0's loader sleeps 40 ms a batch): the live session re-reads resources at most every
        # RESOURCE_REFRESH_S (5 s), and its first window may be too short to hold a sample.
        training, sampler_errors = threading.Event(), []

        def sample() -> None:
            while not training.wait(0.25):
                try:
                    for rank in (0, 1):
                        _post(http, "/v1/metrics", sampler_request(
                            RUN_ID, rank, time.time_ns(), cpu=0.4 + 0.2 * rank, gpu_util=0.9 - 0.3 * rank,
                            host_cpu_modes={"user": 0.5, "system": 0.1, "idle": 0.4} if rank == 0 else None))
                except Exception as exc:  # noqa: BLE001 - reported below, the thread keeps sampling
                    sampler_errors.append(repr(exc))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            train_two_ranks(folder, RUN_ID, {0: (f"http://127.0.0.1:{processor.port(4317)}", "grpc"),
                                             1: (f"http://127.0.0.1:{http}", "http/protobuf")}, steps=150)
        finally:
            training.set()
            sampler.join(10)
        assert not sampler_errors, sampler_errors[:3]
        sel = f'{L.run}="{RUN_ID}"'
        stragglers = promql_names.regex(promql_names.STRAGGLER_KINDS)
        prometheus.wait_for(f'{M.diagnosis_active}{{{sel},{L.kind}=~"{stragglers}"}}')
        prometheus.wait_for(f'{M.rank_memory_peak}{{{sel}}}', lambda r: len(r) == 2)
        prometheus.wait_for(f'{M.rank_gpu_utilization}{{{sel}}}', lambda r: len(r) == 2)
        prometheus.wait_for(f'{M.run_host_cpu}{{{sel}}}')
        prometheus.wait_for(f'{M.records}{{{L.outcome}="{promql_names.OUTCOME_REJECTED}"}}')
        time.sleep(3)  # a few more scrapes so rate()/deriv() windows hold several samples
        yield processor, prometheus, started
    finally:
        prometheus.stop()
        code = processor.stop()
        assert code == 0, processor.log_text()


def _grafana_values(started: float, rank: str) -> dict[str, str]:
    span = int(time.time() - started) + 60
    return {"run": RUN_ID, "rank": rank, "datasource": "traceml-prometheus",
            "__rate_interval": "20s", "__range": f"{span}s", "__interval": "1s"}


def _run(prometheus: PrometheusServer, expr: str, instant: bool, started: float) -> list:
    if instant:
        return prometheus.query(expr)
    data = prometheus.api("query_range", query=expr, start=f"{started - 30:.3f}", end=f"{time.time():.3f}",
                          step="1")
    return [series for series in data["result"] if series["values"]]


QUERIES = panel_queries()


@pytest.mark.parametrize("query", QUERIES, ids=[f"{q.dashboard}:{q.panel}" for q in QUERIES])
@pytest.mark.parametrize("rank", [".*", "(0|1)"], ids=["all-ranks", "both-ranks"])
def test_every_panel_query_returns_data(stack, query, rank):
    _, prometheus, started = stack
    expr = substitute(query.expr, _grafana_values(started, rank))
    result = _run(prometheus, expr, query.instant, started)  # raises on a PromQL error
    assert result, f"{query.dashboard} / {query.panel}: no data for {expr}"
    for series in result:
        assert L.step not in series["metric"], "a step label reached Prometheus"


def test_a_single_rank_selection_narrows_the_per_rank_panels(stack):
    _, prometheus, started = stack
    per_rank = [q for q in QUERIES if "$rank" in q.expr]
    assert per_rank
    for query in per_rank:
        result = _run(prometheus, substitute(query.expr, _grafana_values(started, "1")), query.instant, started)
        assert result and {s["metric"].get(L.rank) for s in result} == {"1"}, query.panel


def test_variable_queries_list_the_run_and_its_ranks(stack):
    _, prometheus, _ = stack
    variables = {var["name"]: var for var in dashboards()["traceml-run.json"]["templating"]["list"]}
    for name, expected in (("run", {RUN_ID}), ("rank", {"0", "1"})):
        query = variables[name]["query"]
        inner = query[len("label_values("):-1]
        selector, label = (part.strip() for part in inner.rsplit(",", 1))
        values = prometheus.api(f"label/{label}/values", **{"match[]": substitute(selector, {"run": RUN_ID})})
        assert expected <= set(values), (name, values)


def test_no_step_keyed_or_raw_training_series_in_prometheus(stack):
    _, prometheus, _ = stack
    assert prometheus.query(f'{{{L.step}!=""}}') == []
    raw = "|".join(s.prometheus_name for s in v.TRAINING_METRICS)
    assert prometheus.query(f'{{__name__=~"{raw}"}}') == []


def test_alert_rules_load_and_evaluate_without_error_on_real_data(stack):
    _, prometheus, _ = stack
    deadline = time.monotonic() + 30
    while True:
        rules = [rule for group in prometheus.api("rules")["groups"] for rule in group["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("20") and r["health"] != "unknown" for r in rules):
            break
        assert time.monotonic() < deadline, rules
        time.sleep(0.5)
    assert len(rules) == 11  # 8 alerts and the 3 fleet recording rules
    for rule in rules:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
    # The malformed span makes the reject alert fire at once (no `for`).
    firing = {(a["labels"]["alertname"], a["state"]) for a in prometheus.api("alerts")["alerts"]}
    assert ("TraceMLProcessorIngestRejects", "firing") in firing


def test_panels_show_what_the_run_did(stack):
    """Rank 0's slow loader: the straggler panel names rank 0, per-rank panels show both ranks."""
    _, prometheus, started = stack
    # The per-rank target of each panel (a panel may add a run-level one beside it).
    by_title = {q.panel: q for q in reversed(QUERIES) if M.run_memory_peak not in q.expr}
    values = _grafana_values(started, ".*")
    straggler = _run(prometheus, substitute(by_title["Straggler score and culprit"].expr, values), False, started)
    assert {s["metric"][L.culprit] for s in straggler} == {"0"}
    phases = prometheus.query(substitute(by_title["Phase time per rank (window average)"].expr, values))
    assert {s["metric"][L.rank] for s in phases} == {"0", "1"}
    waits = {s["metric"][L.rank]: float(s["value"][1]) for s in phases
             if s["metric"][L.metric] == promql_names.INPUT_WAIT}
    assert waits["0"] > waits["1"]
    memory = prometheus.query(substitute(by_title["Peak memory per rank"].expr, values))
    assert {s["metric"][L.rank]: float(s["value"][1]) for s in memory} == {"0": (1 << 28) + 4, "1": (2 << 28) + 4}


def test_resource_panels_show_the_ranks_samples(stack):
    """The faked GPUs: rank 0 busy 90 %, rank 1 60 %; the run's least busy rank is rank 1's."""
    _, prometheus, started = stack
    by_title = {q.panel: q for q in reversed(QUERIES)}
    values = _grafana_values(started, ".*")
    gpu = prometheus.query(substitute(by_title["GPU utilisation per rank"].expr, values))
    assert {s["metric"][L.rank]: round(float(s["value"][1]), 6) for s in gpu} == {"0": 0.9, "1": 0.6}
    worst = prometheus.query(f'{M.run_gpu_utilization}{{{L.run}="{RUN_ID}",{L.statistic}="worst"}}')
    assert [round(float(s["value"][1]), 6) for s in worst] == [0.6]
