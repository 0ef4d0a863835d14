"""How many runs, and ranks per run, the processor tracks: the caps and their one keeper.

Shared by every decoder of a process (`Decoder` builds one per service) and told by
the run monitor when a run is forgotten, so a cap counts the runs being tracked,
not every run ever seen. A run or rank over the cap is refused with
`TOO_MANY_RUNS` / `TOO_MANY_RANKS` (`store_records`) like any other bad value.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Iterable

from traceml.processor.decode_attributes import Reject
from traceml.processor.store_records import TOO_MANY_RANKS, TOO_MANY_RUNS

if TYPE_CHECKING:
    from traceml.processor.decode import DecodeLimits


class RunAdmission:
    """Thread-safe caps on how many runs, and ranks per run, the processor tracks."""

    def __init__(self, limits: "DecodeLimits", known_runs: Iterable[str] = ()):
        self._limits = limits
        self._lock = threading.Lock()
        self._ranks: dict[str, set[int]] = {run: set() for run in known_runs}

    def admit(self, run_id: str, rank: int) -> None:
        ranks = self._ranks.get(run_id)
        if ranks is not None and rank in ranks:
            return
        with self._lock:
            ranks = self._ranks.get(run_id)
            if ranks is None:
                if len(self._ranks) >= self._limits.max_runs:
                    raise Reject(TOO_MANY_RUNS, f"run {run_id!r} exceeds the cap of {self._limits.max_runs} runs")
                ranks = self._ranks[run_id] = set()
            if rank not in ranks:
                if len(ranks) >= self._limits.max_ranks_per_run:
                    raise Reject(TOO_MANY_RANKS,
                                 f"rank {rank} of run {run_id!r} exceeds the cap of "
                                 f"{self._limits.max_ranks_per_run} ranks per run")
                ranks.add(rank)

    def forget(self, run_id: str) -> None:
        with self._lock:
            self._ranks.pop(run_id, None)

    def run_count(self) -> int:
        return len(self._ranks)
