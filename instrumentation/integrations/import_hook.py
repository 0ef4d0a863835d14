"""Run an integration's set-up right after the framework is imported, never before.

`traceml run` attaches the integrations before the user's script starts, but
importing transformers or Lightning takes seconds and the script may use neither.
A `PostImportHook` on `sys.meta_path` waits instead: when the script imports one of
the target modules, the module's own code runs first, then `on_import(module)`.

What the callback does, and whether the hook stays armed after it fired, is the
integration's decision; this module only finds the real loader and runs after it.
"""
from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType
from typing import Any, Callable, Iterable


class PostImportHook(importlib.abc.MetaPathFinder):
    """Wraps the loader of each target module so that `on_import` runs after it.

    The spec comes from the finders behind this one on `sys.meta_path` (the same
    ones Python would ask), so the module loads exactly as it would without us.
    """

    def __init__(self, targets: Iterable[str], on_import: Callable[[ModuleType], None]) -> None:
        self.targets = frozenset(targets)
        self._on_import = on_import

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.targets:
            return None
        for finder in sys.meta_path:
            # Every hook skips every other: two hooks asking each other would recurse.
            if isinstance(finder, PostImportHook) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _RunAfterExec(spec.loader, self._on_import)
                return spec
        return None

    def install(self) -> None:
        """Go first on `sys.meta_path` (idempotent)."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        """Stop watching imports (idempotent)."""
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


class _RunAfterExec(importlib.abc.Loader):
    """Delegating loader: the real module code, then the integration's callback."""

    def __init__(self, loader: Any, on_import: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._on_import = on_import

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._on_import(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
