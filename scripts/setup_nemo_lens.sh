#!/usr/bin/env bash
# Builds (once) the Python 3.13 venv the nemo-lens mapping tests run the library in: nemo-lens
# 0.1.0 needs Python >= 3.13, the project's own venv may be older. Cached outside the tree
# (TRACEML_NEMO_LENS_VENV, default ~/.cache/traceml-nemo-lens/venv); re-running with it in place
# does nothing. Python 3.13 is PYTHON313, else python3.13 on PATH, else pyenv's.
set -euo pipefail
VENV=${TRACEML_NEMO_LENS_VENV:-$HOME/.cache/traceml-nemo-lens/venv}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import nemo.lens, opentelemetry.sdk, opentelemetry.exporter.otlp.proto.grpc" 2>/dev/null; then
  exit 0
fi
PY=${PYTHON313:-}
if [ -z "$PY" ]; then
  for candidate in "$(command -v python3.13 || true)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13.*/bin/python3.13; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c "import sys; assert sys.version_info[:2] == (3, 13)" 2>/dev/null; then
      PY=$candidate
      break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "setup_nemo_lens: no Python 3.13 found (set PYTHON313): the nemo-lens mapping tests need it" >&2
  exit 1
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "nemo-lens==0.1.0" "opentelemetry-sdk>=1.27" \
  "opentelemetry-exporter-otlp-proto-grpc>=1.27" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
"$VENV/bin/python" -c "import nemo.lens, opentelemetry.sdk, opentelemetry.exporter.otlp.proto.grpc"
