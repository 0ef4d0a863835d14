"""`/metrics` through prometheus_client: text and OpenMetrics by `Accept`, gzip, process and build metrics,
promtool in both formats, the names the dashboards and rules query, and bounded per-rank series."""
from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from harness import wait_until
from harness.processor_service import make_service
from harness.sampler_payloads import sampler_request
from harness.otlp_payloads import memory_request, run_end_span, steps_request, trace_request
from tests.processor.test_runs import send_straggler_run, summary_written
from traceml.processor.prometheus_exposition import BUILD_INFO
from traceml.schema import vocabulary as v

OPENMETRICS = "application/openmetrics-text; version=1.0.0"
TEXT = "text/plain; version=0.0.4"
# What Prometheus 2.x sends when it scrapes (it prefers OpenMetrics).
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                     "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool")


def get(port: int, path: str = "/metrics", **headers) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def samples(families) -> set[tuple[str, tuple]]:
    return {(s.name, tuple(sorted(s.labels.items()))) for family in families for s in family.samples}


def promtool_check(text: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    svc = make_service(tmp_path_factory.mktemp("expo"))
    try:
        # Resource samples of both ranks inside the steps' time span (their ends run from now to
        # now + 2.3 s), sent first so the run's first analysis reads them; the GPU is faked.
        start = time.time()
        with grpc.insecure_channel(f"127.0.0.1:{svc.grpc_port}") as channel:
            metrics = metrics_service_pb2_grpc.MetricsServiceStub(channel)
            for offset in (0.5, 1.0, 1.5):
                for rank in (0, 1):
                    modes = {"user": 0.55, "system": 0.05, "idle": 0.4} if rank == 0 else None
                    metrics.Export(sampler_request("expo-run", rank, int((start + offset) * 1e9), cpu=0.3 + 0.4 * rank,
                                                   gpu_util=0.9 - 0.5 * rank, host_cpu_modes=modes), timeout=10)
        send_straggler_run(svc.grpc_port, "expo-run", end_markers=())
        assert wait_until(lambda: b'traceml_diagnosis_culprit_rank="0"' in get(svc.prometheus_port)[2], 30)
        yield svc
    finally:
        svc.stop()


def test_text_by_default_and_openmetrics_when_asked_with_the_same_series(served):
    status, headers, text = get(served.prometheus_port)
    assert status == 200 and headers["Content-Type"].startswith(TEXT)
    status, headers, om = get(served.prometheus_port, Accept=PROMETHEUS_ACCEPT)
    assert status == 200 and headers["Content-Type"].startswith(OPENMETRICS)
    om_text = om.decode()
    assert om_text.endswith("# EOF\n")
    strict = list(parse_openmetrics(om_text))  # the strict OpenMetrics parser: raises on any violation
    loose = list(parse_text(text.decode()))
    # Counters: family without _total in OpenMetrics, samples named exactly as in the text format.
    records = next(f for f in strict if f.name == "traceml_processor_records")
    assert records.type == "counter"
    assert {s.name for s in records.samples} == {"traceml_processor_records_total"}
    assert "# TYPE traceml_processor_records_total counter" in text.decode()
    assert "# UNIT traceml_window_metric_seconds seconds" in om_text
    process_only = {"process_cpu_seconds_total"}  # keeps ticking between the two scrapes
    om_samples = {s for s in samples(strict) if s[0] not in process_only}
    text_samples = {s for s in samples(loose) if s[0] not in process_only}
    assert om_samples == text_samples


def test_gzip_when_accepted(served):
    _, headers, body = get(served.prometheus_port, **{"Accept-Encoding": "gzip"})
    assert headers.get("Content-Encoding") == "gzip"
    assert b"traceml_window_steps" in gzip.decompress(body)
    _, headers, body = get(served.prometheus_port)
    assert "Content-Encoding" not in headers and b"traceml_window_steps" in body


def test_process_platform_and_build_info(served):
    text = get(served.prometheus_port)[2].decode()
    families = {f.name: f for f in parse_text(text)}
    for name in ("process_resident_memory_bytes", "process_cpu_seconds", "process_open_fds",
                 "process_start_time_seconds", "python_info"):
        assert name in families, name
    [build] = families[BUILD_INFO].samples
    assert build.labels == {"version": version("traceml-otel")} and build.value == 1.0


def test_health_and_unknown_paths(served):
    assert get(served.prometheus_port, "/healthz")[:1] == (200,)
    assert get(served.prometheus_port, "/nope")[0] == 404


def test_metrics_honours_the_processors_tls_and_bearer_token(tmp_path):
    """Issue 32 item 2: /metrics is served over TLS with the token when they are configured (it
    was plain HTTP with no token while every other port honoured both); health stays open."""
    import ssl

    import requests

    from harness.certificates import self_signed
    from traceml.processor.security import BearerAuth, TlsConfig

    cert, key = self_signed(tmp_path)
    svc = make_service(tmp_path, otlp_grpc=None, otlp_http=None, tls=TlsConfig(str(cert), str(key)),
                       auth=BearerAuth("scrape-token"))
    try:
        url = f"https://127.0.0.1:{svc.prometheus_port}"
        refused = requests.get(f"{url}/metrics", verify=str(cert), timeout=10)
        assert refused.status_code == 401 and refused.headers["WWW-Authenticate"].startswith("Bearer")
        wrong = requests.get(f"{url}/metrics", verify=str(cert), timeout=10,
                             headers={"Authorization": "Bearer not-it"})
        assert wrong.status_code == 401
        scraped = requests.get(f"{url}/metrics", verify=str(cert), timeout=10,
                               headers={"Authorization": "Bearer scrape-token", "Accept-Encoding": "gzip",
                                        "Accept": "application/openmetrics-text; version=1.0.0"})
        assert scraped.status_code == 200 and scraped.headers["Content-Encoding"] == "gzip"
        assert scraped.headers["Content-Type"].startswith("application/openmetrics-text")
        assert BUILD_INFO in scraped.text and scraped.text.rstrip().endswith("# EOF")
        assert requests.get(f"{url}/healthz", verify=str(cert), timeout=10).status_code == 200
        with pytest.raises(ConnectionError):  # plain HTTP gets no answer from a TLS port
            get(svc.prometheus_port)
    finally:
        svc.stop()


@needs_promtool
def test_promtool_check_metrics_passes_on_the_text_format(served):
    lint = promtool_check(get(served.prometheus_port)[2].decode())
    assert lint.returncode == 0, lint.stdout + lint.stderr


def promtool_read_openmetrics(body: str, folder) -> subprocess.CompletedProcess:
    """Prometheus's own OpenMetrics parser, as promtool's backfill runs it (it needs sample timestamps).

    `promtool check metrics` lints the text format only (it reads an OpenMetrics counter's
    `x_total` samples as a second, help-less family), so the OpenMetrics body is checked by
    the parser Prometheus scrapes it with, and by prometheus_client's strict parser above.
    """
    def stamp(line: str) -> str:  # the sample's timestamp goes before its exemplar (` # {...} value ts`)
        sample, sep, exemplar = line.rstrip("\n").partition(" # ")
        return f"{sample} 1700000000{sep}{exemplar}\n"

    stamped = "".join(line if line.startswith("#") or not line.strip() else stamp(line)
                      for line in body.splitlines(keepends=True))
    (folder / "metrics.om").write_text(stamped)
    return subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", "metrics.om", "blocks"],
                          cwd=folder, capture_output=True, text=True, timeout=60)


@needs_promtool
def test_prometheus_reads_the_openmetrics_body(served, tmp_path):
    body = get(served.prometheus_port, Accept=PROMETHEUS_ACCEPT)[2].decode()
    (tmp_path / "good").mkdir()
    read = promtool_read_openmetrics(body, tmp_path / "good")
    assert read.returncode == 0 and "NUM SERIES" in read.stdout, read.stdout + read.stderr
    (tmp_path / "bad").mkdir()  # the check can fail: a body without its # EOF is refused
    assert "EOF" in promtool_read_openmetrics(body.replace("# EOF\n", ""), tmp_path / "bad").stderr


@needs_promtool
def test_promtool_can_fail():
    lint = promtool_check("# HELP x_total x\n# TYPE x_total gauge\nx_total 1\n")
    assert lint.returncode != 0


def test_every_name_the_dashboards_and_rules_query_is_served_in_both_formats(served):
    from tests.deploy.deploy_files import promql_names

    M = promql_names.M
    expected = {M.window_metric, M.window_skew, M.rank_metric, M.window_steps, M.window_ranks,
                M.window_last_step, M.run_first_step, M.run_fresh, M.rank_memory_peak, M.diagnosis_active,
                M.rank_dropped, M.run_dropped, M.records, M.analysis_duration, M.run_lag, M.runs,
                M.export_failures,
                M.run_process_cpu, M.run_process_memory, M.run_gpu_utilization, M.run_gpu_memory,
                M.run_gpu_temperature, M.run_gpu_power, M.run_host_cpu, M.run_host_memory,
                M.rank_process_cpu, M.rank_process_memory, M.rank_gpu_utilization, M.rank_gpu_memory}
    for accept in (None, PROMETHEUS_ACCEPT):
        body = get(served.prometheus_port, **({"Accept": accept} if accept else {}))[2].decode()
        parse = parse_openmetrics if accept else parse_text
        names = {s.name for family in parse(body) for s in family.samples}
        assert expected <= names, expected - names


def test_resource_series_are_the_runs_median_and_worst_and_the_ranks_own(served):
    families = {f.name: f for f in parse_text(get(served.prometheus_port)[2].decode())}
    run = v.prometheus_label(v.ATTR_RUN_ID)

    def by(name, label):
        return {s.labels[label]: s.value for s in families[name].samples if s.labels.get(run) == "expo-run"}

    statistic, rank = v.prometheus_label(v.ATTR_STATISTIC), v.prometheus_label(v.ATTR_RANK)
    assert by("traceml_run_gpu_utilization_ratio", statistic) == pytest.approx({"median": 0.65, "worst": 0.4})
    assert by("traceml_rank_gpu_utilization_ratio", rank) == pytest.approx({"0": 0.9, "1": 0.4})
    assert by("traceml_rank_process_cpu_utilization_ratio", rank) == pytest.approx({"0": 0.3, "1": 0.7})
    assert by("traceml_run_host_cpu_utilization_ratio", statistic) == pytest.approx({"median": 0.6, "worst": 0.6})
    assert by("traceml_run_gpu_temperature_celsius", statistic)["worst"] == 60.0
    assert by("traceml_run_gpu_power_watts", statistic)["worst"] == 200.0


# --- bounded per-rank series -----------------------------------------------------------------

RANKS = 24
SLOW = 17  # waits on input: the straggler


def _send_big_run(port: int, run_id: str, steps: int = 24) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        traces = trace_service_pb2_grpc.TraceServiceStub(channel)
        metrics = metrics_service_pb2_grpc.MetricsServiceStub(channel)
        for rank in range(RANKS):
            wait = 100.0 if rank == SLOW else 0.0
            events = {v.RAW_DATALOADER_NEXT: wait, v.RAW_FORWARD: 20.0 + 0.1 * rank,
                      v.RAW_BACKWARD: (20.0 if rank == SLOW else 120.0) + 0.1 * rank,
                      v.RAW_STEP_TIME: 140.0 + 0.2 * rank}
            traces.Export(steps_request(run_id, rank, range(steps), events, world_size=RANKS), timeout=10)
            metrics.Export(memory_request(run_id, rank, range(steps), allocated=(rank + 1) << 20,
                                          drops={"spans": rank}, world_size=RANKS), timeout=10)
        for rank in range(RANKS):
            traces.Export(trace_request(run_id, rank, [run_end_span(rank, steps)], world_size=RANKS), timeout=10)


@pytest.mark.slow
def test_per_rank_series_only_for_the_ranks_that_matter_and_every_rank_in_the_summary(tmp_path):
    svc = make_service(tmp_path, rank_series_top_k=2)
    try:
        _send_big_run(svc.grpc_port, "big")
        assert wait_until(lambda: summary_written(svc, "big"), 60)
        text = get(svc.prometheus_port)[2].decode()
    finally:
        svc.stop()
    families = {f.name: f for f in parse_text(text)}

    def ranks_of(name):
        return {s.labels[v.prometheus_label(v.ATTR_RANK)] for s in families[name].samples
                if s.labels.get(v.prometheus_label(v.ATTR_RUN_ID)) == "big"}

    exported = ranks_of("traceml_rank_metric_seconds")
    assert str(SLOW) in exported  # the culprit
    assert len(exported) < RANKS  # culprit + victim + worst + representative + top 2, not all 24
    assert len(exported) <= 2 + 2 + 2 * len(families["traceml_diagnosis_active_ratio"].samples)
    assert ranks_of("traceml_rank_memory_peak_bytes") == exported
    assert ranks_of("traceml_rank_telemetry_dropped") == exported
    [count] = [s.value for s in families["traceml_run_exported_ranks"].samples]
    assert count == len(exported)
    # Job-level aggregates cover every rank.
    [ranks] = [s.value for s in families["traceml_window_ranks"].samples]
    assert ranks == RANKS
    dropped = {s.labels["traceml_queue"]: s.value for s in families["traceml_run_telemetry_dropped"].samples}
    assert dropped["spans"] == sum(range(RANKS))
    worst = {s.labels["traceml_statistic"]: s.value for s in families["traceml_run_memory_peak_bytes"].samples}
    assert worst["worst"] == float((RANKS << 20) + 23)  # the latest step's peak of the last rank
    # The final summary keeps every rank.
    summary = json.loads((svc.config.summary_dir / "big" / "final_summary.json").read_text())
    assert [g["global_rank"] for g in summary["groups"]] == list(range(RANKS))
    assert summary["telemetry"]["dropped"]["spans"] == sum(range(RANKS))


def _commented_secure_scrape(token_file: Path, ca_file: Path) -> dict:
    """The token/TLS part of deploy/prometheus/prometheus.yml's scrape config, uncommented, with
    the two mounted files pointed at this test's own (the docs show the same block)."""
    import yaml

    text = (Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "prometheus.yml").read_text()
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# scheme: https")
    block = []
    for line in lines[start:]:
        if not line.strip().startswith("#"):
            break
        block.append(line.replace("# ", "", 1))
    parsed = yaml.safe_load("\n".join(block))
    assert parsed["authorization"]["credentials_file"] == "/etc/prometheus/traceml-token"
    assert parsed["tls_config"]["ca_file"] == "/etc/prometheus/traceml-ca.pem"
    parsed["authorization"]["credentials_file"] = str(token_file)
    parsed["tls_config"]["ca_file"] = str(ca_file)
    return parsed


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary")
def test_a_real_prometheus_scrapes_metrics_over_tls_with_the_token_as_deploy_shows(tmp_path):
    import json

    from harness.certificates import self_signed
    from harness.prometheus_server import PrometheusServer
    from traceml.processor.security import BearerAuth, TlsConfig

    cert, key = self_signed(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("scrape-token\n")
    secure = _commented_secure_scrape(token_file, cert)
    svc = make_service(tmp_path, otlp_grpc=None, otlp_http=None, tls=TlsConfig(str(cert), str(key)),
                       auth=BearerAuth("scrape-token"))

    class SecureScrape(PrometheusServer):
        def config_text(self) -> str:
            config = json.loads(super().config_text())
            config["scrape_configs"][0].update(secure)
            config["scrape_configs"].append({"job_name": "no-token", "scheme": "https",
                                             "tls_config": secure["tls_config"],
                                             "static_configs": [{"targets": self.targets}]})
            return json.dumps(config)

    try:
        with SecureScrape(tmp_path / "prom", [f"127.0.0.1:{svc.prometheus_port}"]) as prom:
            assert prom.wait_for(f'{BUILD_INFO}{{job="traceml"}}', timeout_s=30)
            assert prom.wait_for('up{job="no-token"} == 0', timeout_s=30)  # the token is what lets it in
            assert prom.query_value('up{job="traceml"}') == 1.0
    finally:
        svc.stop()
