"""Run a benchmark against another checkout: `python -m benchmarks.in_tree TREE MODULE [ARGS...]`.

Before/after figures need the old code and the new one measured on the same machine
in one session. TREE is a plain checkout of the older revision (`git worktree add
--detach /tmp/before REV`); this drops the editable install's finders and paths, maps
`traceml` onto TREE's folders exactly as setup.py does (TREE's `benchmarks.lib.checkout`,
or `benchmarks.traceml_checkout` in trees older than the benchmark library), and runs
`python -m MODULE ARGS` from TREE, so every import of `traceml`, the benchmark's own
included, is TREE's.
"""
from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__.splitlines()[0])
    tree, module, *args = str(Path(argv[0]).resolve()), argv[1], *argv[2:]
    sys.meta_path[:] = [f for f in sys.meta_path
                        if "editable" not in type(f).__module__.lower() and "editable" not in repr(f).lower()]
    sys.path[:] = [p for p in sys.path if "__editable__" not in p and p not in ("", ".")]
    sys.path.insert(0, tree)
    for name in list(sys.modules):
        if name.split(".")[0] in ("traceml", "benchmarks"):
            del sys.modules[name]
    # TREE's own module maps traceml onto TREE's folders. Chosen by what TREE holds: `benchmarks`
    # is a namespace package, so an import would find this checkout's module where TREE has none.
    if (Path(tree) / "benchmarks" / "lib" / "checkout.py").exists():
        importlib.import_module("benchmarks.lib.checkout")
    else:
        importlib.import_module("benchmarks.traceml_checkout")
    import traceml

    if not str(Path(traceml.__file__).resolve()).startswith(tree):
        raise SystemExit(f"traceml still imports from {traceml.__file__}, not from {tree}")
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
