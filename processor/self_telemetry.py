"""The processor's own counters, in one place: what the receivers took and refused, and why.

As the Collector's obsreport does for its receivers, every export request ends
on one counting path, counted once where its fate is decided:

- a receiver counts the refusals it decides before the intake sees the request
  (`refused`: unauthenticated, over the concurrent limit, too large, unsupported
  media, undecodable);
- the intake (`OtlpIntake`) counts an accepted request and its decoder verdicts
  (records rejected, ignored);
- the ingest queue counts what the store did with the records (accepted,
  duplicate) and the refusals the queue itself decides (back-pressure,
  unavailable);
- the OTLP/HTTP front counts what it did to connections below the request
  level (refused or evicted at the cap, timeouts, framing errors, hang-ups,
  failed TLS, accept out of descriptors).

Every key is drawn from closed sets in `schema/vocabulary.py`, so the counters
are one fixed array of int64 (and a bounded set of series on `/metrics`). With
ingest workers the array lives in shared memory, so the main process reports
every process's work.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from traceml.schema import vocabulary as v

RECORDS_METRIC = v.METRIC_PROCESSOR_RECORDS
REQUESTS_METRIC = v.METRIC_PROCESSOR_REQUESTS
CONNECTIONS_METRIC = v.METRIC_PROCESSOR_HTTP_CONNECTION_EVENTS


@dataclass(frozen=True)
class CounterKey:
    """One counter: a metric and the attribute values of its series (absent ones are None)."""

    metric: str
    outcome: str | None = None
    signal: str | None = None
    reason: str | None = None
    connection_event: str | None = None

    def attributes(self) -> dict[str, str]:
        pairs = ((v.ATTR_OUTCOME, self.outcome), (v.ATTR_SIGNAL, self.signal), (v.ATTR_REASON, self.reason),
                 (v.ATTR_CONNECTION_EVENT, self.connection_event))
        return {key: value for key, value in pairs if value is not None}


KEYS: tuple[CounterKey, ...] = (
    *(CounterKey(RECORDS_METRIC, outcome, signal) for outcome in v.RECORD_OUTCOMES for signal in v.SIGNALS),
    *(CounterKey(REQUESTS_METRIC, v.REQUEST_ACCEPTED, signal) for signal in v.SIGNALS),
    *(CounterKey(REQUESTS_METRIC, v.REQUEST_REFUSED, signal, reason)
      for reason in v.REFUSAL_REASONS for signal in v.SIGNALS),
    *(CounterKey(CONNECTIONS_METRIC, connection_event=event) for event in v.HTTP_CONNECTION_EVENTS),
)
_INDEX = {key: i for i, key in enumerate(KEYS)}


def _index(key: CounterKey) -> int:
    try:
        return _INDEX[key]
    except KeyError:
        raise ValueError(f"not a self-metric counter: {key}") from None


class SelfTelemetry:
    """Thread-safe counters over `KEYS`; `shared`: a `multiprocessing.Array("q", len(KEYS))`.

    A value outside the vocabulary's closed sets is a programming error and raises
    ValueError, so no call site can add a series.
    """

    size = len(KEYS)

    def __init__(self, shared=None) -> None:
        if shared is not None and len(shared) != len(KEYS):
            raise ValueError(f"shared counters hold {len(shared)} values, {len(KEYS)} needed")
        self._values = shared if shared is not None else [0] * len(KEYS)
        self._lock = shared.get_lock() if shared is not None else threading.Lock()

    def _add(self, key: CounterKey, count: int) -> None:
        index = _index(key)
        if count:
            with self._lock:
                self._values[index] += count

    # --- the counting path --------------------------------------------------------------

    def records(self, outcome: str, signal: str, count: int) -> None:
        """`count` records of one export request ended as `outcome` (`RECORD_OUTCOMES`)."""
        self._add(CounterKey(RECORDS_METRIC, outcome, signal), count)

    def accepted(self, signal: str) -> None:
        """One export request was answered OK (its records are counted by `records`)."""
        self._add(CounterKey(REQUESTS_METRIC, v.REQUEST_ACCEPTED, signal), 1)

    def refused(self, signal: str, reason: str) -> None:
        """One export request was refused, for `reason` (`REFUSAL_REASONS`)."""
        self._add(CounterKey(REQUESTS_METRIC, v.REQUEST_REFUSED, signal, reason), 1)

    def connection_event(self, event: str) -> None:
        """The OTLP/HTTP front did `event` (`HTTP_CONNECTION_EVENTS`) to one connection."""
        self._add(CounterKey(CONNECTIONS_METRIC, connection_event=event), 1)

    # --- reading ------------------------------------------------------------------------

    def counts(self) -> dict[CounterKey, int]:
        """Every counter, zeros included."""
        with self._lock:
            values = list(self._values)
        return dict(zip(KEYS, values))

    def snapshot(self) -> dict[tuple[str, str], int]:
        """Record counts by (outcome, signal), non-zero only."""
        return {(key.outcome, key.signal): n for key, n in self.counts().items()
                if key.metric == RECORDS_METRIC and n}

    def refusals(self) -> dict[tuple[str, str], int]:
        """Refused requests by (reason, signal), non-zero only."""
        return {(key.reason, key.signal): n for key, n in self.counts().items()
                if key.metric == REQUESTS_METRIC and key.outcome == v.REQUEST_REFUSED and n}
