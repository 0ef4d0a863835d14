#!/usr/bin/env bash
# Creates ./.venv with everything the project, its tests and its demo need: both sides (the
# core and the processor extra), the training stack and the dev tools.
# Safe to re-run: it re-links the editable install (so new modules import). torch is pinned to the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# Strict editable mode: each import name maps exactly onto its folder (setup.py's
# PACKAGE_ROOTS), which tools can follow; a new module needs this script run again.
.venv/bin/python -m pip install -q --disable-pip-version-check \
  "torch==2.13.0" -e ".[dev,processor,huggingface,lightning,gpu]" --config-settings editable_mode=strict 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
.venv/bin/python -c "import torch, traceml, traceml.processor" >/dev/null
# The nemo-lens mapping tests run nemo-lens itself, which needs Python 3.13: its own cached venv.
bash scripts/setup_nemo_lens.sh || echo "setup: the nemo-lens venv was not built (see above); its tests build it or say why" >&2
