"""An ended run releases its live session (the cache that grows with ranks x steps) at its end,
keeps its points for /metrics, and gets a new session when data reopens it."""
from __future__ import annotations

from traceml.processor.store_records import DecodedBatch
from traceml.processor.runs import END_BY_IDLE, RunMonitor
from traceml.processor.service import StepTimeBackend
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.model import RankIdentity, RawEventValue, StepTimeIngestRecord
from traceml.schema import vocabulary as v


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _records(run: str, steps: range) -> list[StepTimeIngestRecord]:
    events = {v.RAW_DATALOADER_NEXT: RawEventValue(5.0, None, 1), v.RAW_FORWARD: RawEventValue(30.0, None, 1),
              v.RAW_BACKWARD: RawEventValue(45.0, None, 1), v.RAW_OPTIMIZER_STEP: RawEventValue(10.0, None, 1),
              v.RAW_STEP_TIME: RawEventValue(95.0, None, 1)}
    return [StepTimeIngestRecord(run, RankIdentity(rank, world_size=2), step, float(step), step + 0.5,
                                 events, "ddp") for step in steps for rank in (0, 1)]


def test_an_ended_run_releases_its_session_and_a_reopened_one_gets_a_new_one(tmp_path):
    db = tmp_path / "m.db"
    clock = Clock()
    monitor = RunMonitor(db, StepTimeBackend(), summary_dir=tmp_path / "summaries", idle_timeout_s=10.0,
                         clock=clock)
    with StepTimeStore(db) as store:
        records = _records("big", range(30))
        store.write(records)
        monitor.observe([DecodedBatch(v.SIGNAL_TRACES, step_records=records)])
        monitor.tick()
        state = monitor.state("big")
        first = state.session
        assert first is not None and state.points and state.ended is None
        assert first._tail.slots == 30

        clock.now += 11.0
        monitor.tick()
        assert state.ended == END_BY_IDLE and len(state.summary_files) == 2
        assert state.session is None  # the cache and window went with the end, not 10 minutes later
        assert state.points  # /metrics keeps the run's last points until it is forgotten

        more = _records("big", range(30, 32))
        store.write(more)
        monitor.observe([DecodedBatch(v.SIGNAL_TRACES, step_records=more)])
        monitor.tick()
        assert state.ended is None and state.session is not None and state.session is not first
        assert state.session.refresh().analysis.window.steps[-1] == 31
