"""The note every surface prints when input wait was measured as the time before forward.

A step inferred from optimizer updates with no DataLoader `next()` timed in it measures its
input wait as the host time from the end of the update to the first forward
(`docs/instrumentation.md`). The card, the live view, the web view and the HTML report say so
in the same words; this module holds them (imported by the presenters and the card alike,
so it imports nothing of either).
"""
from __future__ import annotations

from typing import Sequence

BEFORE_FORWARD_SENTENCE = "input wait measured as the time before forward: no DataLoader in this loop"

RANKS_NAMED = 8
"""Ranks a note names; the rest are counted."""


def ranks_text(ranks: Sequence[int]) -> str:
    """`r0, r1`, the first `RANKS_NAMED` named and the rest counted."""
    named = ", ".join(f"r{int(r)}" for r in ranks[:RANKS_NAMED])
    return named + (f" and {len(ranks) - RANKS_NAMED} more" if len(ranks) > RANKS_NAMED else "")


def before_forward_note(ranks: Sequence[int]) -> str:
    """The note with the ranks it concerns, as the card and the live view print it."""
    return f"{BEFORE_FORWARD_SENTENCE} ({ranks_text(ranks)})"


__all__ = ["BEFORE_FORWARD_SENTENCE", "RANKS_NAMED", "before_forward_note", "ranks_text"]
