"""The public final-summary schema: its version (the one place it lives) and its files' names.

Bump it (and add a CHANGELOG entry) whenever a public key or null pattern of
`final_summary.json` changes; the golden test refuses such a change otherwise.
The JSON Schema that `final_summary.json` validates against is
`final_summary.schema.json` beside this module.
"""
from __future__ import annotations

from importlib import resources

SCHEMA_VERSION = "1.9"

FINAL_SUMMARY_FILE = "final_summary.json"
SUMMARY_CARD_FILE = "summary_card.txt"
"""The two files of a run's final summary, named alike wherever they are written (`traceml run`'s
run folder, the processor's `--summary-dir`) and read (`traceml summary`, `traceml compare`)."""


def final_summary_json_schema_text() -> str:
    return resources.files("traceml.schema").joinpath("final_summary.schema.json").read_text()
