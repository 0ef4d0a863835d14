"""The dashboard driver: one live refresh per run per tick, shared by every open page.

`RunFeed.run_json(run_id)` answers every page of a run from one cached answer per
tick (`tick_s`): the first request of a tick refreshes the run's
`LiveStepTimeSession` once, reads the run facts beside it (memory peaks and
per-step peaks of the drawn ranks, telemetry health), builds the view model and
its HTML fragments, and encodes the JSON; the other pages of that tick get the
same bytes. A lock per run makes concurrent first requests wait for that one
refresh instead of starting their own.

Inside the processor the feed uses the run monitor's own session when the
monitor has one (`session_source`), so the web view adds no analysis of its own:
the session returns its exact previous analysis while the stored cursor is
unchanged. A run the monitor no longer watches (an older run of the database) gets
a session of the feed's, kept for the last `MAX_OWN_SESSIONS` runs viewed.
With a `capture_source` (the capture book's `of_run`) each view carries the run's
deep captures and their digests, and the page its "Capture" buttons.
"""
from __future__ import annotations

import datetime as _dt
import json
import sqlite3
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from traceml.processor.capture.model import CaptureRecord
from traceml.processor.sqlite_layout import connect_readonly
from traceml.processor.step_time.model import LiveStepTimeResult
from traceml.processor.store_read import StoreReadError, list_runs, read_run_facts, read_step_memory
from traceml.processor.web.pages import index_fragment, run_fragments
from traceml.processor.web.view import StepMemory, ViewInputs, build_run_view, drawn_ranks

TICK_S = 1.0
"""How long one refresh serves every page of a run (and how often the pages poll)."""
MAX_OWN_SESSIONS = 16
MAX_INDEX_RUNS = 200
"""The index lists at most this many runs, most recently active first."""

SessionSource = Callable[[str], object | None]  # run id -> a live session with refresh(), or None
CaptureSource = Callable[[str], Sequence[CaptureRecord]]  # run id -> its captures (the book's `of_run`)


def list_stored_runs(db_path: Path, limit: int = MAX_INDEX_RUNS) -> list[dict]:
    """The database's runs, most recently active first (`store_read.list_runs`), as the index
    lists them; empty when the file or its tables do not exist yet."""
    try:
        runs = list_runs(db_path, limit=limit)
    except StoreReadError:
        return []
    return [{"run_id": run.run_id, "latest_step": run.latest_step,
             "last_receive": _dt.datetime.fromtimestamp(run.last_receive_time, tz=_dt.timezone.utc)
             .strftime("%Y-%m-%d %H:%M:%S")} for run in runs]


@dataclass
class _Cached:
    at: float  # monotonic
    body: bytes
    view: dict


class RunFeed:
    """Cached JSON answers of the web view over one processor database."""

    def __init__(self, db_path: str | Path, *, tick_s: float = TICK_S,
                 session_source: SessionSource | None = None,
                 run_states: Callable[[], Mapping[str, str]] | None = None,
                 capture_source: CaptureSource | None = None,
                 prefix: str = "/ui", clock: Callable[[], float] = time.monotonic):
        self.db_path = Path(db_path)
        self.tick_s = tick_s
        self.prefix = prefix
        self._session_source = session_source
        self._run_states = run_states  # run id -> "active" / "ended (...)", from the run monitor
        self._capture_source = capture_source  # None: no capture book, so no digest and no button
        self._clock = clock
        self._lock = threading.Lock()
        self._run_locks: dict[str, threading.Lock] = {}
        self._cache: dict[str, _Cached] = {}
        self._own: OrderedDict[str, object] = OrderedDict()
        self._index: _Cached | None = None
        self._index_lock = threading.Lock()
        self.refreshes = 0  # session refreshes made (one per run per tick at most)

    # --- sessions ----------------------------------------------------------------------

    def _session(self, run_id: str):
        if self._session_source is not None:
            shared = self._session_source(run_id)
            if shared is not None:
                return shared
        with self._lock:
            session = self._own.get(run_id)
            if session is None:
                from traceml.processor.step_time.pipeline import LiveStepTimeSession

                session = self._own[run_id] = LiveStepTimeSession(self.db_path, run_id)
                while len(self._own) > MAX_OWN_SESSIONS:
                    self._own.popitem(last=False)
            else:
                self._own.move_to_end(run_id)
            return session

    def _run_lock(self, run_id: str) -> threading.Lock:
        with self._lock:
            lock = self._run_locks.get(run_id)
            if lock is None:
                if len(self._run_locks) > 4 * MAX_INDEX_RUNS:  # bounded: forget runs nobody viewed lately
                    recent = self._clock() - 10 * self.tick_s
                    self._cache = {k: c for k, c in self._cache.items() if c.at >= recent}
                    self._run_locks = {k: v for k, v in self._run_locks.items() if k in self._cache}
                lock = self._run_locks[run_id] = threading.Lock()
            return lock

    # --- answers -----------------------------------------------------------------------

    def run_view(self, run_id: str) -> tuple[dict, bytes]:
        """(view, JSON body) of the run for this tick: built by the tick's first request only."""
        cached = self._cache.get(run_id)
        if cached is not None and self._clock() - cached.at < self.tick_s:
            return cached.view, cached.body
        with self._run_lock(run_id):
            cached = self._cache.get(run_id)
            now = self._clock()
            if cached is not None and now - cached.at < self.tick_s:
                return cached.view, cached.body  # another page refreshed it while we waited
            result: LiveStepTimeResult = self._session(run_id).refresh()
            self.refreshes += 1
            view = self._build(result)
            body = json.dumps({"view": view, "html": run_fragments(view)}, allow_nan=False,
                              separators=(",", ":")).encode()
            self._cache[run_id] = _Cached(self._clock(), body, view)
            return view, body

    def _build(self, result: LiveStepTimeResult) -> dict:
        analysis = result.analysis
        window = analysis.window
        memory, telemetry = read_run_facts(self.db_path, window.run_id, latest_memory=False,
                                           count_stored=False)
        if any(t.finished for t in telemetry.ranks):
            # Steps missing = completed - stored, known once a rank ended: only then is the
            # scan of the run's rows that counts what is stored worth a refresh.
            memory, telemetry = read_run_facts(self.db_path, window.run_id, latest_memory=False)
        step_memory = StepMemory()
        if window.steps:
            from traceml.processor.web.view import LAST_STEPS

            tail = window.steps[-LAST_STEPS:]
            step_memory = self._step_memory(window.run_id, drawn_ranks(analysis), tail[0], tail[-1])
        return build_run_view(analysis, ViewInputs(
            freshness=result.freshness, age_s=result.age_s, error=result.error, profile="live",
            max_steps=window.max_steps or self._window_steps(), generated_at=time.time(), memory=memory, telemetry=telemetry,
            step_memory=step_memory,
            captures=tuple(self._capture_source(window.run_id)) if self._capture_source is not None else (),
            capture_action=self._capture_source is not None))

    @staticmethod
    def _window_steps() -> int:
        from traceml.processor.step_time.model import LIVE_WINDOW_STEPS

        return LIVE_WINDOW_STEPS

    def _step_memory(self, run_id: str, ranks, first: int, last: int) -> StepMemory:
        try:
            conn = connect_readonly(self.db_path)
        except (sqlite3.Error, OSError):
            return StepMemory()
        try:
            return StepMemory(read_step_memory(conn, run_id, ranks, first, last))
        except sqlite3.Error:
            return StepMemory()
        finally:
            conn.close()

    def runs(self) -> tuple[list[dict], bytes]:
        """(runs, JSON body) of the index for this tick."""
        cached = self._index
        if cached is not None and self._clock() - cached.at < self.tick_s:
            return cached.view["runs"], cached.body
        with self._index_lock:
            cached = self._index
            if cached is not None and self._clock() - cached.at < self.tick_s:
                return cached.view["runs"], cached.body
            runs = list_stored_runs(self.db_path)
            states = dict(self._run_states()) if self._run_states is not None else {}
            listed = {r["run_id"] for r in runs}
            for run in runs:
                run["state"] = states.get(run["run_id"], "stored")
            for run_id, state in states.items():  # seen by the monitor, not committed yet
                if run_id not in listed and len(runs) < MAX_INDEX_RUNS:
                    runs.append({"run_id": run_id, "latest_step": None, "last_receive": None, "state": state})
            body = json.dumps({"runs": runs, "html": {"tm-runs": index_fragment(runs, self.prefix)}},
                              allow_nan=False, separators=(",", ":")).encode()
            self._index = _Cached(self._clock(), body, {"runs": runs})
            return runs, body


__all__ = ["MAX_INDEX_RUNS", "RunFeed", "TICK_S", "list_stored_runs"]
