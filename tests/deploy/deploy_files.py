"""Readers for the deployment files (plain module: `conftest` names collide across folders).

Parses the Dockerfile's instructions, the compose file, collector configs and the
generated dashboards, and runs the image's own ENTRYPOINT + CMD outside Docker.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from deploy import promql_names  # noqa: F401  (re-exported for the tests)
from harness import wait_until

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
COLLECTOR_DIR = DEPLOY / "collector"
DASHBOARD_DIR = DEPLOY / "grafana" / "dashboards"
PROMETHEUS_DIR = DEPLOY / "prometheus"


# --- Dockerfile ------------------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str
    args: str

    def exec_form(self) -> list[str]:
        """JSON (exec) form of CMD / ENTRYPOINT / HEALTHCHECK CMD arguments."""
        text = self.args
        if self.keyword == "HEALTHCHECK":
            text = text[text.index("CMD") + 3:]
        value = json.loads(text.strip())
        if not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
            raise ValueError(f"{self.keyword} is not in exec form: {self.args!r}")
        return value


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[Instruction]:
    """Instructions with line continuations joined and comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
    return out


def instruction(keyword: str, instructions: list[Instruction] | None = None) -> list[Instruction]:
    return [i for i in (instructions or dockerfile_instructions()) if i.keyword == keyword]


def image_command() -> list[str]:
    """ENTRYPOINT + CMD as the container runs them."""
    (entrypoint,) = instruction("ENTRYPOINT")[-1:]
    (cmd,) = instruction("CMD")[-1:]
    return entrypoint.exec_form() + cmd.exec_form()


def flag_values(argv: list[str]) -> dict[str, str]:
    values = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            values[arg] = argv[i + 1]
    return values


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


# --- YAML files --------------------------------------------------------------------------------


def load_yaml(path: Path) -> dict:
    with open(path) as handle:
        return yaml.safe_load(handle)


def compose() -> dict:
    return load_yaml(COMPOSE)


def collector_configs() -> dict[str, dict]:
    return {p.name: load_yaml(p) for p in sorted(COLLECTOR_DIR.glob("*.yaml"))}


# --- dashboards --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    expr: str
    instant: bool


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def panel_queries() -> list[PanelQuery]:
    out = []
    for name, model in dashboards().items():
        for panel in _panels(model["panels"]):
            for target in panel.get("targets", []):
                out.append(PanelQuery(name, panel["title"], target["expr"], bool(target.get("instant"))))
    return out


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana-style variable substitution: `$name` and `${name}`, longest names first."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    if "$" in expr:
        raise AssertionError(f"unsubstituted variable in {expr!r}")
    return expr


# --- the processor from the image's own command ------------------------------------------------

TORCH_BLOCKER = textwrap.dedent('''
    """Installed by tests/deploy as sitecustomize: the image has no torch, so nothing may import it."""
    import importlib.abc, sys

    class _NoTrainingStack(importlib.abc.MetaPathFinder):
        BLOCKED = ("torch", "transformers", "lightning", "pytorch_lightning", "accelerate")

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.BLOCKED:
                raise ImportError(f"{name} is not installed in the traceml-processor image")
            return None

    sys.meta_path.insert(0, _NoTrainingStack())
''')


def image_install(folder: Path) -> Path:
    """The image's Python environment, built as the Dockerfile builds it; returns its bin folder.

    Every COPY of the Dockerfile into a `src` folder, a virtual environment, and the RUN
    instruction's `pip install` (the base dependencies at the constraints' versions) run
    in that folder: torch, transformers and lightning are really absent, not blocked.
    """
    folder = Path(folder)
    src = folder / "src"
    for copy in instruction("COPY"):
        *sources, dest = copy.args.split()
        for source in sources:
            target = src / dest if len(sources) == 1 and not dest.endswith("/") else src / dest / Path(source).name
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / source, target)
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    (run,) = [i.args for i in instruction("RUN") if "pip install" in i.args]
    pip_args = shlex.split(run[run.index("pip install"):].split("&&")[0])[1:]
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", *pip_args, "--disable-pip-version-check", "-q"],
                         cwd=src, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"the image's pip install failed: {out.stderr[-3000:]}")
    return venv / "bin"


class EntrypointProcessor:
    """Runs the Dockerfile's ENTRYPOINT + CMD with loopback free ports and a temp /data.

    The only changes are the ones a container makes invisible: `0.0.0.0:PORT` ->
    `127.0.0.1:FREE` (in the command and in the compose file's environment) and `/data` ->
    a temp folder. From `bin_dir` (an `image_install`),
    the image's own environment, where torch & co. are absent; by default this
    interpreter's, where they are made unimportable, as in the image.
    """

    def __init__(self, folder: Path, free_port, bin_dir: Path | None = None):
        self.folder = Path(folder)
        self.data = self.folder / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.bin_dir = Path(bin_dir) if bin_dir is not None else Path(sys.executable).parent
        blocker = self.folder / "site"
        blocker.mkdir(exist_ok=True)
        if bin_dir is None:
            (blocker / "sitecustomize.py").write_text(TORCH_BLOCKER)
        self.image_argv = image_command()
        self.port_map: dict[int, int] = {}

        def loopback(value: str) -> str:
            """A container's 0.0.0.0:PORT as 127.0.0.1 on a free port (the same container port, the same one)."""
            match = re.fullmatch(r"0\.0\.0\.0:(\d+)", value)
            if match is None:
                return value
            container_port = int(match.group(1))
            if container_port not in self.port_map:
                self.port_map[container_port] = free_port()
            return f"127.0.0.1:{self.port_map[container_port]}"

        argv = []
        for arg in self.image_argv:
            if arg == "/data" or arg.startswith("/data/"):
                arg = str(self.data) + arg[len("/data"):]
            argv.append(loopback(arg))
        exe = shutil.which(argv[0], path=str(self.bin_dir))
        if exe is None:
            raise RuntimeError(f"{argv[0]} is not installed (pip install -e .)")
        self.argv = [exe, *argv[1:]]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACEML_"))}
        env["PYTHONPATH"] = str(blocker)
        # The compose file's addresses too (the web view's 0.0.0.0:8090): several processors of the
        # suite run at once under pytest-xdist, none on a fixed port or every interface.
        env.update({name: loopback(value) for name, value in self.compose_environment().items()})
        self.env = env
        self.log_path = self.folder / "processor.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=self.data)
        if not wait_until(self.ready, 60, 0.1):
            self.stop()
            raise RuntimeError(f"processor not ready: {self.log_text()}")

    @staticmethod
    def compose_environment() -> dict[str, str]:
        return {k: str(v) for k, v in compose()["services"]["traceml-processor"].get("environment", {}).items()}

    def port(self, container_port: int) -> int:
        return self.port_map[container_port]

    def _get(self, path: str, port: int) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
                return response.status
        except OSError:
            return 0

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"processor exited {self.proc.returncode}: {self.log_text()}")
        return self._get("/readyz", self.port(4318)) == 200

    def healthcheck_argv(self) -> list[str]:
        """The image's HEALTHCHECK command, pointed at this process's HTTP port."""
        (check,) = instruction("HEALTHCHECK")[-1:]
        argv = check.exec_form()
        argv = [a.replace("127.0.0.1:4318", f"127.0.0.1:{self.port(4318)}") for a in argv]
        if argv[0] == "python":
            argv[0] = str(self.bin_dir / "python")
        return argv

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""

    def stop(self) -> int | None:
        code = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait(10)
        else:
            code = self.proc.returncode
        self._log.close()
        return code


def shell_join(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


# --- what a collector config does with one OTLP request -------------------------------------
#
# No Collector binary runs here (no Docker, and none can be fetched), so a request's path
# through a config is worked out from the config itself, with the Collector's documented
# rules: every pipeline whose receivers name `otlp` gets a copy; a connector listed as an
# exporter hands the data to the pipelines that list it as a receiver; the routing
# connector sends a resource to the pipelines of the first route whose condition holds,
# else to `default_pipelines` (the behaviour since `match_once` went away in 0.120);
# a filter processor drops the metrics its conditions match. Anything outside the small
# grammar below is refused, so a config cannot pass by using what this reader ignores.

_RESOURCE_CONDITION = re.compile(r'attributes\["([^"]+)"\]\s*(==|!=)\s*(nil|"(?:[^"\\]|\\.)*")')
_FILTER_NAME_MATCH = re.compile(r'IsMatch\(name, "((?:[^"\\]|\\.)+)"\)')
_PASS_THROUGH_PROCESSORS = {"memory_limiter", "batch"}


@dataclass(frozen=True)
class OtlpBatch:
    """One resource's worth of an OTLP request: its signal, resource attributes and the
    names of its spans or metrics."""
    signal: str
    resource: dict
    names: tuple[str, ...]


def component_type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def resource_condition_holds(condition: str, resource: dict) -> bool:
    """An OTTL condition in the resource context, in the one form the configs use:
    `attributes["key"] == nil | != nil | == "value" | != "value"`."""
    match = _RESOURCE_CONDITION.fullmatch(condition.strip())
    if match is None:
        raise AssertionError(f"routing condition outside the checked grammar: {condition!r}")
    key, op, literal = match.groups()
    value = resource.get(key)
    expected = None if literal == "nil" else json.loads(literal)
    return (value == expected) if op == "==" else (value != expected)


def _route(connector: dict, batch: OtlpBatch) -> list[str]:
    for item in connector["table"]:
        if item.get("context") != "resource" or "statement" in item:
            raise AssertionError(f"only `context: resource` conditions are checked: {item}")
        if resource_condition_holds(item["condition"], batch.resource):
            return list(item["pipelines"])
    return list(connector.get("default_pipelines", []))


def _filtered(config: dict, processor: str, batch: OtlpBatch) -> OtlpBatch:
    kind = component_type(processor)
    if kind in _PASS_THROUGH_PROCESSORS:
        return batch
    if kind != "filter":
        raise AssertionError(f"processor {processor} is not modelled")
    settings = config["processors"][processor]
    if batch.signal != "metrics":
        if batch.signal in settings:
            raise AssertionError(f"{processor}: only metric filters are modelled")
        return batch
    patterns = []
    for condition in settings.get("metrics", {}).get("metric", []):
        match = _FILTER_NAME_MATCH.fullmatch(condition.strip())
        if match is None:
            raise AssertionError(f"{processor}: filter condition outside the checked grammar: {condition!r}")
        # OTTL string literal: `\\` is one backslash in the regex.
        patterns.append(re.compile(match.group(1).replace("\\\\", "\\")))
    kept = tuple(n for n in batch.names if not any(p.search(n) for p in patterns))
    return OtlpBatch(batch.signal, batch.resource, kept)


def collector_destinations(config: dict, batch: OtlpBatch, receiver: str = "otlp") -> dict[str, set[str]]:
    """Exporter id -> the span or metric names of `batch` it is handed, for a batch that
    arrives at `receiver`. Connectors are followed (at most 8 hops, against loops)."""
    pipelines = config["service"]["pipelines"]
    connectors = config.get("connectors") or {}
    out: dict[str, set[str]] = {}
    pending = [(pid, batch, 0) for pid, p in pipelines.items()
               if component_type(pid) == batch.signal and receiver in p.get("receivers", [])]
    while pending:
        pipeline_id, data, hops = pending.pop()
        if hops > 8:
            raise AssertionError(f"connector loop through {pipeline_id}")
        pipeline = pipelines[pipeline_id]
        for processor in pipeline.get("processors", []):
            data = _filtered(config, processor, data)
        if not data.names:
            continue
        for exporter in pipeline["exporters"]:
            if exporter in connectors:
                if component_type(exporter) != "routing":
                    raise AssertionError(f"connector {exporter} is not modelled")
                for target in _route(connectors[exporter], data):
                    assert exporter in pipelines[target]["receivers"], \
                        f"{exporter} routes to {target}, which does not receive from it"
                    assert component_type(target) == data.signal, f"{exporter} routes {data.signal} to {target}"
                    pending.append((target, data, hops + 1))
            else:
                out.setdefault(exporter, set()).update(data.names)
    return out
