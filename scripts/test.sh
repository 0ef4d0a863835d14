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
# One pytest-xdist worker more than there are cores (most tests spend part of their time waiting
# on the processes they start; with one per core the cores idle then), at most eight (the free-port
# slices, harness/ports.py); TRACEML_TEST_WORKERS overrides. A module's tests that share a
# module-scoped fixture stay on one worker, the tests that measure time run first, at normal
# priority while the others run at idle priority (alone where priorities cannot be set), and the
# longest work goes out first (tests/serial_tests.py, tests/durations.py).
WORKERS=${TRACEML_TEST_WORKERS:-$(( $(nproc) + 1 ))}
(( WORKERS > 8 )) && WORKERS=8
exec "$PYTHON_UNDER_TEST" -m pytest -q -n "$WORKERS" --dist loadscope "$@"
