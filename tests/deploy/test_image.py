"""The Dockerfile, read as Docker would, and its ENTRYPOINT + CMD run outside Docker."""
from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
import urllib.request

import pytest
from tests.deploy.deploy_files import ROOT, EntrypointProcessor, dockerfile_instructions, flag_values, image_command, instruction
from harness import free_port

TRAINING_STACK = ("torch", "transformers", "lightning", "accelerate")


def test_dockerfile_shape():
    ins = dockerfile_instructions()
    assert ins[0].keyword == "FROM" and "-slim" in ins[0].args
    (user,) = instruction("USER", ins)
    assert user.args.split(":")[0] not in ("root", "0")
    assert any('"/data"' in i.args for i in instruction("VOLUME", ins))
    assert set(" ".join(i.args for i in instruction("EXPOSE", ins)).split()) == {"4317", "4318", "9464"}
    (check,) = instruction("HEALTHCHECK", ins)
    argv = check.exec_form()
    assert argv[0] == "python" and "/healthz" in argv[-1] and "curl" not in check.args
    argv = image_command()
    assert argv[0] == "traceml-processor"
    flags = flag_values(argv)
    for flag in ("--otlp-grpc", "--otlp-http", "--prometheus"):
        assert flags[flag].startswith("0.0.0.0:"), flag  # reachable from other containers


def test_the_image_installs_no_training_stack():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # The image is the core plus the processor extra (the service side), nothing else.
    for dep in [*project["dependencies"], *project["optional-dependencies"]["processor"]]:
        name = re.split(r"[<>=!~\[ ;]", dep, 1)[0].lower()
        assert name not in TRAINING_STACK, dep
    runs = " ".join(i.args for i in instruction("RUN"))
    installs = re.findall(r"pip install[^&]*", runs)
    assert installs and all(re.findall(r"\[([^\]]*)\]", cmd) in ([], ["processor"])
                            and not any(t in cmd for t in TRAINING_STACK) for cmd in installs)
    assert any("[processor]" in cmd for cmd in installs)


def test_every_copied_source_exists_and_is_not_dockerignored():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:
        result = False
        for pattern in patterns:  # last match wins, `!` re-includes
            negate = pattern.startswith("!")
            body = pattern[1:] if negate else pattern
            if fnmatch.fnmatch(path, body.rstrip("/")) or fnmatch.fnmatch(path + "/", body):
                result = not negate
        return result

    for copy in instruction("COPY"):
        sources = copy.args.split()[:-1]
        for source in sources:
            assert (ROOT / source).exists(), source
            assert not ignored(source), f"{source} is excluded by .dockerignore"
    assert ignored("tests") and ignored(".venv") and ignored(".git")


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    proc = EntrypointProcessor(tmp_path_factory.mktemp("image"), free_port)
    yield proc
    assert proc.stop() == 0, proc.log_text()


@pytest.mark.slow
def test_the_entrypoint_command_serves_healthz_readyz_and_metrics(processor):
    for path in ("/healthz", "/readyz"):
        with urllib.request.urlopen(f"http://127.0.0.1:{processor.port(4318)}{path}", timeout=5) as response:
            assert response.status == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{processor.port(9464)}/metrics", timeout=5) as response:
        assert b"traceml_processor_runs 0" in response.read()
    # The image's HEALTHCHECK command, as written, succeeds against it.
    result = subprocess.run(processor.healthcheck_argv(), capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    # SQLite and summaries go under the (substituted) /data volume.
    assert (processor.data / "traceml.db").exists()
    assert "ready" in processor.log_text()
    # It ran with the training stack unimportable, as in the image.
    blocked = subprocess.run([sys.executable, "-c", "import torch"], env=processor.env,
                             capture_output=True, text=True, timeout=60)
    assert blocked.returncode != 0 and "not installed in the traceml-processor image" in blocked.stderr


def test_the_healthcheck_fails_when_nothing_listens():
    port = free_port()
    argv = [a.replace("127.0.0.1:4318", f"127.0.0.1:{port}") for a in
            instruction("HEALTHCHECK")[0].exec_form()]
    result = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
