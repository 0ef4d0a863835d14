"""The command line both deploy generators share: write their files, or only check them."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Mapping


def generator_main(description: str, generate: Callable[[], Mapping[str, str]], out_dir: Path,
                   what: str, script: str, argv=None) -> int:
    """Write every generated file into `out_dir`; with --check, exit 1 listing the stale ones."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if a file differs")
    args = parser.parse_args(argv)
    stale = []
    for name, text in generate().items():
        path = out_dir / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            out_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale {what} (run {script}): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0
