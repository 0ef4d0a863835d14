"""Makes `import traceml` work from a plain checkout (e.g. on a GPU machine without the project installed).

Importing this module is enough; it does nothing when `traceml` is already importable.
"""
from __future__ import annotations

import sys
from pathlib import Path


def ensure_traceml() -> None:
    """Import the checkout's `traceml` namespace when the project is not installed."""
    try:
        import traceml  # noqa: F401
        return
    except ImportError:
        pass
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    # `traceml` = instrumentation/; `traceml.schema`, `.exporter`, ... = the sibling folders.
    spec = importlib.util.spec_from_file_location(
        "traceml", root / "instrumentation" / "__init__.py",
        submodule_search_locations=[str(root / "instrumentation"), str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["traceml"] = module
    spec.loader.exec_module(module)


ensure_traceml()
