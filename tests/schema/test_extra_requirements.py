"""Which of the processor extra's requirements count as missing: a requirement whose marker
excludes this interpreter (`tomli; python_version < '3.11'`) is never missing here."""
from __future__ import annotations

import importlib.metadata
import sys

from traceml.schema import distribution


def _declared(monkeypatch, lines: list[str], installed: set[str]) -> list[str]:
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: lines)

    def version(name: str) -> str:
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return "1.0"

    monkeypatch.setattr(importlib.metadata, "version", version)
    return distribution.missing_requirements()


def test_a_requirement_for_another_python_is_not_missing_and_one_for_this_python_is(monkeypatch):
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    lines = ['numpy>=1.24; extra == "processor"',
             f'tomli; python_version < "{here}" and extra == "processor"',
             f'oldpython; python_version >= "{here}" and extra == "processor"',
             'psutil>=5.9; extra == "train"',
             "grpcio>=1.63.2"]
    assert _declared(monkeypatch, lines, installed=set()) == ["numpy", "oldpython"]
    assert _declared(monkeypatch, lines, installed={"numpy", "oldpython"}) == []
