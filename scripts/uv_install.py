"""`pip install ARGS` into this interpreter's environment, done by uv, from the sources pip would use.

    .venv/bin/python scripts/uv_install.py UV ARGS...

setup.sh installs the dev environment's ~200 packages with it: pip resolves and unpacks them
one at a time on one core, uv does the same install in a fraction of the time (docs/performance.md
has the figures). uv reads none of pip's configuration, so the package sources this machine
gives pip (its configuration files and PIP_* variables, merged by pip's own loader:
index-url, extra-index-url, find-links, constraint, cert) are handed to uv as flags, and uv
picks the best version over every index as pip does. Exits with uv's status; setup.sh falls
back to pip when it is not 0, so a machine where uv cannot run still gets its environment.
"""
from __future__ import annotations

import os
import subprocess
import sys

_LISTS = {"extra-index-url": "--extra-index-url", "find-links": "--find-links", "constraint": "--constraint"}


def pip_sources() -> dict[str, str]:
    """pip's effective settings for an install: its files and PIP_* variables, later ones winning
    as pip applies them, the [install] section over [global]."""
    from pip._internal.configuration import Configuration

    config = Configuration(isolated=False)
    config.load()
    merged: dict[str, str] = {}
    for section in ("global", "install", ":env:"):
        for key, value in config.items():
            name, _, option = key.partition(".")
            if name == section:
                merged[option] = value
    return merged


def uv_arguments(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's flags and environment for pip's settings."""
    flags = ["--index-strategy", "unsafe-best-match"]  # pip takes the best version over all indexes
    env = {}
    if settings.get("index-url"):
        flags += ["--index-url", settings["index-url"]]
    for option, flag in _LISTS.items():
        for value in settings.get(option, "").split():
            flags += [flag, value]
    if settings.get("cert"):
        env["SSL_CERT_FILE"] = settings["cert"]
    return flags, env


def main(argv: list[str]) -> int:
    uv, args = argv[0], argv[1:]
    flags, env = uv_arguments(pip_sources())
    command = [uv, "pip", "install", "--quiet", "--no-progress", "--python", sys.executable, *flags, *args]
    return subprocess.call(command, env={**os.environ, **env})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
