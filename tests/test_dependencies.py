"""pyproject.toml declares what the package imports and nothing else; the image's versions are fixed.

The package's third-party imports (any depth, lazy ones inside functions included)
are read from its source and resolved to the installed distributions that provide
them; the core dependencies must be exactly those, the training stack only in
extras. The Dockerfile installs with `deploy/processor-constraints.txt`, which pins
every core dependency and everything each of them requires.
"""
from __future__ import annotations

import pytest

import ast
import importlib.metadata as md
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("instrumentation", "exporter", "processor", "schema", "launcher")
TRAINING_STACK = {"torch", "transformers", "accelerate", "lightning", "pytorch_lightning"}
CONSTRAINTS = ROOT / "deploy" / "processor-constraints.txt"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _third_party_imports() -> dict[str, set[str]]:
    """Imported module -> the package folders importing it (stdlib and traceml itself left out)."""
    found: dict[str, set[str]] = {}
    for folder in PACKAGE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top == "traceml" or top in sys.stdlib_module_names:
                        continue
                    found.setdefault(name, set()).add(folder)
    return found


def _distribution_of(module: str, top_levels: dict) -> str:
    """The installed distribution whose files hold `module` (namespace packages such as
    `google` and `opentelemetry` are shared by several)."""
    candidates = top_levels.get(module.split(".")[0], [])
    if len(set(candidates)) == 1:
        return _canonical(candidates[0])
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"{module} is imported but not installed"
    where = Path(spec.origin).resolve() if spec.origin else Path(next(iter(spec.submodule_search_locations)))
    for name in dict.fromkeys(candidates):
        for file in md.distribution(name).files or ():
            located = Path(file.locate()).resolve()
            if located == where or where in located.parents:
                return _canonical(name)
    raise AssertionError(f"no installed distribution provides {module} (candidates {candidates})")


@pytest.mark.slow
def test_core_dependencies_are_exactly_what_the_package_imports():
    imports = _third_party_imports()
    optional = {name for name in imports if name.split(".")[0] in TRAINING_STACK}
    needed: dict[str, set[str]] = {}
    top_levels = md.packages_distributions()
    for module in sorted(set(imports) - optional):
        needed.setdefault(_distribution_of(module, top_levels), set()).add(module)
    declared = {_canonical(Requirement(dep).name) for dep in _project()["dependencies"]}
    in_extras = {_canonical(Requirement(dep).name) for deps in _project()["optional-dependencies"].values()
                 for dep in deps} - declared
    # The training side's optional helpers (psutil, nvidia-ml-py: the resource sampler) live in
    # extras, are imported only by the training side, and only inside a guard (tested there).
    extra_only = {dist for dist in needed if dist in in_extras}
    for dist in extra_only:
        folders = set().union(*(imports[module] for module in needed[dist]))
        assert folders == {"instrumentation"}, (dist, folders)
    core = set(needed) - extra_only
    assert not core - declared, {d: sorted(needed[d]) for d in core - declared}
    assert not declared - core, f"declared but never imported: {sorted(declared - core)}"


def test_the_training_stack_is_only_in_extras():
    extras = _project()["optional-dependencies"]
    in_extras = {_canonical(Requirement(dep).name) for deps in extras.values() for dep in deps}
    imported = {_canonical(name.split(".")[0]) for name in _third_party_imports()} & {
        _canonical(t) for t in TRAINING_STACK}
    assert imported - {"pytorch-lightning"} <= in_extras  # pytorch_lightning ships inside `lightning`


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[_canonical(name)] = version
    return pins


def test_the_image_constraints_pin_every_dependency_and_what_it_requires():
    pins = _pins()
    todo = [Requirement(dep) for dep in _project()["dependencies"]]
    seen = set()
    while todo:
        requirement = todo.pop()
        name = _canonical(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        assert name in pins, f"{name} (required via the image's dependencies) is not pinned in {CONSTRAINTS.name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (requirement, pins[name])
        for dep in md.requires(name) or ():
            req = Requirement(dep)
            if req.marker is None or any(req.marker.evaluate({"extra": extra})
                                         for extra in ("", *requirement.extras)):
                todo.append(req)
    assert set(pins) == seen, f"pinned but not needed by the image: {sorted(set(pins) - seen)}"


def test_the_dockerfile_installs_with_the_constraints():
    text = (ROOT / "Dockerfile").read_text()
    assert "deploy/processor-constraints.txt" in text
    assert re.search(r"pip install[^&]*-c processor-constraints\.txt \.", text)
