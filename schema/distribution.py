"""The installed distribution: its name and version, read once from the package metadata.

One owner for "which version is this": the exporter's instrumentation scope and
`telemetry.*` resource attributes, `traceml --version`, the processor's
`service.version` and the summary's metadata all mean the same installed
package. Standard library only.
"""
from __future__ import annotations

from functools import lru_cache

DISTRIBUTION = "traceml-otel"
UNKNOWN_VERSION = "0+unknown"
"""What a source checkout that was never installed reports (a PEP 440 local version)."""


@lru_cache(maxsize=1)
def package_version() -> str:
    """The installed `traceml-otel` version, else `UNKNOWN_VERSION` (never raises)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(DISTRIBUTION)
        except PackageNotFoundError:
            return UNKNOWN_VERSION
    except Exception:  # broken metadata must never stop telemetry
        return UNKNOWN_VERSION


__all__ = ["DISTRIBUTION", "UNKNOWN_VERSION", "package_version"]
