"""Per-run live state: refresh each run's analysis, project its summary metrics, end runs.

One `RunMonitor` thread keeps a `LiveStepTimeSession` per active run and the latest
projected points for `/metrics` and the OTLP push. A run ends when every rank of its
world sent `traceml.run.end`, or when no data arrived for `idle_timeout_s`; its
`final_summary.json` and text card are then written under
`<summary_dir>/<sanitised run id>/` and its live session (the cache that grows with
ranks x steps) is released. Data arriving after that reopens the run, and the summary
is rewritten at its next end.

Work wakes the thread, not a clock. A run is analysed again only when rows arrived
for it since its last analysis, and then only when something needs the result: its
first rows (the session opens), its end, or a reader of its points (`points()`: a
`/metrics` scrape, the OTLP push), which wakes the thread and waits for that refresh
at most `refresh_interval_s`. Rows arriving with nobody reading cost the commit's
bookkeeping and nothing else; between rows the thread sleeps until the next run's
idle or forget deadline, or until woken. With ingest workers in other processes
(`poll_store`) nothing can wake it, so it reads the store's activity every
`refresh_interval_s`.
"""
from __future__ import annotations

import logging
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Callable, Protocol, Sequence

from traceml.processor.store_records import DecodedBatch
from traceml.processor.metric_point import MetricPoint
from traceml.processor import settings
from traceml.processor.security import summary_folder
from traceml.processor.sqlite_layout import connect_readonly
from traceml.processor.store_read import read_rank_ends, read_run_activity
from traceml.schema import vocabulary as v

LOG = logging.getLogger(__name__)

END_BY_MARKERS = "markers"
END_BY_IDLE = "idle"
END_BY_SHUTDOWN = "shutdown"


def run_is_over(ranks: AbstractSet[int], world_size: int | None, finished: AbstractSet[int]) -> bool:
    """The one rule for "every rank of this run sent `traceml.run.end`".

    A run's ranks are those its declared world implies (0 .. world_size - 1) and
    every rank seen sending: a rank of the world that never reported keeps the run
    open, and so does a rank outside the declared world that is still running (a
    rank count alone would let one stand in for the other). A run with no known
    rank is not over.
    """
    expected = set(range(world_size)) if world_size else set()
    expected.update(ranks)
    return bool(expected) and expected <= finished


class RunBackend(Protocol):
    """What the monitor needs from the Step Time read side, reporting and diagnosis."""

    def open_session(self, db_path: Path, run_id: str): ...  # -> object with refresh()

    def project(self, db_path: Path, result) -> Sequence: ...  # LiveStepTimeResult -> points

    def write_summary(self, db_path: Path, run_id: str, folder: Path) -> list[Path]: ...


@dataclass
class RunState:
    run_id: str
    first_seen: float  # monotonic
    last_activity: float  # monotonic, last committed record of this run
    last_step_end: float | None = None  # wall clock, newest step end received
    ranks: set[int] = field(default_factory=set)
    world_size: int | None = None
    finished: set[int] = field(default_factory=set)
    attempt: int = 0  # elastic restart attempt of the newest data (end markers of earlier ones do not count)
    dirty: bool = True  # new data since the last refresh
    ended: str | None = None  # END_BY_* once summarised
    summary_files: list[Path] = field(default_factory=list)
    session: object | None = None
    points: list = field(default_factory=list)
    analysis_s: float | None = None
    refreshed_at: float = float("-inf")  # monotonic (the monitor's clock), latest refresh
    watch_s: float | None = None  # seconds between the watch's analyses of this run (None: the first)
    freshness: str | None = None
    last_error: str | None = None

    def all_finished(self) -> bool:
        return run_is_over(self.ranks, self.world_size, self.finished)


class RunMonitor:
    def __init__(self, db_path: Path, backend: RunBackend, *, summary_dir: Path | None,
                 refresh_interval_s: float = settings.REFRESH_INTERVAL.default,
                 idle_timeout_s: float = settings.IDLE_TIMEOUT.default,
                 retain_ended_s: float = 600.0, clock: Callable[[], float] = time.monotonic,
                 on_ended: Callable[[str], None] | None = None, poll_store: bool = False,
                 on_forgotten: Callable[[str], None] | None = None,
                 on_refreshed: Callable[[str, object], bool | None] | None = None,
                 watch_interval_s: float | None = None, watch_max_interval_s: float | None = None):
        self.db_path = Path(db_path)
        self.backend = backend
        self.summary_dir = Path(summary_dir) if summary_dir else None
        self.refresh_interval_s = refresh_interval_s
        self.idle_timeout_s = idle_timeout_s
        self.retain_ended_s = retain_ended_s
        self._clock = clock
        self._on_ended = on_ended
        self._on_forgotten = on_forgotten  # frees the run's slot under the run cap
        # Told each fresh analysis (the capture policy); with `watch_interval_s`, a run with new rows is
        # analysed that often although nobody reads its figures, so the policy sees its findings.
        # Where the callback answers False (nothing near to act on), the run's interval doubles, up
        # to `watch_max_interval_s`; any other answer takes it back to `watch_interval_s`.
        self._on_refreshed = on_refreshed
        self.watch_interval_s = watch_interval_s
        self.watch_max_interval_s = max(watch_interval_s or 0.0, watch_max_interval_s or 0.0)
        self._poll = poll_store  # ingest workers commit in other processes: learn from the store
        self._seen: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._runs: dict[str, RunState] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()  # work for the thread: a new or ending run, a reader, stop
        self._readers: list[threading.Event] = []  # readers waiting for the dirty runs' refresh
        self._thread = threading.Thread(target=self._loop, name="traceml-run-monitor", daemon=True)
        self.refreshes = 0
        self.ticks = 0  # completed rounds (tests wait on it; nothing else depends on it)

    # --- fed by the ingest writer after each commit ------------------------------------

    def observe(self, batches: Sequence[DecodedBatch]) -> None:
        now = self._clock()
        self._woken = False
        with self._lock:
            for batch in batches:
                for record in batch.step_records:
                    state = self._state(record.run_id, now)
                    if record.attempt > state.attempt:  # a restart: the earlier attempt's ends are not this one's
                        state.attempt = record.attempt
                        state.finished.clear()
                    state.ranks.add(record.identity.global_rank)
                    if record.identity.world_size:
                        state.world_size = max(state.world_size or 0, record.identity.world_size)
                    if state.last_step_end is None or record.sample_time > state.last_step_end:
                        state.last_step_end = record.sample_time
                for record in batch.memory_records:
                    self._state(record.run_id, now).ranks.add(record.global_rank)
                for drop in batch.drops:
                    self._state(drop.run_id, now)
                for marker in batch.run_ends:
                    state = self._state(marker.run_id, now)
                    state.ranks.add(marker.global_rank)
                    if marker.attempt < state.attempt:
                        continue
                    state.finished.add(marker.global_rank)
                    if marker.world_size:
                        state.world_size = max(state.world_size or 0, marker.world_size)
                    self._woken = True  # the run may be over
        if self._woken:
            self._wake.set()

    _woken = False  # set by `_state`/`observe` when the thread has something to do now

    def _state(self, run_id: str, now: float) -> RunState:
        state = self._runs.get(run_id)
        if state is None:
            state = self._runs[run_id] = RunState(run_id, now, now)
            self._woken = True  # a new run: open its session
        elif state.ended is not None:
            LOG.info("run %r received data after it ended (%s); reopened", run_id, state.ended)
            state.ended = None
            self._woken = True
        state.last_activity = now
        if not state.dirty and self.watch_interval_s is not None:
            self._woken = True  # watched: the thread schedules this run's next analysis
        state.dirty = True
        return state

    def adopt(self, run_ids: Sequence[str]) -> None:
        """At start-up: watch these runs of a reused database again, with their stored ranks
        and end markers; every other stored run counts as already seen (not active)."""
        now = self._clock()
        with self._lock:
            for run_id in run_ids:
                self._runs.setdefault(run_id, RunState(run_id, now, now))
        if not self.db_path.exists():
            return
        conn = connect_readonly(self.db_path)
        try:
            for run in read_run_activity(conn):
                self._seen[run.run_id] = (run.last_receive_time, run.latest_row_id)
            for run_id in run_ids:
                with self._lock:
                    self._load_ranks(conn, self._runs[run_id])
        except sqlite3.OperationalError:
            pass
        finally:
            conn.close()

    @staticmethod
    def _load_ranks(conn, state: RunState) -> None:
        """The run's stored ranks, declared world size and end markers, into `state`."""
        ends = read_rank_ends(conn, state.run_id)
        state.ranks.update(ends.ranks)
        if ends.world_size:
            state.world_size = max(state.world_size or 0, ends.world_size)
        state.finished.update(ends.finished)

    # --- read by /metrics and the OTLP pusher -----------------------------------------

    def points(self) -> list:
        """Every run's latest points, after the runs with new rows were refreshed (the reader
        waits for that at most `refresh_interval_s`; then it gets the points as they are)."""
        self.refresh_for_reader()
        with self._lock:
            states = list(self._runs.values())
        out: list = []
        now_wall = time.time()
        for state in states:
            out.extend(state.points)
            if state.analysis_s is not None:
                out.append(MetricPoint(v.METRIC_PROCESSOR_ANALYSIS_DURATION, {v.ATTR_RUN_ID: state.run_id},
                                       state.analysis_s))
            if state.last_step_end is not None and state.ended is None:
                out.append(MetricPoint(v.METRIC_PROCESSOR_RUN_LAG, {v.ATTR_RUN_ID: state.run_id},
                                       max(0.0, now_wall - state.last_step_end)))
        out.append(MetricPoint(v.METRIC_PROCESSOR_RUNS, {}, float(len(states))))
        return out

    def state(self, run_id: str) -> RunState | None:
        with self._lock:
            return self._runs.get(run_id)

    def run_ids(self) -> list[str]:
        with self._lock:
            return list(self._runs)

    def refresh_for_reader(self, wait_s: float | None = None) -> bool:
        """Have the thread refresh the active runs that received rows since their last refresh,
        and wait for it at most `wait_s` (default `refresh_interval_s`); True when nothing was
        left to refresh or it was done in time. Without the thread running, nothing is waited for."""
        if not self._thread.is_alive() or self._stop.is_set():
            return False
        done = threading.Event()
        with self._lock:
            if not any(state.dirty and state.ended is None for state in self._runs.values()):
                return True
            self._readers.append(done)
        self._wake.set()
        return done.wait(self.refresh_interval_s if wait_s is None else wait_s)

    # --- the loop ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, summarise_open_runs: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(30)
        self._release_readers()
        if summarise_open_runs:
            for run_id in self.run_ids():
                state = self.state(run_id)
                if state is not None and state.ended is None and (state.ranks or state.dirty):
                    self._refresh(state)
                    self._end(state, END_BY_SHUTDOWN)

    # Live analysis may use at most about a quarter of a core: after a round that took
    # T seconds the next starts no sooner than 3 T later (1,000-rank runs), and no
    # sooner than the refresh interval (small runs).
    ANALYSIS_PACING = 3.0

    def _loop(self) -> None:
        stop, wake = self._stop, self._wake
        next_round = 0.0
        while not stop.is_set():
            wake.wait(self._next_wait())
            wake.clear()
            if stop.is_set():
                break
            pause = next_round - time.monotonic()
            if pause > 0 and stop.wait(pause):
                break
            started = time.monotonic()
            with self._lock:
                readers, self._readers = self._readers, []
            try:
                self.tick(refresh_dirty=bool(readers))
            except Exception:
                LOG.exception("run monitor tick failed")
            finally:
                for reader in readers:
                    reader.set()
            next_round = started + self.ANALYSIS_PACING * (time.monotonic() - started)
        self._release_readers()

    def _release_readers(self) -> None:
        with self._lock:
            readers, self._readers = self._readers, []
        for reader in readers:
            reader.set()

    def _next_wait(self) -> float | None:
        """Seconds until the thread has something to do (None: nothing until it is woken)."""
        now = self._clock()
        due: list[float] = [now + self.refresh_interval_s] if self._poll else []
        with self._lock:
            if self._readers:
                return 0.0
            for state in self._runs.values():
                if state.ended is None:
                    if state.dirty and (state.session is None or state.all_finished()):
                        return 0.0
                    due.append(state.last_activity + self.idle_timeout_s)
                    if state.dirty and self.watch_interval_s is not None:
                        due.append(state.refreshed_at + self._watch_s(state))
                else:
                    due.append(state.last_activity + self.retain_ended_s)
        if not due:
            return None
        return max(0.0, min(due) - now) + 0.01  # just past the deadline, not a round before it

    def tick(self, refresh_dirty: bool = True) -> None:
        """One round: refresh changed runs, end finished or idle ones, forget old ones.

        `refresh_dirty=False` (the thread's rounds that no reader asked for) refreshes only
        the runs that need it anyway: a first session, or a run about to end."""
        if self._poll:
            self.poll_store()
        now = self._clock()
        with self._lock:
            states = list(self._runs.values())
        for state in states:
            if state.ended is None:
                ending = state.all_finished() or now - state.last_activity >= self.idle_timeout_s
                watched = self.watch_interval_s is not None and now - state.refreshed_at >= self._watch_s(state)
                if state.session is None or (state.dirty and (refresh_dirty or ending or watched)):
                    self._refresh(state)
                if state.all_finished():
                    self._end(state, END_BY_MARKERS)
                elif now - state.last_activity >= self.idle_timeout_s:
                    self._end(state, END_BY_IDLE)
            elif now - state.last_activity >= self.retain_ended_s:
                with self._lock:
                    forget = self._runs.get(state.run_id) is state and state.ended is not None
                    if forget:
                        del self._runs[state.run_id]
                if forget and self._on_forgotten is not None:
                    self._on_forgotten(state.run_id)
        self.ticks += 1

    def poll_store(self) -> None:
        """Runs whose stored activity changed since the last poll count as active (workers' commits)."""
        if not self.db_path.exists():
            return
        conn = connect_readonly(self.db_path)
        try:
            changed = []
            for run in read_run_activity(conn):
                marker = (run.last_receive_time, run.latest_row_id)
                if self._seen.get(run.run_id) != marker:
                    self._seen[run.run_id] = marker
                    changed.append((run.run_id, run.last_sample_time))
            for run_id, last_sample in changed:
                with self._lock:
                    state = self._state(run_id, self._clock())
                    self._load_ranks(conn, state)
                    if last_sample is not None and (state.last_step_end is None or last_sample > state.last_step_end):
                        state.last_step_end = last_sample
        except sqlite3.OperationalError:
            pass  # tables not created yet
        finally:
            conn.close()

    def _refresh(self, state: RunState) -> None:
        state.dirty = False
        state.refreshed_at = self._clock()
        started = time.perf_counter()
        try:
            if state.session is None:
                state.session = self.backend.open_session(self.db_path, state.run_id)
            result = state.session.refresh()
            state.points = list(self.backend.project(self.db_path, result))
            state.freshness = result.freshness
            state.last_error = None
        except Exception as exc:
            state.last_error = f"{type(exc).__name__}: {exc}"
            LOG.exception("live analysis of run %r failed", state.run_id)
            result = None
        state.analysis_s = time.perf_counter() - started
        # Not for a run ending now (every rank sent its end marker): nobody is left to act on it.
        if result is not None and self._on_refreshed is not None and not state.all_finished():
            try:
                near = self._on_refreshed(state.run_id, result) is not False
            except Exception:
                near = True
                LOG.exception("after the analysis of run %r", state.run_id)
            if self.watch_interval_s is not None:
                state.watch_s = self.watch_interval_s if near or state.watch_s is None \
                    else min(2 * state.watch_s, self.watch_max_interval_s)
        self.refreshes += 1

    def _watch_s(self, state: RunState) -> float:
        return self.watch_interval_s if state.watch_s is None else state.watch_s

    def _end(self, state: RunState, how: str) -> None:
        state.ended = how
        # An ended run is not refreshed again: its live cache (ranks x step ids of arrays) and
        # last window go now, not when the run is forgotten (`retain_ended_s` later); its
        # points stay for /metrics. Data after the end reopens the run with a new session.
        state.session = None
        LOG.info("run %r ended (%s): %d rank(s), %d finished", state.run_id, how,
                 len(state.ranks), len(state.finished))
        if self.summary_dir is None:
            return
        try:
            folder = summary_folder(self.summary_dir, state.run_id)
            folder.mkdir(parents=True, exist_ok=True)
            state.summary_files = list(self.backend.write_summary(self.db_path, state.run_id, folder))
        except Exception as exc:
            state.last_error = f"summary failed: {type(exc).__name__}: {exc}"
            LOG.exception("writing the summary of run %r failed", state.run_id)
        if self._on_ended is not None:
            self._on_ended(state.run_id)


def stored_run_is_over(conn: sqlite3.Connection, run_id: str) -> bool:
    """`run_is_over` on what the store holds for `run_id` (read at a restart)."""
    ends = read_rank_ends(conn, run_id)
    return run_is_over(ends.ranks, ends.world_size, ends.finished)
