"""The run monitor is woken by work, not by a clock (issue 37): a run is analysed again only when
rows arrived for it and something needs the result (its first rows, a reader of its points, its
end); an unchanged run is never refreshed, and an idle monitor does no rounds."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from traceml.processor.metric_point import MetricPoint
from traceml.processor.runs import END_BY_IDLE, RunMonitor
from traceml.processor.step_time.model import RankIdentity, RawEventValue, StepTimeIngestRecord
from traceml.processor.store_records import DecodedBatch
from traceml.schema import vocabulary as v


class _Backend:
    """Counts refreshes; each projects one point carrying the refresh count."""

    def __init__(self) -> None:
        self.refreshes = 0
        self.lock = threading.Lock()

    def open_session(self, db_path, run_id):
        backend = self

        class Session:
            def refresh(self):
                with backend.lock:
                    backend.refreshes += 1
                return SimpleNamespace(freshness="live", count=backend.refreshes)
        return Session()

    def project(self, db_path, result):
        return [MetricPoint("refreshes", {}, float(result.count))]

    def write_summary(self, db_path, run_id, folder):
        return []


def _rows(run: str, steps: range) -> DecodedBatch:
    events = {v.RAW_STEP_TIME: RawEventValue(95.0, None, 1)}
    return DecodedBatch(v.SIGNAL_TRACES, step_records=[
        StepTimeIngestRecord(run, RankIdentity(0, world_size=1), step, float(step), step + 0.5, events, "ddp")
        for step in steps])


def _until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    return predicate()


@pytest.mark.slow
def test_rows_are_analysed_when_read_and_an_unchanged_run_never_again(tmp_path):
    backend = _Backend()
    monitor = RunMonitor(tmp_path / "absent.db", backend, summary_dir=None, refresh_interval_s=5.0,
                         idle_timeout_s=3600.0)
    monitor.start()
    try:
        monitor.observe([_rows("r", range(3))])
        assert _until(lambda: backend.refreshes == 1)  # the first rows open the run's session
        rounds = monitor.ticks
        monitor.observe([_rows("r", range(3, 6))])  # more rows, nobody reading: no analysis, no round
        time.sleep(0.3)
        assert backend.refreshes == 1 and monitor.ticks == rounds
        points = monitor.points()  # a reader (a scrape): the new rows are analysed before it gets its points
        assert backend.refreshes == 2 and MetricPoint("refreshes", {}, 2.0) in points
        rounds = monitor.ticks
        for _ in range(3):  # nothing new: readers wait for nothing and nothing is refreshed
            monitor.points()
        time.sleep(0.3)
        assert backend.refreshes == 2 and monitor.ticks == rounds
    finally:
        monitor.stop(summarise_open_runs=False)


def test_an_idle_run_ends_at_its_deadline_without_rounds_before_it(tmp_path):
    backend = _Backend()
    monitor = RunMonitor(tmp_path / "absent.db", backend, summary_dir=None, refresh_interval_s=0.01,
                         idle_timeout_s=0.4)
    monitor.start()
    try:
        started = time.monotonic()
        monitor.observe([_rows("idle", range(2))])
        assert _until(lambda: monitor.state("idle").ended == END_BY_IDLE, 10.0)
        assert time.monotonic() - started >= 0.4
        # The session's opening, then the end at the deadline: not a round every refresh interval
        # (0.01 s would have been about 40 rounds).
        assert monitor.ticks <= 4
    finally:
        monitor.stop(summarise_open_runs=False)


def test_with_a_watch_interval_rows_nobody_reads_are_analysed_at_that_pace_and_each_analysis_is_told(tmp_path):
    """--capture auto (issue 33): the policy can only ask for a capture after an analysis, so a run
    with new rows is refreshed every `watch_interval_s` although nobody reads its figures."""
    backend = _Backend()
    told = []
    monitor = RunMonitor(tmp_path / "absent.db", backend, summary_dir=None, refresh_interval_s=5.0,
                         idle_timeout_s=3600.0, watch_interval_s=0.2,
                         on_refreshed=lambda run_id, result: told.append((run_id, result.count)))
    monitor.start()
    try:
        monitor.observe([_rows("w", range(3))])
        assert _until(lambda: backend.refreshes == 1)
        monitor.observe([_rows("w", range(3, 6))])  # nobody reads: analysed by the watch all the same
        assert _until(lambda: backend.refreshes == 2, 5.0)
        assert told == [("w", 1), ("w", 2)]
        time.sleep(0.5)  # nothing new: nothing refreshed
        assert backend.refreshes == 2
    finally:
        monitor.stop(summarise_open_runs=False)


def test_the_watch_doubles_a_runs_interval_while_nothing_is_near_and_starts_over_when_something_is(tmp_path):
    """Issue 37: a run whose analyses find nothing a capture could be asked for is watched ever less
    often (up to `watch_max_interval_s`); one that names a culprit, at the start again. New rows
    arrive every second; the monitor's rounds run on a clock the test sets."""
    backend = _Backend()
    near = {1: True, 2: False, 3: False, 4: False, 5: True}  # the policy's answer to each analysis
    now = [0.0]
    monitor = RunMonitor(tmp_path / "absent.db", backend, summary_dir=None, refresh_interval_s=5.0,
                         idle_timeout_s=3600.0, watch_interval_s=1.0, watch_max_interval_s=4.0,
                         clock=lambda: now[0], on_refreshed=lambda run_id, result: near.get(result.count, True))
    analysed_at = []
    for second in range(13):
        now[0] = float(second)
        monitor.observe([_rows("w", range(second * 3, second * 3 + 3))])
        before = backend.refreshes
        monitor.tick(refresh_dirty=False)  # a round nobody asked for: only the watch refreshes
        if backend.refreshes > before:
            analysed_at.append(second)
    # 1 s after a near answer, then 2 and 4 s, 4 s at most, and 1 s again after the next near one.
    assert analysed_at == [0, 1, 3, 7, 11, 12]
