"""The installed distribution: its name and version, read once from the package metadata.

One owner for "which version is this": the exporter's instrumentation scope and
`telemetry.*` resource attributes, `traceml --version`, the processor's
`service.version` and the summary's metadata all mean the same installed
package. Standard library only.
"""
from __future__ import annotations

import re
import sys
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


def user_agent(sender: str) -> str:
    """The User-Agent TraceML's OTLP senders put on every request, `TraceML-<sender>-Python/<version>`
    (the form of the OpenTelemetry exporters' `OTel-OTLP-Exporter-Python/1.45.2`), so a collector's
    logs and metrics tell TraceML's traffic from a job's own SDK and say which version sent it."""
    return f"TraceML-{sender}-Python/{package_version()}"


PROCESSOR_EXTRA = "processor"
"""The extra that installs the service side: `pip install 'traceml-otel[processor]'`."""
PROCESSOR_INSTALL = f"pip install '{DISTRIBUTION}[{PROCESSOR_EXTRA}]'"

_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_ONLY_IN_EXTRA = r"""extra\s*==\s*["']{}["']"""


def missing_requirements(extra: str = PROCESSOR_EXTRA) -> list[str]:
    """The distributions `extra` requires that are not installed here (sorted); [] when all are, or
    when this package's own metadata cannot be read (a source tree never installed: then an import
    says what is missing).

    Read from the installed metadata, so pyproject.toml stays the one list; nothing is imported,
    so the answer costs milliseconds and comes before anything starts.
    """
    from importlib.metadata import PackageNotFoundError, requires, version

    try:
        declared = requires(DISTRIBUTION) or []
    except PackageNotFoundError:
        return []
    pattern = re.compile(_ONLY_IN_EXTRA.format(re.escape(extra)))
    missing = set()
    for line in declared:
        requirement, _, marker = line.partition(";")
        if not pattern.search(marker) or not _python_matches(marker):
            continue
        name = _NAME.match(requirement).group(1)
        try:
            version(name)
        except PackageNotFoundError:
            missing.add(name)
    return sorted(missing)


_PYTHON_VERSION = re.compile(r"""python_version\s*(<=|>=|==|!=|<|>)\s*["'](\d+(?:\.\d+)*)["']""")
_COMPARE = {"<": tuple.__lt__, "<=": tuple.__le__, ">": tuple.__gt__, ">=": tuple.__ge__, "==": tuple.__eq__,
            "!=": tuple.__ne__}


def _python_matches(marker: str) -> bool:
    """Whether this interpreter meets a marker's `python_version` clauses (pyproject joins them to
    the extra's with `and`; `tomli; python_version < '3.11'` is not missing on 3.11)."""
    here = sys.version_info[:2]
    return all(_COMPARE[op](here, tuple(int(p) for p in wanted.split(".")))
               for op, wanted in _PYTHON_VERSION.findall(marker))


def processor_side_missing_message(what: str) -> str | None:
    """One line for a user whose install lacks the processor side, naming `what` needs it; None if
    it is installed."""
    missing = missing_requirements(PROCESSOR_EXTRA)
    if not missing:
        return None
    return (f"{what} needs TraceML's processor side, which is not installed here (missing: "
            f"{', '.join(missing)}). Install it with: {PROCESSOR_INSTALL}")


__all__ = ["DISTRIBUTION", "PROCESSOR_EXTRA", "PROCESSOR_INSTALL", "UNKNOWN_VERSION", "missing_requirements",
           "package_version", "processor_side_missing_message", "user_agent"]
