"""Input wait measured before forward (issue 30 item 2), from the store to the card.

A step inferred from an optimizer update in which no DataLoader `next()` was timed
carries its input wait with a count of 0 (the time from the previous update to the
first phase). The summary names the ranks whose every stored step was measured so
and the card says it once.
"""
from __future__ import annotations

import json

import jsonschema

from tests.step_time.handbuilt_windows import rank_values, window
from traceml.processor.diagnosis import diagnose
from traceml.processor.reporting import RunMetadata, RunTelemetry, project_final_summary
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.model import RankIdentity, RawEventValue, StepTimeAnalysis, StepTimeIngestRecord
from traceml.processor.store_read import read_run_facts
from traceml.schema.summary import final_summary_json_schema_text
from traceml.schema.vocabulary import RAW_BACKWARD, RAW_DATALOADER_NEXT, RAW_FORWARD, RAW_STEP_TIME

SENTENCE = "input wait measured as the time before forward: no DataLoader in this loop"


def _record(rank: int, step: int, input_count: int | None) -> StepTimeIngestRecord:
    events = {RAW_FORWARD: RawEventValue(3.0, None, 1), RAW_BACKWARD: RawEventValue(4.0, None, 1),
              RAW_STEP_TIME: RawEventValue(9.0, None, 1)}
    if input_count is not None:
        events[RAW_DATALOADER_NEXT] = RawEventValue(5.0, None, input_count)
    return StepTimeIngestRecord(run_id="r", identity=RankIdentity(rank, world_size=3), step=step,
                                start_time=1000.0 + step, sample_time=1000.5 + step, events=events,
                                training_strategy="ddp")


def test_the_store_names_the_ranks_whose_every_step_measured_input_before_forward(tmp_path):
    db = tmp_path / "s.db"
    # rank 0: before forward on every step; rank 1: a DataLoader (count 1) on one step of
    # three, so not every step; rank 2: no input wait at all (a marked loop).
    counts = {0: (0, 0, 0), 1: (0, 1, 0), 2: (None, None, None)}
    with StepTimeStore(db) as store:
        store.write([_record(rank, step, counts[rank][step]) for rank in counts for step in range(3)],
                    receive_time=2000.0)
    _, telemetry = read_run_facts(db, "r", latest_memory=False)
    assert list(telemetry.input_before_forward_ranks) == [0]


def _summary(ranks):
    w = window({0: rank_values(), 1: rank_values()})
    return project_final_summary(StepTimeAnalysis(window=w, diagnosis=diagnose(w)),
                                 RunMetadata(run_id="r", generated_at=0.0),
                                 telemetry=RunTelemetry(input_before_forward_ranks=ranks))


def test_the_card_says_it_once_and_the_json_names_the_ranks():
    summary = _summary((1, 0))
    assert summary["telemetry"]["input_wait_before_forward_ranks"] == [0, 1]
    assert summary["card"].count(SENTENCE) == 1 and "(r0, r1)" in summary["card"]
    jsonschema.validate(json.loads(json.dumps(summary)), json.loads(final_summary_json_schema_text()))


def test_a_dataloader_run_says_nothing_of_it():
    summary = _summary(())
    assert summary["telemetry"]["input_wait_before_forward_ranks"] == []
    assert SENTENCE not in summary["card"]


def test_the_report_page_says_it_beside_the_phase_bars():
    from traceml.processor.web.pages import phases_section
    from traceml.processor.web.view import ViewInputs, build_run_view

    w = window({0: rank_values(), 1: rank_values()})
    analysis = StepTimeAnalysis(window=w, diagnosis=diagnose(w))
    with_note = phases_section(build_run_view(analysis, ViewInputs(telemetry=RunTelemetry(input_before_forward_ranks=(0, 1)))))
    assert with_note.count(SENTENCE) == 1 and "0, 1" in with_note
    assert SENTENCE not in phases_section(build_run_view(analysis, ViewInputs(telemetry=RunTelemetry())))


def _live_text(result) -> str:
    from rich.console import Console

    from traceml.processor.presenters import render_live

    console = Console(width=300, record=True, color_system=None)
    console.print(render_live(result))
    return " ".join(console.export_text().split())


def test_the_live_view_says_it_from_the_rows_its_tail_already_reads(tmp_path, monkeypatch):
    """The live tail carries each row's input-wait marker (no scan of the run's rows): a full read
    names the ranks, an incremental read of newer rows updates them, and the panel says the note."""
    from traceml.processor.step_time import sqlite_reader
    from traceml.processor.step_time.pipeline import LiveStepTimeSession

    db = tmp_path / "s.db"
    counts = {0: (0, 0, 0), 1: (0, 1, 0), 2: (None, None, None)}
    with StepTimeStore(db) as store:
        store.write([_record(rank, step, counts[rank][step]) for rank in counts for step in range(3)],
                    receive_time=2000.0)
    session = LiveStepTimeSession(db, "r")
    first = session.refresh()
    assert first.analysis.input_before_forward_ranks == (0,)
    assert f"Note: {SENTENCE} (r0)" in _live_text(first)

    statements: list[str] = []
    real_connect = sqlite_reader.connect_reader

    def traced(path):
        conn = real_connect(path)
        conn.set_trace_callback(statements.append)
        return conn

    monkeypatch.setattr(sqlite_reader, "connect_reader", traced)
    # Rank 2 now measures before forward too; rank 0 times a DataLoader next() on its next step.
    with StepTimeStore(db) as store:
        store.write([_record(0, 3, 2), _record(1, 3, 0), _record(2, 3, 0)], receive_time=2001.0)
    second = session.refresh()
    assert second.analysis.input_before_forward_ranks == (2,)
    selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert len(selects) == 2 and " AND id > " in selects[1], selects  # header, then the newer rows only
    assert f"{SENTENCE} (r2)" in _live_text(second)

    # A DataLoader everywhere: nothing said.
    db2 = tmp_path / "d.db"
    with StepTimeStore(db2) as store:
        store.write([_record(rank, step, 1) for rank in range(2) for step in range(3)], receive_time=2000.0)
    plain = LiveStepTimeSession(db2, "r").refresh()
    assert plain.analysis.input_before_forward_ranks == ()
    assert SENTENCE not in _live_text(plain)
