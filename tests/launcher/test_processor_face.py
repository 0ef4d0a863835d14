"""The launcher uses the processor through its public face only (issue 29 item 4).

`traceml.processor.api` is the one module of the processor the launcher may import;
the `traceml-processor` command (`-m traceml.processor.cli`) is the other door. A
renamed or split internal module then breaks no command, and this test says which
import reached past the face if one does.
"""
import ast
import json
import pathlib

import pytest

from harness.child_python import python_output

ROOT = pathlib.Path(__file__).resolve().parents[2]
FACE = "traceml.processor.api"


def _processor_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a `traceml.processor` module in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "traceml.processor" else [
                f"traceml.processor.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.extend((node.lineno, name) for name in names
                     if name == "traceml.processor" or name.startswith("traceml.processor."))
    return found


def test_the_launcher_imports_nothing_of_the_processor_but_its_face():
    reached = [f"{path.relative_to(ROOT)}:{line} imports {module}"
               for path in sorted((ROOT / "launcher").rglob("*.py"))
               for line, module in _processor_imports(path) if module != FACE]
    assert reached == []


def test_the_check_finds_an_import_past_the_face(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from traceml.processor.store_read import list_runs\n"
                     "    import traceml.processor.runs\n    from traceml.processor import web\n"
                     "    from traceml.processor.api import list_runs as ok\n")
    assert [module for _, module in _processor_imports(probe)] == [
        "traceml.processor.store_read", "traceml.processor.runs", "traceml.processor.web", FACE]


def test_every_public_name_resolves_to_its_owner():
    from traceml.processor import api

    assert api.__all__ and set(api.__all__) <= set(dir(api))
    for name in api.__all__:
        value = getattr(api, name)
        owner = getattr(value, "__module__", None)
        if owner is not None and not isinstance(value, (str, int)):
            assert owner.startswith("traceml.processor."), (name, owner)
    with pytest.raises(AttributeError, match="no_such_name"):
        api.no_such_name  # noqa: B018


def test_importing_the_face_loads_no_processor_module_before_a_name_is_used():
    code = ("import json, sys\nimport traceml.processor.api as api\n"
            "before = sorted(m for m in sys.modules if m.startswith('traceml.processor.'))\n"
            "api.printable\n"
            "after = sorted(m for m in sys.modules if m.startswith('traceml.processor.'))\n"
            "print(json.dumps([before, after, 'numpy' in sys.modules]))")
    before, after, numpy_loaded = json.loads(python_output(code))
    assert before == [FACE]
    assert "traceml.processor.presenters.terminal_text" in after
    assert not numpy_loaded, "one presenter must not pull in the analysis"


def test_every_name_the_launcher_takes_from_the_face_is_public():
    from traceml.processor import api

    taken = set()
    for path in (ROOT / "launcher").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == FACE:
                taken.update(alias.name for alias in node.names)
    assert taken and taken <= set(api.__all__), sorted(taken - set(api.__all__))
