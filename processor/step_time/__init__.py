"""Step Time domain. The package root exports model types only (no numpy, no SQLite)."""
from traceml.processor.step_time.model import *  # noqa: F401,F403
