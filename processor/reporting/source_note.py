"""What every surface says about where a run's steps came from: TraceML's own spans or a mapping.

A job that never installed TraceML is diagnosed through a foreign mapping (`processor/mapping`:
Megatron-LM, nemo-lens, a declared file, the original TraceML's logs). The summary's
`telemetry.sources` lists, per mapping, the ranks it carried, the phases it can never measure
(so a missing input verdict reads as "not measured by megatron-lm", not as a gap in the data)
and what it could not place. The card, the web view and the HTML report print the same lines;
this module holds them (imported by the card and the presenters alike, so it imports neither).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from traceml.processor.reporting.input_note import ranks_text

OWN_SOURCE = "traceml"
"""`telemetry.sources[].mapping` of the ranks that sent TraceML's own `traceml.step` spans."""

UNPLACED_NAMED = 4
"""Unplaced labels a line names; the rest are counted."""


def sources_section(expected_ranks: Sequence[int], sources: Sequence) -> list[dict]:
    """`telemetry.sources`: one entry per mapping (stored `RunSource`s grouped), then the ranks with
    none as TraceML's own; an entry's `steps` is what the mapping placed (None for our own)."""
    by_mapping: dict[str, dict] = {}
    for source in sources:
        entry = by_mapping.setdefault(source.mapping, {"mapping": source.mapping, "ranks": set(), "steps": 0,
                                                       "unmeasured_phases": tuple(source.unmeasured),
                                                       "unplaced": {}})
        entry["ranks"].add(int(source.global_rank))
        entry["steps"] += int(source.steps)
        for label, n in source.unplaced.items():
            entry["unplaced"][label] = entry["unplaced"].get(label, 0) + int(n)
    foreign = set().union(*(e["ranks"] for e in by_mapping.values())) if by_mapping else set()
    own = sorted(int(r) for r in expected_ranks if int(r) not in foreign)
    out = [{**e, "ranks": sorted(e["ranks"]), "unmeasured_phases": list(e["unmeasured_phases"]),
            "unplaced": dict(sorted(e["unplaced"].items()))} for _, e in sorted(by_mapping.items())]
    if own or not out:
        out.append({"mapping": OWN_SOURCE, "ranks": own, "steps": None, "unmeasured_phases": [], "unplaced": {}})
    return out


def source_lines(sources: Sequence[Mapping]) -> list[str]:
    """The card's lines, one per foreign mapping (none when every rank sent TraceML's own spans),
    and one for a run whose ranks came through more than one source. Wire text inside: the
    caller escapes (the card's `printable`, the page's `esc`)."""
    foreign = [s for s in sources if s["mapping"] != OWN_SOURCE]
    lines = []
    for s in foreign:
        text = f"Source: {s['mapping']} ({ranks_text(s['ranks'])}), {s['steps']} step(s) mapped"
        if s["unmeasured_phases"]:
            text += (f"; not measured by this mapping: {', '.join(s['unmeasured_phases'])} "
                     "(no finding can be about them; the fixes INCOMPLETE_DATA names are for a job running TraceML)")
        if s["unplaced"]:
            items = sorted(s["unplaced"].items(), key=lambda kv: (-kv[1], kv[0]))
            named = ", ".join(f"{label} x{n}" for label, n in items[:UNPLACED_NAMED])
            more = f" and {len(items) - UNPLACED_NAMED} more" if len(items) > UNPLACED_NAMED else ""
            text += f"; not placed in any phase (left in residual): {named}{more}"
        # A foreign emitter sends no `traceml.run.end`: how its ranks ended is not known.
        text += "; its telemetry has no end-of-run marker, so its ranks' endings read as lost"
        lines.append(text)
    if len(sources) > 1:
        lines.append("Mixed sources: " + "; ".join(f"{s['mapping']} {ranks_text(s['ranks'])}" for s in sources)
                     + ". A phase some ranks do not measure is compared among the ranks that do; Step Time "
                       "is the traced step for every rank when any rank has no input wait")
    return lines


__all__ = ["OWN_SOURCE", "UNPLACED_NAMED", "source_lines", "sources_section"]
