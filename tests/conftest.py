"""Project-wide pytest options, and where the rewritten test modules are cached."""
import sys
from pathlib import Path

if sys.dont_write_bytecode and sys.prefix != sys.base_prefix and sys.pycache_prefix is None:
    # PYTHONDONTWRITEBYTECODE keeps bytecode out of the checkout; pytest then rewrites and
    # compiles every test module again on each run (about 9 of the fast loop's seconds here).
    # The rewritten modules go to the virtual environment's own folder instead, never the tree.
    sys.pycache_prefix = str(Path(sys.prefix) / "pycache")
    sys.dont_write_bytecode = False


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden", action="store_true", default=False,
        help="rewrite tests/step_time/golden/*.json (refused for a key or null-pattern change "
             "at an unchanged SCHEMA_VERSION)",
    )
