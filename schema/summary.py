"""The public final-summary schema version: the one place it lives.

Bump it (and add a CHANGELOG entry) whenever a public key or null pattern of
`final_summary.json` changes; the golden test refuses such a change otherwise.
The JSON Schema that `final_summary.json` validates against is
`final_summary.schema.json` beside this module.
"""
from __future__ import annotations

from importlib import resources

SCHEMA_VERSION = "1.6"


def final_summary_json_schema_text() -> str:
    return resources.files("traceml.schema").joinpath("final_summary.schema.json").read_text()
