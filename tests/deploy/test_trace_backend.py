"""The trace backend exemplars link to (issue 35 item 3), checked as the collector configs are.

No Tempo, Jaeger or Grafana runs here: the files are read and held against each other and
against what the processor emits. The compose stack's Tempo accepts OTLP on the port the
traces collector config sends the step spans to; Grafana's Prometheus data source turns
the exemplar label the processor writes into a link to a provisioned trace data source;
Prometheus stores exemplars.
"""
from __future__ import annotations

from tests.deploy.deploy_files import COLLECTOR_DIR, COMPOSE, DEPLOY, load_yaml, port_of
from traceml.processor.prometheus_exposition import EXEMPLAR_TRACE_LABEL

DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources"


def _services() -> dict:
    return load_yaml(COMPOSE)["services"]


def test_tempo_accepts_otlp_where_the_traces_collector_sends_the_step_spans():
    tempo = load_yaml(DEPLOY / "tempo" / "tempo.yaml")
    grpc = tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    collector = load_yaml(COLLECTOR_DIR / "collector-traces.yaml")
    exporter = collector["exporters"]["otlp_grpc/tempo"]
    host, _, port = exporter["endpoint"].rpartition(":")
    assert host == "tempo" and int(port) == port_of(grpc)
    # Every TraceML span the traces pipeline carries reaches Tempo beside the processor.
    traces = collector["service"]["pipelines"]["traces/traceml"]["exporters"]
    assert {"otlp_grpc/traceml", "otlp_grpc/tempo"} <= set(traces)
    service = _services()["tempo"]
    assert service["profiles"] == ["traces"]
    assert str(port_of(grpc)) in service["expose"]
    assert str(tempo["server"]["http_listen_port"]) in service["expose"]
    assert service["command"] == ["--config.file=/etc/tempo/tempo.yaml"]
    assert "./deploy/tempo:/etc/tempo:ro" in service["volumes"]


def test_grafana_links_the_processors_exemplar_label_to_a_provisioned_trace_source():
    sources = {s["uid"]: s for f in sorted(DATASOURCES.glob("*.yml")) for s in load_yaml(f)["datasources"]}
    prometheus = sources["traceml-prometheus"]
    [destination] = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert destination["name"] == EXEMPLAR_TRACE_LABEL
    trace_source = sources[destination["datasourceUid"]]
    assert trace_source["type"] in ("tempo", "jaeger")
    tempo_port = load_yaml(DEPLOY / "tempo" / "tempo.yaml")["server"]["http_listen_port"]
    assert trace_source["url"] == f"http://tempo:{tempo_port}"


def test_prometheus_stores_exemplars_in_the_stack():
    assert "--enable-feature=exemplar-storage" in _services()["prometheus"]["command"]
