"""Web view fixtures: the Step Time contract scenarios as real SQLite databases (built once)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from tests.step_time.scenarios import build_scenario


@pytest.fixture(scope="session")
def scenario_db(tmp_path_factory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}
    folder = tmp_path_factory.mktemp("web_scenarios")

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_scenario(name, folder / f"{name}.db")
        return built[name]

    return get
