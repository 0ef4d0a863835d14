#!/usr/bin/env bash
# Builds the wheel and sdist (dist/) and installs the wheel, not the tree, into build/wheel-venv:
# a virtual environment whose third-party packages are the dev .venv's (one .pth line naming its
# site-packages; .pth files there, the editable install's among them, are not run), so the
# suite imports `traceml` and runs `traceml` / `traceml-processor` from the installed wheel
# while .venv keeps its editable install for the developer loop. Prints the wheel venv's python.
# Needs scripts/setup.sh first. Seconds: no download, nothing reinstalled but the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=.venv
VENV=build/wheel-venv
rm -rf dist "$VENV"
"$DEV/bin/python" scripts/build_dist.py dist >&2
"$DEV/bin/python" -m venv --without-pip "$VENV"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
"$DEV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))' > "$SITE/_traceml_dev_packages.pth"
"$VENV/bin/python" -m pip install -q --no-deps --ignore-installed --disable-pip-version-check dist/*.whl \
  2>&1 | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
# Other packages' commands (rotel-agent, playwright, ...) beside the wheel's traceml and traceml-processor.
for tool in "$DEV"/bin/*; do
  name=$(basename "$tool")
  [ -e "$VENV/bin/$name" ] || ln -s "$(realpath "$tool")" "$VENV/bin/$name"
done
# The suite must see the wheel: traceml from the wheel venv's site-packages, the tree nowhere.
"$VENV/bin/python" - "$SITE" >&2 <<'PY'
import sys, traceml, traceml.processor, traceml.launcher.cli
site = sys.argv[1]
for module in (traceml, traceml.processor, traceml.launcher.cli):
    assert module.__file__.startswith(site), f"{module.__name__} comes from {module.__file__}, not the wheel"
print(f"suite runs against the wheel installed in {site}")
PY
echo "$VENV/bin/python"
