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
PACKAGES=("torch==2.13.0" -e ".[dev,processor,huggingface,lightning,gpu]" --config-settings editable_mode=strict)
# uv installs them from the sources pip is configured with (scripts/uv_install.py), several times
# faster than pip; pip does it where uv cannot be had or fails. Neither writes bytecode here:
# compileall below does, on every core (pip would write its 12,000 modules one at a time).
quiet_pip() { grep -v "is ignored: it is neither a file nor a directory" || true; }
.venv/bin/python -m pip install -q --disable-pip-version-check "uv>=0.5" 2>&1 | quiet_pip
if ! { [ -x .venv/bin/uv ] && .venv/bin/python scripts/uv_install.py .venv/bin/uv "${PACKAGES[@]}"; }; then
  echo "setup: uv was not available or failed (see above); installing with pip" >&2
  .venv/bin/python -m pip install -q --no-compile --disable-pip-version-check "${PACKAGES[@]}" 2>&1 | quiet_pip
fi
# A few packages ship files for other Python versions that do not compile; they are never imported.
# Skipped: the packages' own test suites and transformers' model zoo but its auto mappings (a
# third of the sources, about 20 CPU-seconds; nothing here imports them: a model is written in torch).
.venv/bin/python -m compileall -q -j 0 -x '/tests/|/torch/testing/_internal/|/transformers/models/(?!auto/|__init__\.py$)' \
  "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null 2>&1 || true
.venv/bin/python -c "import torch, traceml, traceml.processor" >/dev/null
# The nemo-lens mapping tests run nemo-lens itself, which needs Python 3.13: its own cached venv.
bash scripts/setup_nemo_lens.sh || echo "setup: the nemo-lens venv was not built (see above); its tests build it or say why" >&2
