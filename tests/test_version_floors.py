"""The floors: one owner (schema/version_floors.py) that pyproject.toml agrees with, and the refusals.

A component older than its floor stops `traceml run` and `traceml-processor` with one
line naming the package, the version found and the floor (exit 2, no traceback), and
`traceml.init()` with `UnsupportedVersion`. The old component is a real distribution
record (a `.dist-info` folder first on the child's path), read the way any installed
package is read. checks/compat.py runs the environment test in every column.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from traceml.schema import version_floors as vf

ROOT = Path(__file__).resolve().parents[1]


def _declared_lower_bounds() -> dict[str, dict[str, str]]:
    """Every `>=` bound pyproject.toml declares, per extra ('' for the dependencies; dev and gpu left out)."""
    import tomllib

    from packaging.requirements import Requirement

    bounds: dict[str, dict[str, str]] = {}
    for path in [ROOT / "pyproject.toml", *sorted(ROOT.glob("*/pyproject.toml"))]:
        project = tomllib.loads(path.read_text()).get("project", {})
        extras = project.get("optional-dependencies", {})
        groups = [("", project.get("dependencies", [])),
                  *((name, reqs) for name, reqs in extras.items() if name not in ("dev", "gpu"))]
        for extra, lines in groups:
            for line in lines:
                req = Requirement(line)
                name = re.sub(r"[-_.]+", "-", req.name).lower()
                for spec in req.specifier:
                    if spec.operator == ">=":
                        mine = bounds.setdefault(extra, {})
                        assert mine.setdefault(name, spec.version) == spec.version, (extra, line)
    return bounds


def _padded(version: str) -> tuple[int, ...]:
    return vf.release(version) + (0,) * (3 - len(vf.release(version)))


def test_pyproject_declares_exactly_the_floors():
    declared = _declared_lower_bounds()
    owned = {name: floor for name, floor in vf.FLOORS.items() if name != "pytorch-lightning"}
    assert {name for group in declared.values() for name in group} == set(owned)
    for extra, group in declared.items():
        # An extra with its own floors declares those; every other bound is the plain floor.
        expected = vf.floors(extra if extra in vf.EXTRA_FLOORS else "")
        for name, bound in group.items():
            assert _padded(bound) == vf.release(expected[name]), (extra, name)
    for extra, own in vf.EXTRA_FLOORS.items():
        assert set(own) <= set(declared[extra]), extra
        assert all(_padded(own[name]) > vf.release(vf.FLOORS[name]) for name in own), extra
    assert vf.FLOORS["pytorch-lightning"] == vf.FLOORS["lightning"]
    assert set(vf.TRAINING) | set(vf.PROCESSOR) == set(vf.FLOORS)


def test_this_environment_is_at_or_above_every_floor():
    assert vf.too_old() == []
    assert vf.refusal("traceml") is None


def test_release_numbers_ignore_local_and_pre_release_suffixes():
    assert vf.release("2.13.0+cpu") == (2, 13, 0)
    assert vf.release("4.47.0rc1") == (4, 47, 0)
    assert vf.release("1.24") == (1, 24)
    assert vf._at_least("1.24", "1.24.0") and vf._at_least("2.1.0a0+git1234", "2.1.0")
    assert not vf._at_least("2.0.1", "2.1.0") and vf._at_least("2.10.0", "2.9.5")


def _old(tmp_path: Path, name: str, version: str) -> dict[str, str]:
    """An environment whose path finds `name` at `version` first (a plain dist-info record)."""
    folder = tmp_path / "old"
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    import os

    return {**os.environ, "PYTHONPATH": str(folder)}


@pytest.mark.parametrize("module, argv, package, old", [
    ("traceml.launcher.cli", ["run", "--nproc-per-node", "2", "train.py"], "h11", "0.13.0"),
    ("traceml.launcher.cli", ["demo"], "torch", "2.0.1"),
    ("traceml.processor.cli", ["--db", "x.db"], "opentelemetry-sdk", "1.26.0"),
])
@pytest.mark.slow
def test_a_command_refuses_a_component_below_its_floor_in_one_line(tmp_path, module, argv, package, old):
    env = _old(tmp_path, package, old)
    out = subprocess.run([sys.executable, "-m", module, *argv], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    program = "traceml" if module.startswith("traceml.launcher") else "traceml-processor"
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr == (f"{program}: TraceML needs {package} >= {vf.FLOORS[package]}, but {package} {old} "
                          f"is installed: upgrade it (pip install '{package}>={vf.FLOORS[package]}')\n")
    assert not (tmp_path / "x.db").exists() and not (tmp_path / "traceml_runs").exists()


def test_init_raises_unsupported_version_naming_the_component(tmp_path):
    env = _old(tmp_path, "transformers", "4.40.0")
    code = ("import traceml\n"
            "from traceml.schema.version_floors import UnsupportedVersion\n"
            "try:\n    traceml.init()\nexcept UnsupportedVersion as exc:\n    print('refused:', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("refused: TraceML needs transformers >= 4.46.1, but transformers 4.40.0 is "
                                  "installed: upgrade it (pip install 'transformers>=4.46.1')")


@pytest.mark.slow
def test_the_huggingface_integration_refuses_a_torch_below_its_own_floor(tmp_path):
    """torch at the plain floor starts TraceML, but the HF integration wants the huggingface extra's torch."""
    plain, own = vf.FLOORS["torch"], vf.floors("huggingface")["torch"]
    env = _old(tmp_path, "torch", plain)
    code = ("import traceml\n"
            "from traceml.schema.version_floors import UnsupportedVersion\n"
            "from traceml.integrations import huggingface\n"
            "traceml.init()\n"
            "print('traceml started')\n"
            "try:\n    huggingface.init()\nexcept UnsupportedVersion as exc:\n    print('refused:', exc)\n"
            "print('installed:', huggingface.is_installed())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "traceml started",
        f"refused: TraceML's huggingface integration needs torch >= {own}, but torch {plain} is installed: "
        f"upgrade it (pip install 'torch>={own}')",
        "installed: False"]


def test_help_still_answers_beside_an_old_component(tmp_path):
    env = _old(tmp_path, "torch", "2.0.1")
    out = subprocess.run([sys.executable, "-m", "traceml.launcher.cli", "run", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage: traceml run"), out.stderr
