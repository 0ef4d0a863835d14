"""Load -> analyze -> diagnose orchestration, and the live session around it.

`StepTimePipeline.run(request)` is the one application path: it selects the live or
summary data profile, runs the analyzer once, and hands the window straight to
diagnosis. `LiveStepTimeSession` is the sole live orchestration boundary: it owns
the incremental live-tail cache, last-good state, monotonic expiry and exact-object
reuse while the cursor, rank universe and strategy are unchanged.
"""
from __future__ import annotations

import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from traceml.processor.step_time.analysis import (
    analyze_snapshot,
    empty_window,
)
from traceml.processor.step_time.model import (
    FRESHNESS_BRIDGED,
    FRESHNESS_COLD,
    FRESHNESS_EXPIRED,
    FRESHNESS_LIVE,
    LIVE_TAIL_MAX_CELLS,
    LIVE_WINDOW_STEPS,
    SUMMARY_MAX_CELLS,
    SUMMARY_WINDOW_STEPS,
    WINDOW_LOOKBACK,
    LiveStepTimeResult,
    StepTimeAnalysis,
    StepTimeDiagnosis,
    StepTimeRepositorySnapshot,
    StepTimeWindow,
)
from traceml.processor.step_time.sqlite_reader import (
    LiveTail,
    load_live_snapshot,
    load_summary_snapshot,
)

LOG = logging.getLogger(__name__)

PROFILE_LIVE = "live"
PROFILE_SUMMARY = "summary"
PROFILES = (PROFILE_LIVE, PROFILE_SUMMARY)

BRIDGE_TTL_S = 30.0
RESOURCE_REFRESH_S = 5.0
"""How long the live session reuses the resource figures it read (the sampler's default interval:
nothing newer can have arrived sooner); a run of 1,024 ranks costs one read per 5 s, not per tick."""
RESOURCE_READ_DUTY = 0.05
"""... and at most this share of the session's time goes to resource reads: a read that took
0.37 s (1,024 ranks, benchmarks/bench_resource_analysis.py) is next made 7.4 s later."""
_READ = object()  # `StepTimePipeline.analyze`: read the resources from the store

Diagnose = Callable[..., StepTimeDiagnosis]
"""`diagnose(window, resources=None)`: the window, and the run's resource figures over it."""


def _default_diagnose(window: StepTimeWindow, resources=None) -> StepTimeDiagnosis:
    from traceml.processor.diagnosis import diagnose  # lazy: diagnosis sits above this layer

    return diagnose(window, resources=resources)


def _ledger(window: StepTimeWindow, diagnosis: StepTimeDiagnosis, resources):
    from traceml.processor.diagnosis.ledger import window_ledger  # lazy: diagnosis sits above this layer

    return window_ledger(window, diagnosis, resources)


def window_resources(db_path: str | Path | None, window: StepTimeWindow):
    """The run's resource figures over the window's steps (`processor.resources`), or None when
    there is no store to read or no step time to place them on. A failed read is logged and
    gives None: resource evidence never stops the step analysis."""
    if db_path is None or window.is_empty:
        return None
    from traceml.processor.resources.analysis import resource_window
    from traceml.processor.resources.reader import read_resource_samples

    span = window_time_span(window)
    if span is None:
        return None
    try:
        samples = read_resource_samples(db_path, window.run_id, span[0], span[1],
                                        window.steps[0], window.steps[-1])
        return resource_window(samples, window.steps, window.step_end_times)
    except (sqlite3.Error, OSError, ValueError) as exc:
        LOG.debug("resource read of run %s failed: %s", window.run_id, exc)
        return None


def window_time_span(window: StepTimeWindow) -> tuple[float, float] | None:
    """(start, end) unix seconds of the window: one median step before its first step's end (so
    the first step's own samples count) up to its last step's end; None without end times."""
    ends = [t for t in window.step_end_times if t == t]
    if not ends:
        return None
    gaps = sorted(b - a for a, b in zip(ends, ends[1:]) if b > a)
    lead = gaps[len(gaps) // 2] if gaps else 0.0
    return ends[0] - lead, ends[-1]


@dataclass(frozen=True)
class StepTimeRequest:
    """Which run of which database, through which profile; `max_steps` None = profile default."""

    db_path: str | Path
    run_id: str
    profile: str = PROFILE_LIVE
    max_steps: int | None = None
    lookback: int = WINDOW_LOOKBACK
    max_cells: int | None = None  # None = the profile's cell cap (LIVE_TAIL_MAX_CELLS, SUMMARY_MAX_CELLS)

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"unknown Step Time profile {self.profile!r}; expected one of {PROFILES}")

    @property
    def window_steps(self) -> int:
        if self.max_steps is not None:
            return self.max_steps
        return LIVE_WINDOW_STEPS if self.profile == PROFILE_LIVE else SUMMARY_WINDOW_STEPS

    @property
    def cell_cap(self) -> int:
        if self.max_cells is not None:
            return self.max_cells
        return LIVE_TAIL_MAX_CELLS if self.profile == PROFILE_LIVE else SUMMARY_MAX_CELLS


class StepTimePipeline:
    """The shared path: one repository snapshot, the analyzer once, diagnosis once."""

    def __init__(self, diagnose: Diagnose | None = None):
        self._diagnose = diagnose or _default_diagnose

    def run(self, request: StepTimeRequest) -> StepTimeAnalysis:
        if request.profile == PROFILE_SUMMARY:
            snapshot = load_summary_snapshot(request.db_path, request.run_id,
                                             request.window_steps, request.lookback, request.cell_cap)
        else:
            snapshot = load_live_snapshot(request.db_path, request.run_id,
                                          request.window_steps, request.lookback, request.cell_cap)
        return self.analyze(snapshot, request.window_steps, db_path=request.db_path)

    def analyze(self, snapshot: StepTimeRepositorySnapshot, max_steps: int, *,
                db_path: str | Path | None = None, resources=_READ) -> StepTimeAnalysis:
        """Analyse a snapshot; with `db_path`, the run's resource samples over the window are read
        from that store and diagnosed with it (`StepTimeAnalysis.resources`), unless `resources`
        gives the `ResourceWindow` to use (the live session's recent one)."""
        window = analyze_snapshot(snapshot, max_steps)
        if resources is _READ:
            resources = window_resources(db_path, window)
        diagnosis = self._diagnose(window, resources=resources)
        return StepTimeAnalysis(window=window, diagnosis=diagnosis,
                                cursor=snapshot.cursor, resources=resources,
                                input_before_forward_ranks=snapshot.input_before_forward_ranks,
                                ledger=_ledger(window, diagnosis, resources))

    def empty_analysis(self, run_id: str) -> StepTimeAnalysis:
        window = empty_window(run_id)
        diagnosis = self._diagnose(window)
        return StepTimeAnalysis(window=window, diagnosis=diagnosis, cursor=None,
                                ledger=_ledger(window, diagnosis, None))


class LiveStepTimeSession:
    """Live state for one consumer (terminal, re-exporter): call `refresh()` once per tick.

    Freshness: `cold` before any usable window, `live` after a usable read (an
    unchanged cursor stays live), `bridged` when a read is empty or fails within
    `bridge_ttl_s` of the last good one (the last good analysis is shown), `expired`
    after that (the canonical empty analysis). Time comes from `clock`
    (`time.monotonic` by default), so wall-clock jumps cannot move expiry.
    """

    def __init__(self, db_path: str | Path, run_id: str, *, window: int = LIVE_WINDOW_STEPS,
                 lookback: int = WINDOW_LOOKBACK, max_cells: int = LIVE_TAIL_MAX_CELLS,
                 bridge_ttl_s: float = BRIDGE_TTL_S,
                 pipeline: StepTimePipeline | None = None, diagnose: Diagnose | None = None,
                 clock: Callable[[], float] | None = None):
        self.db_path = Path(db_path)
        self.run_id = run_id
        self.window = window
        self.bridge_ttl_s = bridge_ttl_s
        self._pipeline = pipeline or StepTimePipeline(diagnose)
        self._clock = clock or time.monotonic  # never wall time: clock corrections must not move expiry
        self._lock = threading.Lock()
        self._tail = LiveTail(run_id, window, lookback, max_cells)
        self._last_good: StepTimeAnalysis | None = None
        self._last_good_at: float | None = None
        self._current: StepTimeAnalysis | None = None  # analysis of the latest read
        self._empty: StepTimeAnalysis | None = None
        self._resources = None  # the latest ResourceWindow read, and when to read again (monotonic)
        self._resources_due: float | None = None
        self.resource_refresh_s = RESOURCE_REFRESH_S
        self.analyses = 0  # how many times the analyzer ran (reuse is visible in tests)

    def refresh(self) -> LiveStepTimeResult:
        with self._lock:
            now = self._clock()
            error: str | None = None
            try:
                read = self._tail.read(self.db_path)
            except (sqlite3.Error, OSError) as exc:
                error = f"{type(exc).__name__}: {exc}"
                LOG.debug("live step time read of run %s failed: %s", self.run_id, error)
                self._tail.reset()
                read = None
            if read is not None:
                if read.unchanged and self._current is not None:
                    analysis = self._current
                elif read.snapshot is not None:
                    analysis = self._analyze(read.snapshot, now)
                    self.analyses += 1
                    self._current = analysis
                else:  # unchanged, but nothing analysed yet (cannot happen after a full read)
                    analysis = None
                if analysis is not None and not analysis.window.is_empty:
                    self._last_good, self._last_good_at = analysis, now
                    return LiveStepTimeResult(analysis, FRESHNESS_LIVE, 0.0, None)
            return self._fallback(now, error)

    def _analyze(self, snapshot: StepTimeRepositorySnapshot, now: float) -> StepTimeAnalysis:
        """The pipeline's analysis, with resource figures re-read at most every `resource_refresh_s`."""
        if self._resources_due is not None and now < self._resources_due:
            return self._pipeline.analyze(snapshot, self.window, resources=self._resources)
        started = time.perf_counter()
        analysis = self._pipeline.analyze(snapshot, self.window, db_path=self.db_path)
        took = time.perf_counter() - started  # the step analysis included: errs on the cheap side
        if analysis.resources is not None and not analysis.resources.is_empty:
            # An empty read is not kept: a young run's first samples show at the next tick, not 5 s on.
            self._resources = analysis.resources
            self._resources_due = now + max(self.resource_refresh_s, took / RESOURCE_READ_DUTY)
        return analysis

    def _fallback(self, now: float, error: str | None) -> LiveStepTimeResult:
        if self._last_good is None or self._last_good_at is None:
            return LiveStepTimeResult(self._empty_analysis(), FRESHNESS_COLD, None, error)
        age = now - self._last_good_at
        if age <= self.bridge_ttl_s:
            return LiveStepTimeResult(self._last_good, FRESHNESS_BRIDGED, age, error)
        return LiveStepTimeResult(self._empty_analysis(), FRESHNESS_EXPIRED, age, error)

    def _empty_analysis(self) -> StepTimeAnalysis:
        if self._empty is None:
            self._empty = self._pipeline.empty_analysis(self.run_id)
        return self._empty


__all__ = [
    "BRIDGE_TTL_S", "window_resources", "window_time_span", "LiveStepTimeSession", "PROFILE_LIVE", "PROFILE_SUMMARY",
    "StepTimePipeline", "StepTimeRequest",
]
