"""docs/compatibility.md is the matrix checks/compat.py last ran, at today's floors.

The page is rendered from docs/compatibility.json and nothing else; the lowest column
was run at exactly the floors pyproject.toml declares now (a floor changed without a
new run fails here), and every column has a result for every smoke case.
"""
from __future__ import annotations

import json
from pathlib import Path

from checks import compat
from traceml.schema import version_floors as vf

ROOT = Path(__file__).resolve().parents[1]
RECORDS = json.loads((ROOT / "docs" / "compatibility.json").read_text())


def test_the_page_is_the_rendered_record():
    assert (ROOT / "docs" / "compatibility.md").read_text() == compat.render(RECORDS)


def test_every_column_ran_every_smoke_case():
    assert set(RECORDS) == set(compat.COLUMNS)
    for name, record in RECORDS.items():
        assert set(record["cases"]) == {case.name for case in compat.SMOKE}, name
        assert record["versions"] and record["commit"], name


def test_the_lowest_column_ran_at_todays_floors():
    lowest = RECORDS["lowest"]["versions"]
    assert lowest["python"].startswith(compat.COLUMNS["lowest"].python + ".")
    for package, floor in vf.FLOORS.items():
        assert vf.release(lowest[package]) == vf.release(floor), (package, lowest[package], floor)
