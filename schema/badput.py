"""Public badput-ledger vocabulary: the causes time is lost to (issue 35).

These strings are public values: keys of `final_summary.json`'s `badput` section
and label values wherever a surface carries the ledger, so a dashboard or a
cross-run record can match on them. Six causes, a fixed set: a label built from
them stays bounded. `docs/DIAGNOSIS.md` ("Badput ledger") says how each is measured.
Standard library only.
"""
from __future__ import annotations

CAUSE_STRAGGLER_WAIT = "straggler_wait"
"""Time ranks spent waiting in collectives for a later rank: each rank's wait beyond the least
waiting rank's, summed over the ranks that waited."""
CAUSE_INPUT_STALL = "input_stall"
"""Time ranks spent waiting for their next batch (Input Wait)."""
CAUSE_H2D = "h2d"
"""Time ranks spent in host-to-device copies."""
CAUSE_COMMUNICATION = "communication"
"""Collective time even the least waiting rank spent: communication beyond the compute it overlaps."""
CAUSE_DRIFT = "drift"
"""A drift's excess over the run's own best window, in the time no other cause holds."""
CAUSE_RESTARTS = "restarts"
"""Steps lost to elastic restarts: earlier attempts' steps done again, and the time between attempts."""

LEDGER_CAUSES: tuple[str, ...] = (
    CAUSE_STRAGGLER_WAIT, CAUSE_INPUT_STALL, CAUSE_H2D, CAUSE_COMMUNICATION, CAUSE_DRIFT, CAUSE_RESTARTS,
)
"""Every cause, in the order the ledger lists them."""

WINDOW_CAUSES: tuple[str, ...] = LEDGER_CAUSES[:-1]
"""The causes measured over the analysis window (restarts are whole-run facts)."""
