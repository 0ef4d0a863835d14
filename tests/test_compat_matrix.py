"""docs/compatibility.md is the matrix checks/compat.py last ran, at today's floors.

The page is rendered from docs/compatibility.json and nothing else; each lowest column
(the plain floors, and each extra with floors of its own) was run at exactly the floors
pyproject.toml declares now (a floor changed without a new run fails here), every column
has a result for every case it runs, and every case ran at the floors that apply to it.
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
        assert set(record["cases"]) == {case.name for case in compat.column_cases(compat.COLUMNS[name])}, name
        assert record["versions"] and record["commit"], name
    # Every case ran at the lowest floors that apply to it (its extra's own, where it has them).
    at_floors = [compat.column_cases(c) for c in compat.COLUMNS.values() if c.pins == "floors"]
    assert {case for cases in at_floors for case in cases} == set(compat.SMOKE)


def test_the_lowest_columns_ran_at_todays_floors():
    lowest = [c for c in compat.COLUMNS.values() if c.pins == "floors"]
    assert {c.extra for c in lowest} == {"", *vf.EXTRA_FLOORS}
    for column in lowest:
        versions = RECORDS[column.name]["versions"]
        assert versions["python"].startswith(column.python + "."), column.name
        for package, floor in vf.floors(column.extra).items():
            assert vf.release(versions[package]) == vf.release(floor), (column.name, package, versions[package], floor)
