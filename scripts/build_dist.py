"""Builds the sdist, then the wheel from that sdist (as `python -m build` does), into one folder.

    .venv/bin/python scripts/build_dist.py [OUT]      # default: dist/

The tree is copied first (the files the Dockerfile copies: the five package folders,
pyproject.toml, setup.py, README.md, LICENSE), so a build never writes into the
working tree; the wheel is built from the unpacked sdist, so a file the sdist leaves
out is missing from the wheel too, and the tests that run against the wheel see it.
Uses the environment's own setuptools through its PEP 517 hooks (no download, no
isolated build environment). Prints each file with its size.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE",
           "instrumentation", "exporter", "processor", "schema", "launcher")

_HOOK = "import sys\nfrom setuptools import build_meta\nprint(build_meta.build_{kind}(sys.argv[1]))"


def _hook(kind: str, source: Path, out: Path) -> Path:
    done = subprocess.run([sys.executable, "-c", _HOOK.format(kind=kind), str(out)], cwd=source,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"build_{kind} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return out / done.stdout.strip().splitlines()[-1]


def build(out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="traceml-build-") as scratch:
        source = Path(scratch) / "src"
        for name in SOURCES:
            if (ROOT / name).is_dir():
                shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                source.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, source / name)
        sdist = _hook("sdist", source, out)
        with tarfile.open(sdist) as archive:
            archive.extractall(Path(scratch) / "unpacked", filter="data")
        (unpacked,) = (Path(scratch) / "unpacked").iterdir()
        wheel = _hook("wheel", unpacked, out)
    return sdist, wheel


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "dist"
    for path in build(out.resolve()):
        print(f"{path}  {path.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
