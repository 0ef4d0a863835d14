"""The processor's public face: everything code outside `traceml.processor` may use of it.

The launcher (`traceml run`, `demo`, `summary`, `compare`, `top`) runs the processor's
analysis, reads its store and writes its reports in its own process. It reaches all of
that through the names listed here and through the `traceml-processor` command, never
through the modules that implement them, so the processor can rename and split its
modules without breaking a command (tests/launcher/test_processor_face.py holds it).
docs/processor.md, "The public face", lists the names by purpose.

Every name is resolved on first use (PEP 562), like `traceml`'s own facade: `traceml
run --help` and a rank-only install import this module for nothing, and a command
that needs one presenter does not load the analysis, numpy or the web view with it.
"""
from __future__ import annotations

import importlib

_OWNERS: dict[str, tuple[str, ...]] = {
    # Reading a store: which runs it holds, how far one got.
    "store_read": ("StoredRun", "StoreReadError", "StoreUnavailable", "NotAStore",
                   "list_runs", "read_run_progress", "read_fleet"),
    "runs": ("run_is_over",),
    # Repeat offenders across runs (`read_fleet` above): the listing's rows.
    "fleet": ("FleetEntry", "FLEET_COLUMNS", "fleet_rows"),
    # The live analysis and what it yields.
    "step_time.pipeline": ("LiveStepTimeSession",),
    "step_time.model": ("LiveStepTimeResult",),
    # The final summary (store -> final_summary.json + summary_card.txt) and reports.
    "summary_section": ("write_final_summary",),
    "web.report": ("REPORT_FILENAME", "COMPARE_FILENAME", "write_run_report", "write_compare_report"),
    # Presenting: the live view and escaping wire strings for a terminal.
    "presenters.live": ("render_live", "format_live_line"),
    "presenters.terminal_text": ("printable",),
    # How a run ended, as the launcher saw it (handed to the processor as JSON).
    "endings": ("LauncherEnding", "launcher_ending_to_json", "launcher_ending_from_json"),
    # Deep captures kept with a run: its raw traces (`traceml run` copies them beside the summary).
    "capture.files": ("capture_trace_paths",),
    # Addresses, tokens and the summary folder of a run id.
    "security": ("parse_host_port", "read_token_file", "TokenFileError",
                 "summary_folder"),
}
_OWNER_OF = {name: module for module, names in _OWNERS.items() for name in names}

__all__ = sorted(_OWNER_OF)


def __getattr__(name: str):
    owner = _OWNER_OF.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"traceml.processor.{owner}"), name)
    globals()[name] = value  # bound: the next lookup is a plain attribute read
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
