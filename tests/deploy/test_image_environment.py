"""The processor image's own Python environment, built as the Dockerfile builds it.

tests/test_import_rules.py and test_image.py make the training stack unimportable in
the test interpreter; here it is really absent: every COPY of the Dockerfile, a new
virtual environment and its RUN's `pip install` (base dependencies at the constraints'
versions). In that environment every service-side module imports, the CLIs answer,
and the image's ENTRYPOINT + CMD ingests a run and stops cleanly.
"""
from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest

from tests.deploy.deploy_files import EntrypointProcessor, image_install
from harness import free_port, wait_until
from harness.otlp_payloads import run_end_span, step_span, trace_request

pytestmark = pytest.mark.slow

TRAINING_STACK = ("torch", "transformers", "lightning", "pytorch_lightning", "accelerate", "psutil", "pynvml")

_IMPORT_EVERYTHING = """
import importlib, importlib.util, json, pkgutil, sys
absent = [name for name in {stack!r} if importlib.util.find_spec(name) is None]
import traceml, traceml.processor, traceml.schema, traceml.exporter
failed = []
for package in (traceml.processor, traceml.schema, traceml.exporter):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        try:
            importlib.import_module(info.name)
        except Exception as exc:
            failed.append([info.name, repr(exc)])
unresolved = [name for name in traceml.__all__ if getattr(traceml, name, None) is None]
import traceml.launcher.cli
loaded = sorted({{name.split(".")[0] for name in sys.modules}} & set({stack!r}))
print(json.dumps({{"absent": absent, "failed": failed, "unresolved": unresolved, "loaded": loaded}}))
"""


@pytest.fixture(scope="module")
def image_bin(tmp_path_factory):
    return image_install(tmp_path_factory.mktemp("image-env"))


def test_the_image_environment_lacks_the_training_stack_and_imports_every_service_module(image_bin):
    out = subprocess.run([str(image_bin / "python"), "-c", _IMPORT_EVERYTHING.format(stack=TRAINING_STACK)],
                         capture_output=True, text=True, timeout=300, cwd=image_bin)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout)
    assert found["absent"] == list(TRAINING_STACK)  # really absent, not blocked
    assert found["failed"] == [] and found["unresolved"] == [] and found["loaded"] == []
    for command in (["traceml-processor", "--version"], ["traceml", "--help"]):
        answered = subprocess.run([str(image_bin / command[0]), *command[1:]], capture_output=True, text=True,
                                  timeout=120)
        assert answered.returncode == 0, answered.stderr[-3000:]


def _post(port: int, message) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/traces", data=message.SerializeToString(),
                                     headers={"Content-Type": "application/x-protobuf"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_the_image_command_from_its_own_environment_ingests_a_run_and_stops(image_bin, tmp_path):
    processor = EntrypointProcessor(tmp_path, free_port, bin_dir=image_bin)
    try:
        http = processor.port(4318)
        for rank in (0, 1):
            _post(http, trace_request("image-env", rank, [step_span(step, rank) for step in range(5)]))
            _post(http, trace_request("image-env", rank, [run_end_span(rank, 5)]))
        assert wait_until(lambda: "traceml_processor_runs 1" in _metrics(processor.port(9464)), 30), \
            processor.log_text()
        check = subprocess.run(processor.healthcheck_argv(), capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr
    finally:
        code = processor.stop()
    assert code == 0, processor.log_text()
    assert (processor.data / "traceml.db").exists()
    # The run ended on both ranks: its analysis ran there and wrote the final summary.
    (summary,) = (processor.data / "summaries").rglob("final_summary.json")
    assert json.loads(summary.read_text())["metadata"]["run_id"] == "image-env"
