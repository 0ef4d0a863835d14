"""Committed dashboards and alert rules are exactly what their generators produce, from vocabulary names."""
from __future__ import annotations

import importlib.util
import json
import re

import pytest
from tests.deploy.deploy_files import DASHBOARD_DIR, DEPLOY, PROMETHEUS_DIR, dashboards, load_yaml, panel_queries

from traceml.schema import vocabulary as v


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dashboard_generator():
    return _load(DEPLOY / "grafana" / "generate_dashboards.py")


@pytest.fixture(scope="module")
def rules_generator():
    return _load(PROMETHEUS_DIR / "generate_rules.py")


def test_committed_dashboards_equal_the_generator_output(dashboard_generator):
    generated = dashboard_generator.generate()
    assert sorted(generated) == sorted(p.name for p in DASHBOARD_DIR.glob("*.json"))
    for name, text in generated.items():
        assert (DASHBOARD_DIR / name).read_text() == text, \
            f"{name} is stale: run .venv/bin/python deploy/grafana/generate_dashboards.py"
    assert dashboard_generator.main(["--check"]) == 0


def test_committed_rules_equal_the_generator_output(rules_generator):
    for name, text in rules_generator.generate().items():
        assert (PROMETHEUS_DIR / "rules" / name).read_text() == text, \
            f"{name} is stale: run .venv/bin/python deploy/prometheus/generate_rules.py"
    assert rules_generator.main(["--check"]) == 0


EXPORTED = {s.prometheus_name for s in (*v.SUMMARY_METRICS, *v.PROCESSOR_METRICS)}
RAW = {s.prometheus_name for s in v.TRAINING_METRICS}
LABELS = {v.prometheus_label(k) for s in (*v.SUMMARY_METRICS, *v.PROCESSOR_METRICS) for k in s.attributes}


def _names(expr: str) -> set[str]:
    return set(re.findall(r"\btraceml_[a-z_]+\b", expr))


def _all_exprs() -> list[str]:
    exprs = [q.expr for q in panel_queries()]
    for model in dashboards().values():
        exprs += [var["query"] if isinstance(var["query"], str) else var["query"].get("query", "")
                  for var in model["templating"]["list"] if var["type"] == "query"]
    for group in load_yaml(PROMETHEUS_DIR / "rules" / "traceml.rules.yml")["groups"]:
        exprs += [rule["expr"] for rule in group["rules"]]
    return exprs


def test_every_name_in_queries_and_rules_is_a_re_exported_metric_or_its_label():
    used = set().union(*(_names(e) for e in _all_exprs()))
    unknown = used - EXPORTED - LABELS
    assert not unknown, f"not exported by the processor: {sorted(unknown)}"
    assert not used & RAW, "step-keyed training metrics must never be queried from Prometheus"
    # Every re-exported family is on some panel or rule.
    assert {s.prometheus_name for s in v.SUMMARY_METRICS} <= used
    assert {s.prometheus_name for s in v.PROCESSOR_METRICS} <= used


def test_dashboards_have_datasource_run_rank_variables_and_use_the_datasource_variable():
    models = dashboards()
    assert set(models) == {"traceml-run.json", "traceml-processor.json"}
    run = models["traceml-run.json"]
    names = [var["name"] for var in run["templating"]["list"]]
    assert names == ["datasource", "run", "rank"]
    rank = run["templating"]["list"][2]
    assert rank["multi"] and rank["includeAll"] and rank["allValue"] == ".*"
    provisioned = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    uid = provisioned["datasources"][0]["uid"]
    for name, model in models.items():
        ds_var = model["templating"]["list"][0]
        assert ds_var["type"] == "datasource" and ds_var["query"] == "prometheus"
        assert ds_var["current"]["value"] == uid, name
        assert model["uid"] and model.get("id") is None
        ids = [p["id"] for p in model["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in model["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= 24, f"{name}: {panel['title']} overflows the grid"
    titles = {p["title"] for p in run["panels"]}
    for required in ("Verdict ribbon", "Step time (median rank)", "Throughput", "Worst-rank skew", "Input share",
                     "Phase time per rank (window average)", "Straggler score and culprit", "Peak memory per rank"):
        assert required in titles
    json.dumps(models)  # plain JSON throughout


def test_every_panel_and_alert_is_explained_in_the_deployment_doc():
    doc = (DEPLOY.parent / "docs" / "deployment.md").read_text()
    for query in panel_queries():
        assert f"| {query.panel} |" in doc, f"docs/deployment.md does not explain panel {query.panel!r}"
    for group in load_yaml(PROMETHEUS_DIR / "rules" / "traceml.rules.yml")["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule["record"]  # recording rules are explained too
            assert f"`{name}`" in doc, name
