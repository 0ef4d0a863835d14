"""The benchmarks share code through one declared library, `benchmarks.lib`, by public names.

Read from the sources (nothing is imported): a benchmark or a check that imports another
benchmark's module, or any `_private` name of a benchmark module, re-creates the
undeclared library issue 29 removed; a library module importing a benchmark, a check or a
test module turns the dependency around. What benchmarks and checks share with the tests
is `harness/`, beside the tests: no benchmark or check imports a test module.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = "benchmarks.lib"

def _sources(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))
            if ".peers" not in path.parts]


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in `path`, at any depth (function-level ones included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def _is_library(module: str) -> bool:
    return module == LIBRARY or module.startswith(LIBRARY + ".")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.slow
def test_benchmarks_and_checks_import_shared_code_only_from_the_library():
    wrong = []
    for path in _sources("benchmarks", "checks"):
        if _is_library(".".join(path.relative_to(ROOT).with_suffix("").parts)):
            continue
        for module, names in _imports(path):
            top = module.split(".")[0]
            if top not in ("benchmarks", "checks"):
                continue
            targets = [f"{module}.{name}" for name in names] if module in ("benchmarks", "checks") else [module]
            wrong += [f"{_rel(path)}: {target}" for target in targets if not _is_library(target)]
    assert wrong == [], f"shared code outside benchmarks.lib (move it into the library): {wrong}"


@pytest.mark.slow
def test_nothing_imports_a_private_name_of_a_benchmark_module():
    wrong = []
    for path in _sources("benchmarks", "checks", "tests"):
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("benchmarks", "checks"):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        wrong.append(f"{_rel(path)}: from {node.module} import {alias.name}")
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in ("benchmarks", "checks") and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                wrong.append(f"{_rel(path)}: {aliases[node.value.id]}.{node.attr}")
    assert wrong == [], f"private names used across benchmark modules (give them a public name): {sorted(set(wrong))}"


def test_the_library_imports_no_benchmark_check_or_test():
    wrong = [f"{_rel(path)}: {module}"
             for path in _sources("benchmarks/lib")
             for module, names in _imports(path)
             if module.split(".")[0] in ("tests", "checks")
             or (module.split(".")[0] == "benchmarks" and not _is_library(module)
                 and not all(_is_library(f"{module}.{name}") for name in names))]
    assert wrong == [], wrong


def test_the_shared_harness_imports_no_test_module():
    wrong = [f"{_rel(path)}: {module}" for path in _sources("harness")
             for module, _ in _imports(path) if module.split(".")[0] in ("tests", "benchmarks", "checks")]
    assert wrong == [], wrong


def test_no_benchmark_or_check_imports_a_test_module():
    found = sorted(f"{_rel(path)}: {module}" for path in _sources("benchmarks", "checks")
                   for module, _ in _imports(path) if module.split(".")[0] == "tests")
    assert found == [], f"benchmarks or checks importing test modules (shared code goes to harness/): {found}"
