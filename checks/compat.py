"""The supported versions, tested at both ends: one cached virtual environment per column, a real smoke suite in each.

Columns (`COLUMNS`):
- `lowest`: the oldest Python the package declares and every declared lower bound
  installed exactly (`name==floor`, from `traceml.schema.version_floors`, which
  tests/test_version_floors.py holds equal to pyproject.toml); a case whose
  integration has floors of its own (`EXTRA_FLOORS`) is left to that extra's column;
- `lowest-<extra>`: the same, with that extra's own floors (torch 2.2.0 for
  `huggingface`), running only that integration's cases;
- `pinned`: Python 3.11 and each component at the version the project's `.venv` holds
  (what `scripts/setup.sh` installs and CI tests);
- `newest`: the newest Python the package is tried on and the newest release of each
  component the index serves. This machine's pip configuration caps torch at the
  releases on its disk; the column passes its own (empty) constraints file instead,
  so the cap does not apply to it.

Each column is a venv under `$TRACEML_COMPAT_CACHE` (default `~/.cache/traceml-compat/<column>`),
outside the tree: the components are installed once (again with `--rebuild`, or
`--refresh` to take the index's newest again). On every run the commit under test
(`--commit`, default HEAD; others' uncommitted edits never reach a column) is
extracted to a temporary folder, built into a wheel there and installed with
`--no-deps`, and `pip check` says whether the column satisfies what the package
declares. The smoke suite is existing tests selected by node id (`SMOKE`), run by
the column's python from that extracted tree (the tests import `tests.*` and
`harness.*` from its root); nothing is copied into the repository. Results go to
docs/compatibility.json (one record per column, the last run of each kept) and
docs/compatibility.md is rendered from it.

    .venv/bin/python checks/compat.py                    # every column
    .venv/bin/python checks/compat.py --column lowest    # one column (others' records kept)
    .venv/bin/python checks/compat.py --render           # only re-render the page

A torch release other than 2.13.0 is a CUDA build of several GB from the index: the
first build of `lowest` or `newest` downloads one (about 3 GB; minutes here).
Exit status 1 when a smoke case failed or the column could not be built.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tree_module(name: str, path: Path):
    """A stdlib-only module read from the tree (no install needed, nothing added to sys.path)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolves the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


version_floors = _tree_module("_compat_version_floors", ROOT / "schema" / "version_floors.py")

RECORD = ROOT / "docs" / "compatibility.json"
PAGE = ROOT / "docs" / "compatibility.md"
CACHE = Path(os.environ.get("TRACEML_COMPAT_CACHE", Path.home() / ".cache" / "traceml-compat"))

SHOWN = ("python", "torch", "transformers", "accelerate", "lightning", "pytorch-lightning", "numpy",
         "protobuf", "grpcio", "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-proto",
         "opentelemetry-exporter-otlp-proto-grpc", "opentelemetry-exporter-otlp-proto-http",
         "googleapis-common-protos", "requests", "psutil", "rich", "prometheus-client", "h11")
"""The packages whose version each column records (the range the page declares)."""

COMPONENTS = tuple(version_floors.FLOORS)
"""What a column installs: every component with a floor (pytorch-lightning too: the integration patches
both namespaces, and the tests run under each)."""

TEST_TOOLS = ("pytest>=8", "pytest-timeout>=2.3", "jsonschema>=4.20", "pexpect>=4.9", "pyyaml>=6",
              "packaging")
"""What the selected tests themselves import; not under test, so never pinned."""


@dataclass(frozen=True)
class Case:
    """One smoke case: what it shows, and the existing tests that show it."""

    name: str
    what: str
    tests: tuple[str, ...]
    extra: str = ""
    """The pyproject extra whose integration the case exercises ('' for none in particular)."""


SMOKE = (
    Case("ddp-input-straggler",
         "`traceml run`, 2 gloo ranks, an unmodified DDP loop with a slow loader on rank 1: "
         "one step per update, INPUT_STRAGGLER on rank 1 (and the same loop marked by hand)",
         ("tests/launcher/test_zero_code_loops.py::"
          "test_an_unmarked_loop_gets_one_step_per_update_and_the_marked_loops_diagnosis",)),
    Case("hf-trainer",
         "HF Trainer: an unmodified script under `traceml run` (2 ranks), and in process every event inside its step",
         # Not the 4/4/2 accumulation test: transformers 4.46 itself makes 2 updates of 10 batches
         # accumulating 4 (the remainder is dropped), later releases 3; the test's counts are the latter's.
         ("tests/launcher/test_launcher_e2e.py::test_hugging_face_trainer_script_is_instrumented_without_code_changes",
          "tests/integrations/test_hf_trainer.py::test_each_event_lies_inside_its_step"),
         extra="huggingface"),
    Case("lightning",
         "Lightning: an unmodified script under `traceml run` (2 ranks), and accumulation groups 4/4/2 in process",
         ("tests/launcher/test_launcher_e2e.py::test_lightning_script_is_instrumented_without_code_changes",
          "tests/integrations/test_lightning_trainer.py::test_ten_batches_accumulating_four_publish_groups_of_four_four_two")),
    Case("collective-wait",
         "collectives and `Work.wait` timed in a plain loop; DDP's slow rank waits least; "
         "a rank slowed inside backward is named under `traceml run`",
         ("tests/instrumentation/test_collective_wait.py::test_explicit_collectives_in_a_plain_loop_are_timed",
          "tests/instrumentation/test_collective_wait.py::test_ddp_rank_slowed_in_backward_waits_least_and_enters_last",
          "tests/launcher/test_collective_diagnosis.py::test_a_rank_slowed_inside_backward_is_named_with_backward_grown")),
    Case("otel-exporters-ingest",
         "the official OTel SDK exporters (gRPC and HTTP) into the processor: spans stored, host metrics joined",
         ("tests/processor/test_summary_export_security_cli.py::test_opentelemetry_sdk_exporters_drive_both_receivers",
          "tests/processor/test_resource_ingest.py::"
          "test_a_real_processor_joins_sdk_sent_host_metrics_to_the_run_on_that_host")),
    Case("summary-push",
         "the processor's summary metrics pushed through the SDK's exporters over gRPC and over HTTP",
         ("tests/processor/test_summary_export_security_cli.py::test_summary_metrics_are_pushed_over_otlp[grpc]",
          "tests/processor/test_summary_export_security_cli.py::test_summary_metrics_are_pushed_over_otlp[http/protobuf]")),
    Case("version-floors",
         "the floor check accepts this column's versions and refuses older ones with one line",
         ("tests/test_version_floors.py::test_this_environment_is_at_or_above_every_floor",
          "tests/test_version_floors.py::test_a_command_refuses_a_component_below_its_floor_in_one_line",
          "tests/test_version_floors.py::test_init_raises_unsupported_version_naming_the_component")),
)


EXPLAINED: dict[tuple[str, str], str] = {}
"""(column, case) -> why it failed there, shown under the smoke table while it fails."""

SEEN = (
    "2026-12-02, the huggingface extra's torch floor: at torch 2.1.0 (the lowest column before) the 2-rank HF "
    "Trainer run failed under `traceml run` and the same way under plain `torchrun` without TraceML, because "
    "Accelerate's `PartialState.set_device` calls `torch.cpu.set_device` on a CPU job spanning processes. "
    "torch 2.1.0's `torch/cpu/__init__.py` has no `set_device`; 2.2.0's wheel has it (a no-op kept for "
    "device-agnostic code). So the huggingface extra requires torch 2.2.0 (`EXTRA_FLOORS`), the HF "
    "integration refuses an older torch by name, and the lowest-huggingface column runs the HF case there; "
    "2.1.1 and 2.1.2 were not tried (patch releases of the branch without it). The in-process HF test "
    "passed at 2.1.0; on CUDA Accelerate calls `torch.cuda.set_device`, which 2.1 has, but that was not run.",
    "2026-12-02, torch 2.15.0 (newest column, Python 3.13): the DDP straggler loop's figures were off at "
    "first (`traceml run` of tests/launcher/scripts/plain_loop.py, 30 updates, rank 1's loader 25 ms slower: "
    "a 41-73 ms mean step and 9-17 ms of input wait on the balanced rank 0, where the loop timing itself saw "
    "about 36 ms and 0.4 ms). Cause: one full garbage collection of the ~340k objects left by the imports, "
    "brought into step ~20 by TraceML's own allocations, took 0.35-0.65 s inside one fetch's collate (Python "
    "3.13 collects less often than 3.11, where it ran before the loop). Fixed in 720fc8b: automatic mode pays "
    "that collection at the first optimizer update, between step 0 and step 1. After it, four runs on 2.15 "
    "gave 26.0-26.2 ms of input wait on rank 1 and 0.5-0.7 ms on rank 0, each an INPUT_STRAGGLER on rank 1; "
    "the medians were right before and after.",
    "2026-12-02, the ddp-input-straggler case under load (load average 4-5 from other suites on the 2 cores): "
    "it failed once in the lowest column (the loop marked by hand named a generic STRAGGLER on rank 1, not "
    "INPUT_STRAGGLER) and once in the newest (INPUT_BOUND), and passed in the runs before and after on the same "
    "venvs. Its verdict is timing-sensitive on a shared machine; the other cases never flipped.",
)
"""What a column showed beyond pass/fail, dated (rendered as written)."""


@dataclass(frozen=True)
class Column:
    name: str
    what: str
    python: str
    """The Python version the venv is built with ('3.10')."""
    pins: str = ""
    """'floors': each component exactly at its floor; 'project': at the version the project's .venv
    holds (what scripts/setup.sh installs and CI tests); '': the newest the index serves."""
    extra: str = ""
    """With 'floors': the pyproject extra whose own floors apply (`version_floors.floors(extra)`); the
    column then runs only that extra's cases."""


PROJECT_VENV = ROOT / ".venv"

COLUMNS = {
    "lowest": Column("lowest", "every declared floor, the oldest declared Python", "3.10", pins="floors"),
    "lowest-huggingface": Column("lowest-huggingface",
                                 "the huggingface extra's floors (torch 2.2.0), every other floor, the oldest "
                                 "declared Python; its cases only", "3.10", pins="floors", extra="huggingface"),
    "pinned": Column("pinned", "the versions of the project's .venv (scripts/setup.sh; what CI tests)", "3.11",
                     pins="project"),
    "newest": Column("newest", "the newest release of each component the index serves, the newest Python tried",
                     "3.13"),
}


@dataclass
class Outcome:
    """What one column's run recorded (one entry of docs/compatibility.json)."""

    column: str
    date: str
    python: str
    platform: str
    versions: dict[str, str]
    cases: dict[str, str]
    tests: dict[str, str] = field(default_factory=dict)
    build_s: float = 0.0
    smoke_s: float = 0.0
    pip_check: str = ""
    error: str = ""
    commit: str = ""

    @property
    def passed(self) -> bool:
        return not self.error and bool(self.cases) and all(r == "passed" for r in self.cases.values())


def column_cases(column: Column) -> tuple[Case, ...]:
    """The smoke cases a column runs: a floors column leaves a case whose integration has floors of its
    own to that extra's column (at the plain floors the case is below its extra's, and refused)."""
    if column.extra:
        return tuple(case for case in SMOKE if case.extra == column.extra)
    if column.pins == "floors":
        return tuple(case for case in SMOKE if case.extra not in version_floors.EXTRA_FLOORS)
    return SMOKE


def _python_for(version: str) -> str:
    """pyenv's interpreter of that version first: its `pythonX.Y` shim on PATH answers "command not
    found" unless the version is activated."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for candidate in sorted(pyenv.glob(f"{version}.*"), reverse=True):
        if (candidate / "bin" / "python").exists():
            return str(candidate / "bin" / "python")
    found = shutil.which(f"python{version}")
    if found:
        return found
    raise SystemExit(f"error: no Python {version} found (python{version} on PATH or pyenv)")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, text=True, **kw)


def _requirements(column: Column) -> list[str]:
    if column.pins == "floors":
        floors = version_floors.floors(column.extra)
        return [f"{name}=={floors[name]}" for name in COMPONENTS]
    if column.pins == "project":
        held = _versions(PROJECT_VENV / "bin" / "python")
        return [f"{name}=={held[name]}" for name in COMPONENTS if name in held]
    return list(COMPONENTS)


def _pip_env(constraints: Path) -> dict[str, str]:
    # The column's own constraints file replaces the machine's (PIP_CONSTRAINT wins over
    # pip's configuration files): the newest column is not held at the machine's torch cap.
    return {**os.environ, "PIP_CONSTRAINT": str(constraints), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _build(column: Column, venv: Path, rebuild: bool, refresh: bool, src: Path) -> None:
    if rebuild and venv.exists():
        shutil.rmtree(venv)
    python = venv / "bin" / "python"
    if not python.exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        _run([_python_for(column.python), "-m", "venv", str(venv)], check=True)
    wanted = "\n".join([*_requirements(column), *TEST_TOOLS]) + "\n"
    marker = venv / "compat-requirements.txt"
    constraints = venv / "compat-constraints.txt"
    constraints.write_text("".join(f"{r}\n" for r in _requirements(column)) if column.pins else "")
    if refresh or not marker.exists() or marker.read_text() != wanted:
        marker.unlink(missing_ok=True)
        cmd = [str(python), "-m", "pip", "install", "-q", *(["--upgrade"] if not column.pins else []),
               *_requirements(column), *TEST_TOOLS]
        _run(cmd, check=True, env=_pip_env(constraints))
        marker.write_text(wanted)
    _install_project(python, constraints, src)


def _snapshot(dest: Path, commit: str) -> str:
    """The commit's tree extracted into `dest` (others' uncommitted edits never reach a column); its hash."""
    full = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", full], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return full


def _install_project(python: Path, constraints: Path, src: Path) -> None:
    """The snapshot built into a wheel and installed without dependencies (the column's are already there)."""
    with tempfile.TemporaryDirectory(prefix="traceml-compat-wheel-") as tmp:
        _run([str(python), "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp, str(src)], check=True,
             env=_pip_env(constraints), stdout=subprocess.DEVNULL)
        _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
              *map(str, sorted(Path(tmp).glob("*.whl")))], check=True, env=_pip_env(constraints))


def _versions(python: Path) -> dict[str, str]:
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format", "json"], check=True,
                            capture_output=True, text=True).stdout
    by_name = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(listed)}
    out = {"python": subprocess.run([str(python), "-c", "import platform; print(platform.python_version())"],
                                    check=True, capture_output=True, text=True).stdout.strip()}
    out.update({name: by_name[name] for name in SHOWN if name in by_name})
    return out


def _smoke(python: Path, cases: tuple[Case, ...], src: Path) -> tuple[dict[str, str], dict[str, str], str]:
    """Run the cases' tests in one pytest session; per-case and per-test results, and pytest's tail."""
    with tempfile.TemporaryDirectory(prefix="traceml-compat-") as tmp:
        junit = Path(tmp) / "junit.xml"
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
        ids = [t for case in cases for t in case.tests]
        proc = _run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                     f"--junitxml={junit}", *ids], cwd=src, env=env, capture_output=True)
        (python.parent.parent / "compat-smoke.log").write_text(proc.stdout + proc.stderr)  # the whole of it
        tail = (proc.stdout + proc.stderr)[-6000:]
        tests = _junit_results(junit) if junit.exists() else {}
    results = {}
    for case in cases:
        mine = [r for test, r in tests.items() if any(_belongs(test, t) for t in case.tests)]
        if not mine:
            results[case.name] = "not run"
        elif any(r == "failed" for r in mine):
            results[case.name] = "failed"
        elif all(r == "passed" for r in mine):
            results[case.name] = "passed"
        else:
            results[case.name] = "skipped"
    return results, tests, tail


def _belongs(test: str, selector: str) -> bool:
    return test == selector or test.startswith(selector + "::")


def _junit_results(path: Path) -> dict[str, str]:
    """junit XML -> {node id: passed|failed|skipped} (node ids rebuilt from file and name)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        node = f"{module}.py::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            out[node] = "failed"
        elif case.find("skipped") is not None:
            out[node] = "skipped"
        else:
            out[node] = "passed"
    return out


def run_column(column: Column, commit: str, rebuild: bool = False, refresh: bool = False) -> Outcome:
    started = time.monotonic()
    venv = CACHE / column.name
    python = venv / "bin" / "python"
    outcome = Outcome(column.name, dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "",
                      f"{platform.system()} {platform.machine()}", {}, {})
    with tempfile.TemporaryDirectory(prefix="traceml-compat-src-") as tmp:
        src = Path(tmp) / "src"
        try:
            outcome.commit = _snapshot(src, commit)
            _build(column, venv, rebuild, refresh, src)
            check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True)
            outcome.pip_check = (check.stdout + check.stderr).strip()
            outcome.versions = _versions(python)
            outcome.python = outcome.versions.get("python", "")
        except (subprocess.CalledProcessError, OSError) as exc:
            outcome.error = f"build failed: {exc}"
            outcome.build_s = round(time.monotonic() - started, 1)
            return outcome
        outcome.build_s = round(time.monotonic() - started, 1)
        smoke_started = time.monotonic()
        outcome.cases, outcome.tests, tail = _smoke(python, column_cases(column), src)
        outcome.smoke_s = round(time.monotonic() - smoke_started, 1)
    print(tail)  # the failures' detail: here and in the column's compat-smoke.log, not in the record
    return outcome


def _load() -> dict[str, dict]:
    records = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    for record in records.values():  # only a build failure's reason belongs in the record
        if not record.get("error", "").startswith("build failed"):
            record["error"] = ""
    return records


def render(records: dict[str, dict]) -> str:
    """docs/compatibility.md from the records (every word of the page is written here)."""
    names = [n for n in COLUMNS if n in records]
    lines = [
        "# Supported versions and the compatibility matrix",
        "",
        "<!-- Generated by checks/compat.py from docs/compatibility.json: edit the script, not this page. -->",
        "",
        "The supported range of each component is from its floor (the lowest release declared in",
        "`pyproject.toml`, owned by `traceml.schema.version_floors`) to the newest release the index",
        "serves. Both ends, and the set CI tests in between, are run by `checks/compat.py`: one",
        "virtual environment per column outside the tree, the project installed from a wheel of the",
        "working tree, and a smoke suite of real runs selected from the test suite.",
        "",
        "A component older than its floor is refused before anything starts: `traceml run` and",
        "`traceml-processor` print one line per component (package, installed version, floor) and",
        "exit with status 2; `traceml.init()` and the framework integrations raise",
        "`traceml.schema.version_floors.UnsupportedVersion` with the same text.",
        "",
        "An integration can need more of a component than the rest of TraceML: the `huggingface`",
        "extra requires torch 2.2.0 (`version_floors.EXTRA_FLOORS`; Accelerate calls",
        "`torch.cpu.set_device`), and the Hugging Face integration refuses an older torch with the",
        "same kind of line. The `lowest` column leaves that integration's case to the",
        "`lowest-huggingface` column, which holds every floor but that extra's own (`-` below: a",
        "case the column does not run).",
        "",
        "## Versions per column",
        "",
        "| package | floor | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for package in SHOWN:
        floor = version_floors.FLOORS.get(package, "")
        if package == "python":
            floor = COLUMNS["lowest"].python
        cells = [records[n]["versions"].get(package, "-") for n in names]
        lines.append(f"| {package} | {floor or '-'} | " + " | ".join(cells) + " |")
    lines += ["", "## Smoke suite", "",
              "| case | what runs | " + " | ".join(names) + " |",
              "|---|---|" + "---|" * len(names)]
    for case in SMOKE:
        cells = [records[n]["cases"].get(case.name, "not run") if case in column_cases(COLUMNS[n]) else "-"
                 for n in names]
        lines.append(f"| {case.name} | {case.what} | " + " | ".join(cells) + " |")
    failed = [(n, case.name) for case in SMOKE for n in names if records[n]["cases"].get(case.name) == "failed"]
    if failed:
        lines += ["", "Where a case failed:", ""]
        for n, case_name in failed:
            lines.append(f"- {case_name} in {n}: {EXPLAINED.get((n, case_name), 'not yet explained: see the run log.')}")
    lines += ["", "Seen beyond pass/fail:", "", *(f"- {text}" for text in SEEN)]
    lines += ["", "Each case's tests, by node id (run by the column's own python from the root of the commit's tree):",
              ""]
    for case in SMOKE:
        lines.append(f"- {case.name}: " + ", ".join(f"`{t}`" for t in case.tests))
    lines += ["", "## Runs", "",
              "| column | what | last run | commit | platform | build | smoke | result |",
              "|---|---|---|---|---|---|---|---|"]
    for n in names:
        r = records[n]
        result = "passed" if (not r.get("error") and r["cases"] and
                              all(v == "passed" for v in r["cases"].values())) else "FAILED"
        build = f"{r['build_s']:.0f} s"
        lines.append(f"| {n} | {COLUMNS[n].what} | {r['date']} | {r.get('commit', '')[:10]} | "
                     f"{r['platform']}, Python {r['python']} | "
                     f"{build} | {r['smoke_s']:.0f} s | {result} |")
    notes = [(n, records[n]["pip_check"]) for n in names if records[n].get("pip_check")
             and "No broken requirements" not in records[n]["pip_check"]]
    if notes:
        lines += ["", "`pip check` in a column, where it found something:", ""]
        for n, text in notes:
            lines += [f"- {n}:", "", "```", text, "```"]
    lines += [
        "",
        "Build times are of the last run: a column whose venv was already cached only reinstalls the",
        "project's wheel; a first build downloads a CUDA build of torch (several GB).",
        "",
        "## In CI",
        "",
        "`.ci/run` tests the pinned versions only (the project's `.venv`). The lowest columns and the",
        "newest are not in CI: on 2026-12-02 a fresh lowest column took about 22 minutes to build",
        "here (torch 2.1's CUDA build, about 2.5 GB with its NVIDIA libraries, about 13 minutes of",
        "that; then transformers, Lightning and the rest at their floors) and its smoke suite 4 to 5",
        "minutes, the newest column about the same (lowest-huggingface: 6 minutes to build, torch",
        "2.2's wheel already downloaded, and 1 minute of smoke), while CI's whole run has to stay well under 15",
        "minutes on this 2-core machine and the suite alone takes most of that. A cached column",
        "reruns in about 5 minutes (`build` above is then the wheel of the commit). Run both ends",
        "after changing a floor, a patched torch or framework seam, or the wire",
        "(`.venv/bin/python checks/compat.py`); the dates above say when each column last ran.",
        "",
        "Not in the matrix: `nvidia-ml-py` (the `gpu` extra; no GPU here) and the CUDA paths, which",
        "`checks/gpu.py` covers on a device.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--column", action="append", choices=list(COLUMNS),
                        help="run this column (repeatable; default: all)")
    parser.add_argument("--rebuild", action="store_true", help="delete the column's venv and build it again")
    parser.add_argument("--refresh", action="store_true", help="reinstall the components (the index's newest again)")
    parser.add_argument("--render", action="store_true", help="only render docs/compatibility.md from the record")
    parser.add_argument("--commit", default="HEAD",
                        help="the commit to test (default HEAD; the working tree's uncommitted edits are never used)")
    args = parser.parse_args(argv)
    records = _load()
    failed = False
    if not args.render:
        for name in args.column or list(COLUMNS):
            outcome = run_column(COLUMNS[name], args.commit, args.rebuild, args.refresh)
            records[name] = dataclasses.asdict(outcome)
            records = _load() | {name: records[name]}  # another column's run may have written meanwhile
            RECORD.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
            failed |= not outcome.passed
            total = outcome.build_s + outcome.smoke_s
            print(f"{name}: {'passed' if outcome.passed else 'FAILED'} "
                  f"(build {outcome.build_s:.0f} s, smoke {outcome.smoke_s:.0f} s, {total:.0f} s) {outcome.cases}")
    if records:
        RECORD.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    PAGE.write_text(render(records))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
