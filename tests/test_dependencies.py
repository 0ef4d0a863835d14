"""pyproject.toml declares what each side imports and nothing else; the image's versions are fixed.

The package's third-party imports (any depth, lazy ones inside functions included)
are read from its source and resolved to the installed distributions that provide
them. The core dependencies must be exactly what the training side imports
(`instrumentation/`, `exporter/`, `schema/`, `launcher/`: what a rank and
`traceml run --endpoint` need), the `processor` extra exactly what the service side
adds (`processor/`, and the launcher's views of it), the training stack only in
extras. The Dockerfile installs `.[processor]` with `deploy/processor-constraints.txt`,
which pins every one of those dependencies and everything each of them requires.
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
RANK_FOLDERS = {"instrumentation", "exporter", "schema"}  # what a training rank imports
PROCESSOR_EXTRA = "processor"
RUNTIME_FLOORS = {
    "protobuf": "the exporter encodes with opentelemetry-proto's generated messages: the protobuf runtime "
                "they run on is required by opentelemetry-proto, and its floor is stated in the core",
}
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


def _names(requirements) -> set[str]:
    return {_canonical(Requirement(dep).name) for dep in requirements}


@pytest.mark.slow
def test_core_and_processor_dependencies_are_exactly_what_each_side_imports():
    imports = _third_party_imports()
    optional = {name for name in imports if name.split(".")[0] in TRAINING_STACK}
    needed: dict[str, set[str]] = {}
    top_levels = md.packages_distributions()
    # A requirement whose marker excludes this interpreter (tomli below Python 3.11) is
    # imported only there, behind a guard: neither side of the comparison counts it here.
    elsewhere = {_canonical(r.name) for dep in (*_project()["dependencies"],
                                                *_project()["optional-dependencies"][PROCESSOR_EXTRA])
                 if (r := Requirement(dep)).marker is not None and not r.marker.evaluate()}
    for module in sorted(set(imports) - optional):
        if _canonical(module.split(".")[0]) in elsewhere:
            continue
        needed.setdefault(_distribution_of(module, top_levels), set()).add(module)
    folders_of = {dist: set().union(*(imports[module] for module in modules)) for dist, modules in needed.items()}
    extras = _project()["optional-dependencies"]
    core = _names(_project()["dependencies"]) - elsewhere
    processor = _names(extras[PROCESSOR_EXTRA]) - elsewhere
    helpers = _names(dep for name, deps in extras.items() if name not in (PROCESSOR_EXTRA, "dev")
                     for dep in deps) - core - processor
    assert not core & processor, core & processor
    # The training side's optional helpers (psutil, nvidia-ml-py: the resource sampler) live in
    # training extras, are imported only by the instrumentation, and only inside a guard (tested there).
    for dist in set(needed) & helpers:
        assert folders_of[dist] == {"instrumentation"}, (dist, folders_of[dist])
    def imported_by(*folders: str) -> set[str]:
        return {dist for dist, found in folders_of.items() if found & set(folders)} - helpers

    rank, launcher, service = imported_by(*RANK_FOLDERS), imported_by("launcher"), imported_by("processor")
    # A rank imports the core only: nothing of the processor extra, ever.
    assert not rank - core, {d: sorted(needed[d]) for d in rank - core}
    # The launcher takes from the processor extra only what the processor side renders with (rich:
    # the --live view, compare), after checking that the extra is installed (launcher/cli.py, run.py).
    assert launcher & processor <= service, sorted(launcher & processor - service)
    # A floor the training side states for what its imports run on (never imported by name there).
    for dist, why in RUNTIME_FLOORS.items():
        assert any(_canonical(Requirement(r).name) == dist for carrier in rank for r in md.requires(carrier) or ()), why
    # Both ways: the core is exactly the training side's imports, the extra exactly what the
    # service side adds to them.
    training = rank | (launcher - processor) | set(RUNTIME_FLOORS)
    assert core == training, {"declared, never imported": sorted(core - training),
                              "imported, not declared": sorted(training - core)}
    assert processor == service - core, {"declared, never imported": sorted(processor - service),
                                         "imported, not declared": sorted(service - core - processor)}


@pytest.mark.slow
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
    project = _project()
    todo = [Requirement(dep) for dep in [*project["dependencies"], *project["optional-dependencies"][PROCESSOR_EXTRA]]]
    seen = set()
    while todo:
        requirement = todo.pop()
        name = _canonical(requirement.name)
        if name in seen or (requirement.marker is not None and not requirement.marker.evaluate({"extra": ""})):
            continue  # a requirement below Python 3.11 is not installed in the image (3.12) nor here
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
    # The processor extra, not the bare core: the image is the service side.
    assert re.search(r"pip install[^&]*-c processor-constraints\.txt \"?\.\[processor\]", text)
