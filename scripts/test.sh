#!/usr/bin/env bash
# Sets up everything and runs the whole test suite: the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-system-deps.sh
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
