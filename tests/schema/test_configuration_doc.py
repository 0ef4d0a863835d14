"""docs/configuration.md documents every environment variable schema/environment.py declares."""
from __future__ import annotations

import pathlib

from traceml.schema import environment

DOC = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()


def declared_variables() -> list[str]:
    """Every module constant whose value is its own name: the declared variables."""
    return sorted(name for name, value in vars(environment).items()
                  if name.isupper() and isinstance(value, str) and value == name)


def test_every_declared_variable_is_documented():
    declared = declared_variables()
    assert len(declared) > 50  # the reading above found the declarations
    assert [name for name in declared if f"`{name}`" not in DOC] == []


def test_every_per_signal_otlp_variable_is_declared():
    for option in environment.OTLP_OPTIONS:
        for signal in environment.OTLP_SIGNALS:
            for name in environment.otlp_variables(option, signal):
                assert getattr(environment, name) == name
