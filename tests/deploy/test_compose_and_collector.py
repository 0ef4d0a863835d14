"""docker-compose.yml and the collector configs, checked structurally (no Docker engine here).

Every referenced file exists, every image is pinned, every pipeline component is
defined and named as contrib 0.154.0 names it, ports agree with the image's
processor flags, and no step-keyed raw metric has a path to Prometheus.

No Collector binary is available to these tests (no Docker engine, no network to
fetch or build `otelcol-contrib`), so where a request goes is worked out from each
config with the Collector's documented pipeline, connector and routing rules
(`deploy_files.collector_destinations`), fed with what the project's own exporter
encodes (a real step span and metric request from `OtlpEncoder`) and what the
official OpenTelemetry SDK encodes for a job's own telemetry.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml
from tests.deploy.deploy_files import (COLLECTOR_DIR, DEPLOY, PROMETHEUS_DIR, ROOT, OtlpBatch, collector_configs,
                                      collector_destinations, compose, flag_values, image_command, load_yaml,
                                      port_of, resource_condition_holds)

from traceml.schema import vocabulary as v

COLLECTOR_IMAGE = "otel/opentelemetry-collector-contrib:0.154.0"
# Component type names valid in contrib 0.154.0 (the renamed ones: otlp_grpc / otlp_http since
# 0.144, load_balancing since 0.153). The deprecated aliases are refused so the configs stay current.
VALID = {
    "receivers": {"otlp"},
    "processors": {"memory_limiter", "filter"},
    "exporters": {"otlp_grpc", "otlp_http", "load_balancing", "prometheusremotewrite", "debug"},
    "extensions": {"health_check"},
    "connectors": {"routing"},
}
DEPRECATED = {"otlp": "otlp_grpc", "otlphttp": "otlp_http", "loadbalancing": "load_balancing"}
PROMETHEUS_BOUND = {"prometheus", "prometheusremotewrite"}


def _type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def _env_default(text: str) -> str:
    """`${VAR:-default}` -> default (what compose uses when VAR is unset)."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


@pytest.fixture(scope="module")
def services():
    return compose()["services"]


def test_every_image_is_pinned(services):
    for name, service in services.items():
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and re.search(r"\d", tag), f"{name}: unpinned image {image}"
    assert services["otel-collector"]["image"] == COLLECTOR_IMAGE
    assert services["otel-gateway"]["image"] == COLLECTOR_IMAGE
    from_line = (ROOT / "Dockerfile").read_text().split("\nFROM ", 1)[1].split()[0]
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim(-\w+)?", from_line), from_line


def test_every_referenced_file_exists(services):
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: {source} missing"
        build = service.get("build")
        if build:
            assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).is_file()
        for arg in service.get("command", []) if isinstance(service.get("command"), list) else []:
            for config in re.findall(r"--config(?:\.file)?=(\S+)", _env_default(arg)):
                host = _container_to_host(service, config)
                assert host is not None and host.is_file(), f"{name}: {config} not mounted from an existing file"
    # The traces profile's config (chosen via TRACEML_COLLECTOR_CONFIG) exists in the mounted folder.
    assert (COLLECTOR_DIR / "collector-traces.yaml").is_file()
    prometheus = load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    for pattern in prometheus["rule_files"]:
        assert list(PROMETHEUS_DIR.glob(pattern)), pattern
    grafana = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert _container_to_host(services["grafana"], grafana).is_file()
    provider = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "traceml.yml")["providers"][0]
    folder = _container_to_host(services["grafana"], provider["options"]["path"])
    assert folder is not None and list(folder.glob("*.json"))


def _container_to_host(service: dict, container_path: str) -> Path | None:
    for volume in service.get("volumes", []):
        parts = volume.split(":")
        if len(parts) >= 2 and parts[0].startswith(".") and container_path.startswith(parts[1]):
            return ROOT / parts[0] / container_path[len(parts[1]):].lstrip("/")
    return None


def test_ports_agree_with_the_image_flags(services):
    flags = flag_values(image_command())
    grpc, http, prom = (port_of(flags[f]) for f in ("--otlp-grpc", "--otlp-http", "--prometheus"))
    assert flags["--db"].startswith("/data/") and flags["--summary-dir"].startswith("/data/")
    expose = " ".join(i.split(" ", 1)[1] for i in (ROOT / "Dockerfile").read_text().splitlines()
                      if i.startswith("EXPOSE "))
    assert set(expose.split()) == {str(grpc), str(http), str(prom)}
    for name in ("traceml-processor", "traceml-processor-shard"):
        assert set(services[name]["expose"]) == {str(grpc), str(http), str(prom)}
    configs = collector_configs()
    assert configs["collector.yaml"]["exporters"]["otlp_grpc/traceml"]["endpoint"] == f"traceml-processor:{grpc}"
    lb = configs["collector-load-balancing.yaml"]["exporters"]["load_balancing/traceml"]
    assert lb["resolver"]["dns"] == {"hostname": "traceml-processor-shard", "port": grpc, "interval": "10s"}
    job = load_yaml(PROMETHEUS_DIR / "prometheus.yml")["scrape_configs"][0]
    assert job["static_configs"][0]["targets"] == [f"traceml-processor:{prom}"]
    assert job["dns_sd_configs"][0]["names"] == ["traceml-processor-shard"]
    assert job["dns_sd_configs"][0]["port"] == prom
    # Collectors publish the standard OTLP ports to training jobs; the gateway its own pair.
    assert services["otel-collector"]["ports"] == ["4317:4317", "4318:4318"]
    assert [p.split(":")[1] for p in services["otel-gateway"]["ports"]] == ["4317", "4318"]
    datasource = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    assert "9090:9090" in services["prometheus"]["ports"]
    # The processor's live web view: its own --ui address (TRACEML_PROCESSOR_UI, which no CMD flag
    # overrides), published on the host's loopback only (no token or TLS in the default stack).
    assert "--ui" not in flags
    ui = services["traceml-processor"]["environment"]["TRACEML_PROCESSOR_UI"]
    assert ui.startswith("0.0.0.0:")
    assert services["traceml-processor"]["ports"] == [f"127.0.0.1:{port_of(ui)}:{port_of(ui)}"]
    assert services["traceml-processor"]["environment"]["TRACEML_PROCESSOR_IDLE_TIMEOUT"] == \
        services["traceml-processor-shard"]["environment"]["TRACEML_PROCESSOR_IDLE_TIMEOUT"]
    assert "TRACEML_PROCESSOR_UI" not in services["traceml-processor-shard"]["environment"]


@pytest.mark.parametrize("name", sorted(p.name for p in COLLECTOR_DIR.glob("*.yaml")))
def test_collector_pipelines_use_only_defined_components_with_current_names(name):
    check_pipelines(name, collector_configs()[name])


def check_pipelines(name: str, config: dict) -> None:
    service = config["service"]
    for ext in service.get("extensions", []):
        assert ext in config.get("extensions", {}), f"{name}: extension {ext} not defined"
    for section, valid in VALID.items():
        for component in config.get(section, {}) or {}:
            kind = _type(component)
            assert kind not in DEPRECATED or section == "receivers", \
                f"{name}: {component} uses a deprecated name, use {DEPRECATED[kind]}"
            assert kind in valid, f"{name}: {section} {component} is not a known 0.154.0 component"
    connectors = config.get("connectors") or {}
    used = {"receivers": set(), "processors": set(), "exporters": set()}
    as_exporter: dict[str, list[str]] = {c: [] for c in connectors}
    as_receiver: dict[str, list[str]] = {c: [] for c in connectors}
    for pipeline_id, pipeline in service["pipelines"].items():
        assert _type(pipeline_id) in ("traces", "metrics", "logs"), pipeline_id
        assert pipeline.get("receivers") and pipeline.get("exporters"), pipeline_id
        for section in used:
            for component in pipeline.get(section, []):
                if section != "processors" and component in connectors:
                    (as_exporter if section == "exporters" else as_receiver)[component].append(pipeline_id)
                    continue
                assert component in (config.get(section) or {}), f"{name}: {pipeline_id} uses undefined {component}"
                used[section].add(component)
    for section, components in used.items():
        assert set(config.get(section) or {}) == components, f"{name}: unused {section} defined"
    for connector, settings in connectors.items():
        # A connector ends one pipeline (its exporter side) and starts the others (its receivers),
        # all of one signal; every pipeline its table or default names is one it feeds.
        sources, targets = as_exporter[connector], as_receiver[connector]
        assert len(sources) == 1 and targets, f"{name}: {connector} fed by {sources}, feeding {targets}"
        assert not set(sources) & set(targets), f"{name}: {connector} loops"
        assert {_type(p) for p in sources + targets} == {_type(sources[0])}, f"{name}: {connector} mixes signals"
        named = set(settings.get("default_pipelines", []))
        for route in settings["table"]:
            assert route["pipelines"] and ("condition" in route) != ("statement" in route), route
            named |= set(route["pipelines"])
        assert named == set(targets), f"{name}: {connector} routes to {named}, receives in {targets}"
        assert "match_once" not in settings  # removed in 0.120: a 0.154 Collector refuses it


def _to_processor(exporter_id: str) -> bool:
    return _type(exporter_id) in ("otlp_grpc", "load_balancing") and "traceml" in exporter_id


def _attributes(resource) -> dict:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in resource.attributes}


@pytest.fixture
def jobs_own_provider(monkeypatch):
    """The job's own SDK TracerProvider and MeterProvider, sharing its resource; TraceML's
    encoder sees the TracerProvider as the global one (so its resource merges with the job's,
    the hardest case for a resource-based route)."""
    from opentelemetry import trace as otel_trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    resource = Resource.create({"service.name": "my-trainer", "deployment.environment": "prod"})
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    monkeypatch.setattr(otel_trace, "get_tracer_provider", lambda: tracer_provider)
    yield tracer_provider, spans, meter_provider, reader
    tracer_provider.shutdown()
    meter_provider.shutdown()


@pytest.fixture
def traceml_batches(jobs_own_provider):
    """A real step span request (with phase children) and a real metrics request, as TraceML's
    exporter encodes them in a job that runs its own OpenTelemetry."""
    from harness.exporter_records import identity, step_record

    from traceml.exporter import resolve_settings
    from traceml.exporter.encoding import OtlpEncoder

    encoder = OtlpEncoder(identity("routed-run"), resolve_settings("http://127.0.0.1:4317", "grpc", environ={}))
    request, spans = encoder.new_trace_request()
    encoder.add_step_spans(spans, step_record(3))
    [resource_spans] = request.resource_spans
    metrics = encoder.new_metrics_batch()
    encoder.add_counter_points(metrics, v.METRIC_TELEMETRY_DROPPED, v.ATTR_QUEUE, {v.QUEUE_NAMES[0]: 1}, 1, 2)
    [resource_metrics] = metrics.request.resource_metrics
    return {
        "traces": OtlpBatch("traces", _attributes(resource_spans.resource),
                            tuple(s.name for s in resource_spans.scope_spans[0].spans)),
        "metrics": OtlpBatch("metrics", _attributes(resource_metrics.resource),
                             tuple(m.name for m in resource_metrics.scope_metrics[0].metrics)),
    }


@pytest.fixture
def jobs_own_batches(jobs_own_provider):
    """The job's own span and counter, encoded by the official OTLP exporter's encoder."""
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    tracer_provider, spans, meter_provider, reader = jobs_own_provider
    with tracer_provider.get_tracer("user-training-script").start_as_current_span("train_epoch"):
        pass
    meter_provider.get_meter("user-training-script").create_counter("samples_seen").add(32)
    [resource_spans] = encode_spans(spans.get_finished_spans()).resource_spans
    [resource_metrics] = encode_metrics(reader.get_metrics_data()).resource_metrics
    return {
        "traces": OtlpBatch("traces", _attributes(resource_spans.resource),
                            tuple(s.name for ss in resource_spans.scope_spans for s in ss.spans)),
        "metrics": OtlpBatch("metrics", _attributes(resource_metrics.resource),
                             tuple(m.name for sm in resource_metrics.scope_metrics for m in sm.metrics)),
    }


def test_what_the_exporter_sends_carries_the_routing_key_and_the_jobs_own_telemetry_does_not(
        traceml_batches, jobs_own_batches):
    # The two share the job's resource attributes; only TraceML's carry the run id.
    for signal in ("traces", "metrics"):
        ours, theirs = traceml_batches[signal], jobs_own_batches[signal]
        assert ours.resource[v.ATTR_RUN_ID] == "routed-run" and v.ATTR_RUN_ID not in theirs.resource
        assert ours.resource["service.name"] == theirs.resource["service.name"] == "my-trainer"
    assert v.SPAN_STEP in traceml_batches["traces"].names
    condition = f'attributes["{v.ATTR_RUN_ID}"] != nil'
    assert resource_condition_holds(condition, traceml_batches["traces"].resource)
    assert not resource_condition_holds(condition, jobs_own_batches["traces"].resource)
    assert resource_condition_holds(f'attributes["{v.ATTR_RUN_ID}"] == "routed-run"', traceml_batches["traces"].resource)
    with pytest.raises(AssertionError, match="grammar"):
        resource_condition_holds(f'IsMatch(attributes["{v.ATTR_RUN_ID}"], ".*")', {})


def test_traceml_traces_and_metrics_reach_the_processor_in_every_collector(traceml_batches):
    for name, config in collector_configs().items():
        for signal, batch in traceml_batches.items():
            reached = collector_destinations(config, batch)
            assert any(_to_processor(e) and names == set(batch.names) for e, names in reached.items()), \
                (name, signal, reached)


def test_the_existing_collector_snippet_keeps_traceml_and_the_jobs_own_telemetry_apart(
        traceml_batches, jobs_own_batches):
    snippet = collector_configs()["existing-collector-snippet.yaml"]
    for signal in ("traces", "metrics"):
        ours = collector_destinations(snippet, traceml_batches[signal])
        assert ours and all(_to_processor(e) for e in ours), (signal, ours)  # the processor, and only it
        theirs = collector_destinations(snippet, jobs_own_batches[signal])
        assert theirs == {"otlp_grpc/yours" if signal == "traces" else "prometheusremotewrite/yours":
                          set(jobs_own_batches[signal].names)}, (signal, theirs)
    for route in (r for c in snippet["connectors"].values() for r in c["table"]):
        assert route["condition"] == f'attributes["{v.ATTR_RUN_ID}"] != nil'


def _doc_yaml_block(heading: str) -> dict:
    """The first ```yaml block after `heading` in docs/deployment.md."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    after = text[text.index(heading + "\n"):]
    block = after.split("```yaml\n", 1)[1].split("```", 1)[0]
    return yaml.safe_load(block)


def test_the_documented_routing_is_the_snippets():
    snippet = collector_configs()["existing-collector-snippet.yaml"]
    essential = _doc_yaml_block("## Pointing an existing collector at the processor")
    assert essential["connectors"] == snippet["connectors"]
    for pipeline_id, pipeline in essential["service"]["pipelines"].items():
        assert snippet["service"]["pipelines"][pipeline_id] == pipeline, pipeline_id


def test_opting_in_also_sends_step_spans_to_your_tracing_backend(traceml_batches, jobs_own_batches):
    snippet = collector_configs()["existing-collector-snippet.yaml"]
    opted = copy.deepcopy(snippet)
    opted["connectors"].update(_doc_yaml_block("### Step spans in your tracing backend")["connectors"])
    check_pipelines("opted-in snippet", opted)
    spans = traceml_batches["traces"]
    reached = collector_destinations(opted, spans)
    assert reached == {"otlp_grpc/traceml": set(spans.names), "otlp_grpc/yours": set(spans.names)}
    assert collector_destinations(opted, jobs_own_batches["traces"]) == {
        "otlp_grpc/yours": set(jobs_own_batches["traces"].names)}
    # Metrics are not part of the opt-in: TraceML's still reach the processor only.
    assert set(collector_destinations(opted, traceml_batches["metrics"])) == {"otlp_grpc/traceml"}


def test_scale_out_routes_every_signal_by_run_id():
    config = collector_configs()["collector-load-balancing.yaml"]
    lb = config["exporters"]["load_balancing/traceml"]
    assert lb["routing_key"] == "attributes"
    assert lb["routing_attributes"] == [v.ATTR_RUN_ID]
    assert "endpoint" not in lb["protocol"]["otlp"]  # the resolver supplies it
    for signal in ("traces", "metrics"):
        assert config["service"]["pipelines"][f"{signal}/traceml"]["exporters"] == ["load_balancing/traceml"]


def test_step_keyed_raw_metrics_have_no_path_to_prometheus():
    raw = [s.name for s in v.TRAINING_METRICS]
    assert all(v.ATTR_STEP in s.attributes or s.kind == "counter" for s in v.TRAINING_METRICS)
    for name, config in collector_configs().items():
        for pipeline_id, pipeline in config["service"]["pipelines"].items():
            if not pipeline_id.startswith("metrics"):
                continue
            bound = [e for e in pipeline["exporters"] if _type(e) in PROMETHEUS_BOUND]
            if not bound:
                continue
            # A Prometheus-bound metrics pipeline must drop every TraceML training metric first.
            patterns = []
            for processor in pipeline.get("processors", []):
                if _type(processor) == "filter":
                    for condition in config["processors"][processor]["metrics"]["metric"]:
                        # OTTL string literal: `\\` is one backslash in the regex.
                        patterns += [m.replace("\\\\", "\\")
                                     for m in re.findall(r'IsMatch\(name, "([^"]+)"\)', condition)]
            regexes = [re.compile(p) for p in patterns]
            for metric in raw:
                assert any(r.search(metric) for r in regexes), f"{name}: {metric} reaches {bound}"
    # The stack's Prometheus scrapes only the processor job, whose metrics never carry a step label.
    prometheus = load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    assert [job["job_name"] for job in prometheus["scrape_configs"]] == ["traceml-processor"]
    assert all(v.ATTR_STEP not in s.attributes for s in (*v.SUMMARY_METRICS, *v.PROCESSOR_METRICS))


def test_no_traceml_training_metric_reaches_a_prometheus_bound_exporter(traceml_batches):
    every_metric = OtlpBatch("metrics", traceml_batches["metrics"].resource,
                             tuple(s.name for s in v.TRAINING_METRICS))
    for name, config in collector_configs().items():
        reached = collector_destinations(config, every_metric)
        assert not [e for e in reached if _type(e) in PROMETHEUS_BOUND], (name, reached)
        assert any(_to_processor(e) and names == set(every_metric.names) for e, names in reached.items()), name


def test_profiles_and_volumes(services):
    assert services["jaeger"]["profiles"] == ["traces"]
    assert services["otel-gateway"]["profiles"] == ["scale-out"]
    assert services["traceml-processor-shard"]["profiles"] == ["scale-out"]
    assert services["traceml-processor-shard"]["deploy"]["replicas"] >= 2
    # Replicas never share one SQLite volume; the single processor keeps a named one.
    assert "volumes" not in services["traceml-processor-shard"]
    assert services["traceml-processor"]["volumes"] == ["traceml-data:/data"]
    traces = collector_configs()["collector-traces.yaml"]
    assert traces["exporters"]["otlp_grpc/jaeger"]["endpoint"] == "jaeger:4317"
    for name in ("traceml-processor", "otel-collector", "prometheus", "grafana"):
        assert "profiles" not in services[name]
    assert services["otel-collector"]["depends_on"]["traceml-processor"]["condition"] == "service_healthy"
