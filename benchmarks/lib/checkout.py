"""Makes `import traceml` work from a plain copy of the tree (a GPU machine without the project installed).

Importing this module is enough; it does nothing when `traceml` is already importable.
The folder -> package map is setup.py's `PACKAGE_ROOTS`, read from its source (not
imported: importing setup.py would run `setup()`), so exactly the installed packages
import and nothing else (`traceml.tests` or `traceml.docs` do not).
"""
from __future__ import annotations

import ast
import importlib.abc
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def package_roots(setup_py: Path = ROOT / "setup.py") -> dict[str, str]:
    """setup.py's `PACKAGE_ROOTS` literal: import name -> folder."""
    for node in ast.parse(setup_py.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PACKAGE_ROOTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError(f"no PACKAGE_ROOTS in {setup_py}")


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds each mapped package in its folder; submodules then follow from the package's `__path__`."""

    def __init__(self, roots: dict[str, str]):
        self.roots = {name: ROOT / folder for name, folder in roots.items()}

    def find_spec(self, fullname, path=None, target=None):
        folder = self.roots.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def ensure_traceml() -> None:
    """Import the checkout's `traceml` namespace when the project is not installed."""
    if importlib.util.find_spec("traceml") is not None:
        return
    sys.meta_path.insert(0, _CheckoutFinder(package_roots()))


ensure_traceml()
