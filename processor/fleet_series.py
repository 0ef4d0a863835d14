"""The fleet series on `/metrics` and the push: the store's culprit history, read now and then.

Per host that was a confirmed culprit of a run this processor summarised within the fleet
period (`--fleet-period`): runs flagged, runs seen on the host, rank-seconds lost waiting
for it (`vocabulary.METRIC_FLEET_HOST_*`, one `traceml.host` label). So the series are
bounded by the number of hosts in the fleet, whatever the number of runs; GPUs stay in
the CLI and the web view. Runs are sharded over processor replicas, so each replica
exports the runs it summarised and the recording rules in deploy/prometheus sum them.

Reading the history is one grouped query; it is made again when a run's culprits were
recorded (`invalidate`) or `REREAD_S` after the last read (the period moves on), never on
every scrape.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from traceml.processor.fleet import fleet_points

LOG = logging.getLogger(__name__)

REREAD_S = 60.0
"""The history is read again at most this often without a new record (runs leave the period)."""


class FleetSeries:
    def __init__(self, db_path: str | Path, period_s: float, *, clock=time.time):
        self.db_path = Path(db_path)
        self.period_s = float(period_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._points: list = []
        self._read_at: float | None = None

    def invalidate(self) -> None:
        with self._lock:
            self._read_at = None

    def points(self) -> list:
        from traceml.processor.store_read import StoreReadError, read_fleet

        now = self._clock()
        with self._lock:
            if self._read_at is not None and now - self._read_at < REREAD_S:
                return list(self._points)
            try:
                self._points = fleet_points(read_fleet(self.db_path, since=now - self.period_s))
            except StoreReadError as exc:  # no table yet (an older file before its first write): none
                LOG.debug("fleet series not read: %s", exc)
                self._points = []
            self._read_at = now
            return list(self._points)


__all__ = ["FleetSeries", "REREAD_S"]
