"""One owner per name and shape: exported metric names, the point type, the summary files' writer
and names, the run-id sources. Each test fails when a second owner creeps back into the product."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest

from traceml.launcher import run_dir
from traceml.processor.metric_point import SPECS, MetricPoint
from traceml.schema import run_id as r
from traceml.schema import summary as s
from traceml.schema import vocabulary as v

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("schema", "instrumentation", "exporter", "processor", "launcher", "deploy")
VOCABULARY = ROOT / "schema" / "vocabulary.py"
EXPORTED = (*v.SUMMARY_METRICS, *v.PROCESSOR_METRICS, *v.TRAINING_METRICS)


def _product_modules():
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, ast.parse(path.read_text(encoding="utf-8"))


def _vocabulary_constants() -> dict[str, list[str]]:
    """Metric-name value -> the module-level `METRIC_*` constants of the vocabulary that hold it."""
    names: dict[str, list[str]] = {}
    for node in ast.parse(VOCABULARY.read_text(encoding="utf-8")).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id.startswith("METRIC_") and isinstance(value, ast.Constant):
            names.setdefault(value.value, []).append(target.id)
    return names


def test_every_exported_metric_is_named_by_exactly_one_vocabulary_constant():
    constants = _vocabulary_constants()
    assert {spec.name: len(constants.get(spec.name, ())) for spec in EXPORTED} == \
        {spec.name: 1 for spec in EXPORTED}


def test_the_specs_name_their_metrics_through_the_constants():
    """Inside the vocabulary too, a metric name is spelled once: in its constant, not in its spec."""
    specs = [node for node in ast.walk(ast.parse(VOCABULARY.read_text(encoding="utf-8")))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "MetricSpec"]
    assert len(specs) == len(EXPORTED)
    assert [ast.unparse(node.args[0]) for node in specs if not isinstance(node.args[0], ast.Name)] == []


@pytest.mark.slow
def test_no_product_module_spells_an_exported_metric_name():
    """Builders (the projection, the run monitor, the service), renderers and the deploy generators
    all name the series through `schema.vocabulary`'s constants, never a literal of their own."""
    names = {spec.name for spec in EXPORTED}
    found = [f"{path.relative_to(ROOT)}:{node.lineno} {node.value}"
             for path, tree in _product_modules() if path != VOCABULARY
             for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in names]
    assert found == []


@pytest.mark.slow
def test_one_point_type_for_every_exported_series():
    """No second class of MetricPoint's shape (name, attributes, value; with or without the step
    it stands for, `exemplar`) exists in the product."""
    shape = {"name", "attributes", "value"}
    classes = [f"{path.relative_to(ROOT)}:{node.name}" for path, tree in _product_modules()
               for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
               and {a.target.id for a in node.body
                    if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)} - {"exemplar"} == shape]
    assert classes == ["processor/metric_point.py:MetricPoint"]
    assert set(SPECS) == {spec.name for spec in (*v.SUMMARY_METRICS, *v.PROCESSOR_METRICS)}
    assert MetricPoint(v.METRIC_PROCESSOR_RUNS, {}, 1.0).check().value == 1.0  # own series check too


@pytest.mark.slow
def test_one_function_per_summary_writing_name_and_one_writer_of_the_files():
    """`write_final_summary` (store -> files) and `write_summary_files` (built summary -> files) are
    two jobs with two names, each defined once; only the latter opens the files for writing."""
    defined: dict[str, list[str]] = {}
    for path, tree in _product_modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in ("write_final_summary", "write_summary_files"):
                defined.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert defined == {"write_final_summary": ["processor/summary_section.py"],
                       "write_summary_files": ["processor/reporting/final_summary.py"]}


@pytest.mark.slow
def test_the_summary_files_are_named_by_the_schema_alone():
    literals = [f"{path.relative_to(ROOT)}:{node.lineno}" for path, tree in _product_modules()
                if path != ROOT / "schema" / "summary.py" for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and node.value in (s.FINAL_SUMMARY_FILE, s.SUMMARY_CARD_FILE)]
    assert literals == []


@pytest.mark.slow
def test_run_id_sources_are_one_closed_set_both_sides_speak():
    assert get_args(r.RunIdSource) == r.RUN_ID_SOURCES
    assert len(set(r.RUN_ID_SOURCES)) == len(r.RUN_ID_SOURCES)
    # The launcher hands back the ranks' own words (here: a declared one, and a generated one).
    assert run_dir.resolve_run_id(None, "job-7", {}).source == r.SOURCE_RENDEZVOUS
    assert run_dir.resolve_run_id(None, None, {}).source == r.SOURCE_GENERATED
    spelled = [f"{path.relative_to(ROOT)}:{node.lineno} {node.value}" for path, tree in _product_modules()
               if path != ROOT / "schema" / "run_id.py" for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and node.value in ("argument", "rendezvous_store",
                                                                    "launcher_process", "generated")]
    assert spelled == []
