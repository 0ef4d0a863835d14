"""ARCHITECTURE.md section 3: import rules between the layers, enforced."""
import ast
import json
import pathlib
import subprocess
import sys

import pytest

from harness.child_python import python_output

ROOT = pathlib.Path(__file__).resolve().parents[1]

_NO_TORCH = """
import sys
for name in ("torch", "transformers", "lightning", "pytorch_lightning", "accelerate"):
    sys.modules[name] = None  # any import of these now raises ImportError
import traceml
import traceml.processor
import traceml.schema
loaded = [name for name, module in sys.modules.items()
          if module is not None and name.split(".")[0] in ("torch", "transformers", "lightning", "pytorch_lightning")]
assert not loaded, loaded
print("ok")
"""


def test_traceml_and_processor_import_without_torch():
    out = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _modules_of(folder: str, package: str) -> set[str]:
    """Every module the folder holds, by import name (a package by its own name)."""
    names = set()
    for path in (ROOT / folder).rglob("*.py"):
        parts = path.relative_to(ROOT / folder).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.add(".".join((package, *parts)))
    return names


def training_side_modules() -> set[str]:
    """The training side, read from the folders: a new training module is covered the day it lands.

    Every module of `instrumentation/` (the integrations included) except the
    `traceml` package itself, which is the lazy facade and the parent of every
    other package, and every module of `exporter/`.
    """
    return (_modules_of("instrumentation", "traceml") - {"traceml"}) | _modules_of("exporter", "traceml.exporter")


_LOADED = "import json, sys\nimport {module}\nprint(json.dumps(sorted(sys.modules)))"


@pytest.mark.parametrize("module", ["traceml.processor", "traceml.processor.cli", "traceml.schema", "traceml"])
def test_importing_the_service_side_or_the_facade_loads_no_training_module(module):
    """`import traceml.processor` runs `instrumentation/__init__.py` first (the package's
    parent); that must load nothing of the training side, nor read its environment."""
    assert {"traceml.timing", "traceml.step_events", "traceml.exporter"} <= training_side_modules()
    out = subprocess.run([sys.executable, "-c", _LOADED.format(module=module)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout))
    assert sorted(loaded & training_side_modules()) == [], f"import {module} loaded the training side"


def test_the_facade_loads_the_training_side_on_first_use_only():
    code = ("import sys, traceml\n"
            "assert 'traceml.traced_step' not in sys.modules\n"
            "step = traceml.trace_step\n"
            "assert 'traceml.traced_step' in sys.modules and 'traceml.lifecycle' not in sys.modules\n"
            "assert traceml.trace_step is step and 'trace_step' in vars(traceml)\n"
            "assert traceml.timing is sys.modules['traceml.timing']\n"
            "assert set(traceml.__all__) <= set(dir(traceml))\n"
            "print('ok')")
    assert python_output(code) == "ok"


def test_every_public_name_of_the_facade_resolves():
    import traceml

    missing = [name for name in traceml.__all__ if getattr(traceml, name, None) is None]
    assert missing == []


def _imports(folder: str):
    for path in (ROOT / folder).rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield path, alias.name
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield path, node.module


def _offending(folder: str, forbidden: tuple[str, ...]):
    return sorted(
        f"{path.relative_to(ROOT)} imports {name}"
        for path, name in _imports(folder)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    )


def test_schema_is_standard_library_only():
    allowed_prefixes = ("traceml.schema", "__future__")
    stdlib = set(sys.stdlib_module_names)
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path, name in _imports("schema")
        if not name.startswith(allowed_prefixes) and name.split(".")[0] not in stdlib
    ]
    assert bad == []


@pytest.mark.slow
def test_processor_never_imports_the_training_side():
    forbidden = ("torch", "transformers", "lightning", "pytorch_lightning", "traceml.exporter",
                 "traceml.integrations", "traceml.launcher")
    training_modules = tuple(
        "traceml." + p.stem for p in (ROOT / "instrumentation").glob("*.py") if p.stem != "__init__"
    )
    assert _offending("processor", forbidden + training_modules) == []


def test_instrumentation_never_imports_the_processor():
    assert _offending("instrumentation", ("traceml.processor", "traceml.launcher")) == []
    assert _offending("exporter", ("traceml.processor", "traceml.launcher")) == []


def test_step_time_model_is_standard_library_only():
    # It may take the wire vocabulary from traceml.schema, itself standard library only (above).
    stdlib = set(sys.stdlib_module_names)
    tree = ast.parse((ROOT / "processor/step_time/model.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert all(n.split(".")[0] in stdlib or n == "__future__" or n.startswith("traceml.schema.")
               for n in names), names


def test_analysis_depends_only_on_model_and_numpy():
    path = ROOT / "processor/step_time/analysis.py"
    tree = ast.parse(path.read_text())
    stdlib = set(sys.stdlib_module_names)
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    bad = [n for n in names if n.split(".")[0] not in stdlib and n != "numpy"
           and not n.startswith(("traceml.processor.step_time.model", "traceml.schema"))]
    assert bad == []


def test_presenters_never_load_sqlite_or_diagnose():
    assert _offending("processor/presenters", ("sqlite3", "traceml.processor.step_time.sqlite_reader",
                                               "traceml.processor.diagnosis",
                                               "traceml.processor.step_time.pipeline")) == []


@pytest.mark.slow
def test_every_service_side_module_imports_without_the_training_stack():
    """The container ships no torch, transformers or lightning: not only the package,
    every module of processor/ and schema/ (the CLI, the receivers, the summary push)
    must import with them absent, and the CLI must answer."""
    modules = sorted(_modules_of("processor", "traceml.processor") | _modules_of("schema", "traceml.schema"))
    code = (_NO_TORCH.replace('print("ok")', "")
            + "import importlib\n"
            + "".join(f"importlib.import_module({name!r})\n" for name in modules)
            + "from traceml.processor.cli import main\n"
            + "try:\n    main(['--version'])\nexcept SystemExit as exc:\n    assert exc.code in (0, None), exc.code\n"
            + "print('ok')\n")
    assert python_output(code).endswith("ok")
