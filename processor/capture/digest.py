"""The digest: two ranks' captures turned into "where the culprit's extra time goes, per step".

One pure function, `compute_digest`, owns every figure the surfaces show about a capture: the
gap between the two ranks' captured steps, each entry's self time per step on both ranks, the
excess and its share of the gap, and what the captures could not see. The final summary, the
card, the web view, the HTML report and `traceml capture` only format its result.

It never invents: an entry the reference's summary left out has an unknown time there (not
zero), a gap that is not positive gets no shares, and whatever the profiler could not record
(device kernels on a CPU rank, DataLoader workers, a trace not kept, entries left out) is said
in `not_seen` rather than guessed. It reads no store and no clock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from traceml.processor.capture.model import Digest, DigestRow, PhaseGap
from traceml.schema.capture import (
    KIND_COLLECTIVE,
    KIND_HOST,
    KIND_INPUT,
    RankCaptureSummary,
)

DEFAULT_TOP_ROWS = 5
"""Entries shown by excess; the host row and the largest input and collective rows come on top."""
CALLED_OUT_KINDS: tuple[str, ...] = (KIND_HOST, KIND_INPUT, KIND_COLLECTIVE)
"""Kinds whose largest entry is always shown, so the input path and communication are never
hidden behind operators (an equal input time says the input path is not the cause)."""


@dataclass(frozen=True)
class _Entry:
    kind: str
    total_ms: float


def compute_digest(culprit: RankCaptureSummary, reference: RankCaptureSummary, *,
                   phase_means: Mapping[str, tuple[float, float]] | None = None,
                   top: int = DEFAULT_TOP_ROWS) -> Digest:
    """The digest of one capture.

    Args:
        culprit: the culprit rank's summary.
        reference: the reference rank's summary.
        phase_means: phase -> (culprit mean ms, reference mean ms) over the captured steps, when
            the store holds those steps; None when it does not (then `not_seen` says so).
        top: how many entries to show by excess (the called-out kinds come on top of these).
    """
    c_steps, r_steps = len(culprit.step_ms), len(reference.step_ms)
    c_step_ms = sum(culprit.step_ms) / c_steps
    r_step_ms = sum(reference.step_ms) / r_steps
    gap = c_step_ms - r_step_ms
    c_entries, r_entries = _entries(culprit), _entries(reference)
    r_floor = _smallest_kept(reference)

    rows: list[tuple[float, DigestRow]] = []
    skipped = 0
    for name in list(c_entries) + [n for n in r_entries if n not in c_entries]:
        c_entry, r_entry = c_entries.get(name), r_entries.get(name)
        if c_entry is None and culprit.ops_left_out:
            skipped += 1  # its culprit time is unknown: no row can say anything true about it
            continue
        kind = (c_entry or r_entry).kind
        c_ms = c_entry.total_ms / c_steps if c_entry else 0.0
        if r_entry is not None:
            r_ms: float | None = r_entry.total_ms / r_steps
        elif reference.ops_left_out:
            r_ms = None
        else:
            r_ms = 0.0
        excess = None if r_ms is None else c_ms - r_ms
        share = excess / gap if excess is not None and gap > 0 else None
        # An unknown reference time is at most the reference's smallest kept entry: rank by that bound.
        order = excess if excess is not None else c_ms - r_floor / r_steps
        rows.append((order, DigestRow(name=name, kind=kind, culprit_ms=c_ms, reference_ms=r_ms,
                                      excess_ms=excess, share_of_gap=share)))
    rows.sort(key=lambda item: (-item[0], item[1].name))
    chosen = [row for _, row in rows[:max(0, top)]]
    for kind in CALLED_OUT_KINDS:
        first = next((row for _, row in rows if row.kind == kind), None)
        if first is not None and all(first is not row for row in chosen):
            chosen.append(first)
    order_of = {id(row): i for i, (_, row) in enumerate(rows)}
    chosen.sort(key=lambda row: order_of[id(row)])

    return Digest(gap_ms=gap, culprit_step_ms=c_step_ms, reference_step_ms=r_step_ms,
                  culprit_steps=c_steps, reference_steps=r_steps, rows=tuple(chosen),
                  rows_left_out=len(rows) - len(chosen) + skipped,
                  not_seen=_not_seen(culprit, reference, gap, chosen, phase_means is not None),
                  phase_gap=_phase_gap(phase_means))


def _entries(summary: RankCaptureSummary) -> dict[str, _Entry]:
    """Name -> time over the capture (self host time plus device time; a kernel has only the
    latter, an operator only the former). A name sent twice is summed, never double-listed."""
    out: dict[str, _Entry] = {}
    for op in summary.ops:
        total = op.self_ms + op.device_ms
        seen = out.get(op.name)
        out[op.name] = _Entry(op.kind, total + (seen.total_ms if seen else 0.0))
    return out


def _smallest_kept(summary: RankCaptureSummary) -> float:
    kept = [op.self_ms + op.device_ms for op in summary.ops if op.kind != KIND_HOST]
    return min(kept) if kept else 0.0


def _phase_gap(phase_means: Mapping[str, tuple[float, float]] | None) -> tuple[PhaseGap, ...]:
    if not phase_means:
        return ()
    gaps = [PhaseGap(phase=phase, culprit_ms=c, reference_ms=r, gap_ms=c - r)
            for phase, (c, r) in phase_means.items()]
    return tuple(sorted(gaps, key=lambda g: (-g.gap_ms, g.phase)))


def _not_seen(culprit: RankCaptureSummary, reference: RankCaptureSummary, gap: float,
              rows: list[DigestRow], phases_known: bool) -> tuple[str, ...]:
    notes: list[str] = []
    ranks = (culprit, reference)
    if gap <= 0:
        notes.append(f"the culprit's captured steps were not slower than the reference's "
                     f"(gap {gap:.3f} ms per step): no share of the gap is given")
    cpu_only = [s.rank for s in ranks if "cuda" not in s.activities]
    if cpu_only:
        which = " and ".join(f"rank {r}" for r in cpu_only)
        notes.append(f"no device kernels: {which} recorded CPU activities only")
    if any(op.kind == KIND_INPUT for s in ranks for op in s.ops):
        notes.append("DataLoader worker processes are not profiled: an input row is the wait for a batch, "
                     "not the work of loading it")
    elif rows and rows[0].kind == KIND_HOST:
        notes.append("no input path was annotated in these captures: a generator's or memmap's fetch counts "
                     "as time outside any operator")
    if not any(op.kind == KIND_HOST for s in ranks for op in s.ops):
        notes.append("neither rank sent its time outside any operator")
    for s in ranks:
        if s.ops_left_out:
            notes.append(f"rank {s.rank} left out {s.ops_left_out} smaller entries: their times are unknown "
                         f"there")
        if s.trace_bytes is None:
            notes.append(f"rank {s.rank}'s raw trace was not kept: {s.trace_note or 'none was uploaded'}")
        notes.extend(f"rank {s.rank}: {note}" for note in s.notes)
    if len(culprit.step_ms) != len(reference.step_ms):
        notes.append(f"the ranks captured different step counts ({len(culprit.step_ms)} and "
                     f"{len(reference.step_ms)}): times are per captured step of each")
    if not phases_known:
        notes.append("phase times of the captured steps: not in the store")
    return tuple(notes)
