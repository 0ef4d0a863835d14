"""The two installs of the built wheel, each in a fresh virtual environment beside a user's torch.

README "Install": `pip install traceml-otel` is the training side (what a rank and
`traceml run --endpoint` import), `pip install 'traceml-otel[processor]'` adds the
service side. Here the wheel (built from its sdist by scripts/build_dist.py, or the one
CI built: `TRACEML_TEST_DIST`) goes into a new venv whose only other package is the
user's torch (this interpreter's, exposed by a path file with what it requires, as an
existing training environment holds it):

- core only: none of the service stack is installed; every training-side module
  imports; a 2-rank straggler loop under `traceml run --endpoint` delivers every step
  to a receiver; `traceml run` without an endpoint, `traceml summary` and
  `traceml-processor` refuse at once with the install line, not a traceback;
- then the processor extra into the same venv: the same loop under plain `traceml run`
  (embedded processor) ends with the input straggler diagnosed on rank 1.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.otlp_receiver import OtlpTestReceiver
from tests.launcher.launcher_helpers import SCRIPTS, clean_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SERVICE_STACK = ("numpy", "rich", "prometheus-client", "h11", "opentelemetry-sdk", "opentelemetry-api",
                 "opentelemetry-exporter-otlp-proto-grpc", "opentelemetry-exporter-otlp-proto-http")
STRAGGLER = [str(SCRIPTS / "plain_loop.py"), "--updates", "20", "--straggler-rank", "1", "--delay-ms", "25"]

_IMPORT_TRAINING_SIDE = """
import importlib, json, pkgutil, sys
import traceml, traceml.exporter, traceml.schema, traceml.launcher
failed = []
for package in (traceml, traceml.exporter, traceml.schema, traceml.launcher):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name.startswith("traceml.processor") or info.name == "traceml.launcher.demo_workload":
            continue
        try:
            importlib.import_module(info.name)
        except Exception as exc:
            failed.append([info.name, repr(exc)])
print(json.dumps({"failed": failed, "file": traceml.__file__,
                  "loaded": sorted({n.split(".")[0] for n in sys.modules} & {"numpy", "rich", "h11", "prometheus_client"})}))
"""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(name: str, seen: set[str]) -> set[str]:
    """`name` and every distribution it requires (unconditionally), as installed here."""
    name = _canonical(name)
    if name in seen:
        return seen
    seen.add(name)
    from packaging.requirements import Requirement

    for line in md.requires(name) or ():
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            _closure(requirement.name, seen)
    return seen


def _expose_torch(site: Path) -> None:
    """The user's torch: this interpreter's torch and what it requires, linked into a folder that a
    path file puts on the new venv's path (torch itself is not reinstalled: 700 MB)."""
    folder = site.parent / "users-torch"
    folder.mkdir()
    for dist in _closure("torch", set()):
        files = md.distribution(dist).files or ()
        for top in {file.parts[0] for file in files if not file.parts[0].startswith("..")}:
            source = Path(md.distribution(dist).locate_file(top))
            if source.exists() and not (folder / top).exists() and top != "bin":
                (folder / top).symlink_to(source)
    (site / "users-torch.pth").write_text(str(folder) + "\n")


def _wheel(tmp: Path) -> Path:
    built = os.environ.get("TRACEML_TEST_DIST")
    if built:
        (wheel,) = Path(built).glob("traceml_otel-*.whl")
        return wheel
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_dist.py"), str(tmp / "dist")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("traceml_otel-*.whl")
    return wheel


def _pip(venv: Path, *args: str) -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                          "--disable-pip-version-check", *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def _installed(venv: Path) -> set[str]:
    code = "import importlib.metadata as m, json; print(json.dumps(sorted({d.metadata['Name'] for d in m.distributions()})))"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=60,
                         check=True)
    return {_canonical(name) for name in json.loads(out.stdout)}


def _run(venv: Path, argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=clean_env(TRACEML_EXIT_AFTER_FLUSH="1"), stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("installs")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    _expose_torch(site)
    wheel = _wheel(tmp)
    _pip(venv, str(wheel))
    (venv / "built-wheel").write_text(str(wheel))  # the processor test adds the extra from the same file
    return venv


def test_the_core_install_is_the_training_side_and_a_rank_exports_with_it(user_venv, tmp_path):
    installed = _installed(user_venv)
    assert "traceml-otel" in installed and "torch" in installed
    assert sorted(installed & set(SERVICE_STACK)) == []
    out = subprocess.run([str(user_venv / "bin" / "python"), "-c", _IMPORT_TRAINING_SIDE], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout)
    assert found["failed"] == [] and found["loaded"] == []
    assert found["file"].startswith(str(user_venv))  # the installed wheel, not the tree
    with OtlpTestReceiver() as receiver:
        run = _run(user_venv, ["traceml", "run", "--nproc-per-node", "2", "--endpoint", receiver.grpc_endpoint,
                               *STRAGGLER], tmp_path)
        assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
        steps = receiver.step_spans()
    assert sorted({key[1:] for key in steps}) == [(rank, step) for rank in (0, 1) for step in range(20)]


def test_the_core_install_refuses_the_processor_side_at_once_with_the_install_line(user_venv, tmp_path):
    line = "pip install 'traceml-otel[processor]'"
    for argv in (["traceml", "run", "--nproc-per-node", "2", *STRAGGLER], ["traceml", "summary", str(tmp_path)],
                 ["traceml-processor", "--db", str(tmp_path / "p.db")]):
        done = _run(user_venv, argv, tmp_path, timeout=120)
        text = done.stdout + done.stderr
        assert done.returncode == 2 and line in text and "Traceback" not in text, (argv, text[-2000:])
        assert "numpy" in text  # what is missing, named
    assert not (tmp_path / "traceml_runs").exists() and not (tmp_path / "p.db").exists()  # nothing started


def test_with_the_processor_extra_traceml_run_diagnoses_the_straggler(user_venv, tmp_path):
    _pip(user_venv, (user_venv / "built-wheel").read_text() + "[processor]")
    assert set(SERVICE_STACK) - {"opentelemetry-api"} <= _installed(user_venv)
    run = _run(user_venv, ["traceml", "run", "--nproc-per-node", "2", "--no-summary-print", *STRAGGLER], tmp_path)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    (summary,) = (tmp_path / "traceml_runs").glob("*/final_summary.json")
    diagnosis = json.loads(summary.read_text())["diagnosis"]
    assert (diagnosis["kind"], diagnosis["culprit_rank"]) == ("INPUT_STRAGGLER", 1), diagnosis
