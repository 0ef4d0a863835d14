"""docker-compose.yml and the collector configs, checked structurally (no Docker engine here).

Every referenced file exists, every image is pinned, every pipeline component is
defined and named as contrib 0.154.0 names it, ports agree with the image's
processor flags, and no step-keyed raw metric has a path to Prometheus.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from tests.deploy.deploy_files import (COLLECTOR_DIR, DEPLOY, PROMETHEUS_DIR, ROOT, collector_configs, compose, flag_values,
                          image_command, load_yaml, port_of)

from traceml.schema import vocabulary as v

COLLECTOR_IMAGE = "otel/opentelemetry-collector-contrib:0.154.0"
# Component type names valid in contrib 0.154.0 (the renamed ones: otlp_grpc / otlp_http since
# 0.144, load_balancing since 0.153). The deprecated aliases are refused so the configs stay current.
VALID = {
    "receivers": {"otlp"},
    "processors": {"memory_limiter", "filter"},
    "exporters": {"otlp_grpc", "otlp_http", "load_balancing", "prometheusremotewrite", "debug"},
    "extensions": {"health_check"},
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


@pytest.mark.parametrize("name", sorted(p.name for p in COLLECTOR_DIR.glob("*.yaml")))
def test_collector_pipelines_use_only_defined_components_with_current_names(name):
    config = collector_configs()[name]
    service = config["service"]
    for ext in service.get("extensions", []):
        assert ext in config.get("extensions", {}), f"{name}: extension {ext} not defined"
    for section, valid in VALID.items():
        for component in config.get(section, {}) or {}:
            kind = _type(component)
            assert kind not in DEPRECATED or section == "receivers", \
                f"{name}: {component} uses a deprecated name, use {DEPRECATED[kind]}"
            assert kind in valid, f"{name}: {section} {component} is not a known 0.154.0 component"
    used = {"receivers": set(), "processors": set(), "exporters": set()}
    for pipeline_id, pipeline in service["pipelines"].items():
        assert _type(pipeline_id) in ("traces", "metrics", "logs"), pipeline_id
        assert pipeline.get("receivers") and pipeline.get("exporters"), pipeline_id
        for section in used:
            for component in pipeline.get(section, []):
                assert component in (config.get(section) or {}), f"{name}: {pipeline_id} uses undefined {component}"
                used[section].add(component)
    for section, components in used.items():
        assert set(config.get(section) or {}) == components, f"{name}: unused {section} defined"


def test_traceml_traces_and_metrics_reach_the_processor_in_every_collector():
    for name, config in collector_configs().items():
        pipelines = config["service"]["pipelines"]
        for signal in ("traces", "metrics"):
            targets = pipelines[f"{signal}/traceml"]["exporters"]
            assert any(_type(t) in ("otlp_grpc", "load_balancing") and "traceml" in t for t in targets), name


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
