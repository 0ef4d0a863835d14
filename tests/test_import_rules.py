"""ARCHITECTURE.md section 3: import rules between the layers, enforced."""
import ast
import pathlib
import subprocess
import sys

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
    stdlib = set(sys.stdlib_module_names)
    tree = ast.parse((ROOT / "processor/step_time/model.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert all(n.split(".")[0] in stdlib or n == "__future__" for n in names), names


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
    assert _offending("processor/presenters", ("sqlite3", "traceml.processor.step_time.sqlite",
                                               "traceml.processor.diagnosis",
                                               "traceml.processor.step_time.pipeline")) == []
