#!/usr/bin/env bash
# Sets up everything and runs the whole test suite: the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-system-deps.sh
bash scripts/setup.sh
# The suite runs against the built wheel, not the tree: scripts/wheel_venv.sh builds the sdist
# and, from it, the wheel (dist/), installs the wheel into build/wheel-venv beside the dev
# environment's packages and prints that venv's python (tests/test_installs.py installs the
# same wheel into fresh environments: TRACEML_TEST_DIST).
PYTHON_UNDER_TEST=$(bash scripts/wheel_venv.sh)
export TRACEML_TEST_DIST="$PWD/dist"
# Two pytest-xdist workers; a module's tests that share a module-scoped fixture stay on one worker,
# and the tests that measure time run with nothing beside them (tests/serial_tests.py).
exec "$PYTHON_UNDER_TEST" -m pytest -q -n 2 --dist loadscope "$@"
