"""Step Time fixtures: each contract scenario as a real SQLite database.

`scenario_db(name) -> Path` builds a scenario once per test session (into a
session temporary folder) and returns its database; the run id is the scenario
name. Tests that modify a database should build their own copy with
`build_scenario(name, tmp_path / "x.db")`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from tests.step_time.scenarios import SCENARIO_SPECS, SCENARIOS, build_scenario  # noqa: F401  (re-exported)


@pytest.fixture(scope="session")
def scenario_db(tmp_path_factory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}
    folder = tmp_path_factory.mktemp("step_time_scenarios")

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_scenario(name, folder / f"{name}.db")
        return built[name]

    return get


@pytest.fixture(params=SCENARIOS)
def scenario_name(request) -> str:
    """Parametrises a test over all eleven scenario names."""
    return request.param
