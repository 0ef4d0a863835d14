"""The badput ledger's arithmetic on synthetic windows (processor/diagnosis/ledger.py).

Each window is analysed by the real analyzer from rows stated per (rank, step), and the
expected rank-seconds are worked out by hand from those rows, so the ledger is checked
against arithmetic, not against itself.
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from traceml.processor.diagnosis import diagnose
from traceml.processor.diagnosis.ledger import (
    AttemptSpan,
    RestartLoss,
    restart_loss,
    run_ledger,
    run_ledger_from,
    window_ledger,
)
from traceml.processor.reporting.badput import badput_lines, project_badput
from traceml.processor.reporting.inputs import RunTelemetry
from traceml.processor.resources.model import RankResources, ResourceWindow
from traceml.processor.step_time.analysis import analyze_snapshot
from traceml.processor.step_time.model import (
    ClockPair,
    RankIdentity,
    StepTimeAnalysis,
    StepTimeRepositorySnapshot,
    StepTimeSourceCursor,
    StepTimeSourceRow,
)
from traceml.schema.badput import LEDGER_CAUSES, WINDOW_CAUSES
from traceml.schema.vocabulary import (
    METRIC_BACKWARD,
    METRIC_COLLECTIVE_WAIT,
    METRIC_FORWARD,
    METRIC_H2D,
    METRIC_INPUT_WAIT,
    METRIC_OPTIMIZER_STEP,
    METRIC_TRACED_STEP_TIME,
    RAW_STEP_TIME,
)

_NAMES = {"iw": METRIC_INPUT_WAIT, "h2d": METRIC_H2D, "fwd": METRIC_FORWARD, "bwd": METRIC_BACKWARD,
          "opt": METRIC_OPTIMIZER_STEP, "cw": METRIC_COLLECTIVE_WAIT}


def step(iw=None, h2d=None, fwd=10.0, bwd=20.0, opt=5.0, cw=None, extra=0.0) -> dict:
    """One rank's step (CPU clock, ms); the traced step holds every phase, the wait and `extra`."""
    values = {"iw": iw, "h2d": h2d, "fwd": fwd, "bwd": bwd, "opt": opt, "cw": cw}
    traced = sum(v for k, v in values.items() if k != "iw" and v is not None) + extra
    out = {_NAMES[k]: v for k, v in values.items() if v is not None}
    out[METRIC_TRACED_STEP_TIME] = traced
    return out


def analysis_of(payload, ranks: int, steps: int, strategy: str = "ddp", resources=None) -> StepTimeAnalysis:
    """`payload(rank, step) -> {metric: ms}` analysed by the real analyzer, diagnosed, ledgered."""
    rows, row_id = [], 0
    for s in range(steps):
        for r in range(ranks):
            row_id += 1
            rows.append(StepTimeSourceRow(row_id, r, s, 1_000.0 + s, {
                m: ClockPair(float(v), None) for m, v in payload(r, s).items()}))
    snapshot = StepTimeRepositorySnapshot(
        run_id="ledger", training_strategy=strategy,
        ranks={r: RankIdentity(r, local_rank=r, hostname="h") for r in range(ranks)},
        cursor=StepTimeSourceCursor(row_id, steps - 1), rows=rows)
    window = analyze_snapshot(snapshot, 10_000)
    diagnosis = diagnose(window, resources=resources)
    return StepTimeAnalysis(window=window, diagnosis=diagnosis, resources=resources,
                            ledger=window_ledger(window, diagnosis, resources))


def input_straggler(rank: int, s: int) -> dict:
    """Rank 1's loader takes 50 ms; rank 0 waits those 50 ms (plus 1 ms of transfer) in a
    collective between phases. Both steps last 86 ms."""
    if rank == 1:
        return step(iw=50.0, cw=1.0)
    return step(iw=0.0, cw=51.0)


def test_an_input_straggler_is_counted_once_per_rank_and_cause():
    a = analysis_of(input_straggler, ranks=2, steps=30)
    ledger = a.ledger
    assert a.diagnosis.primary.kind == "INPUT_STRAGGLER" and a.diagnosis.primary.culprit_rank == 1
    c = ledger.causes
    assert set(c) == set(WINDOW_CAUSES)
    assert c["input_stall"].rank_seconds == pytest.approx(50 * 30 / 1000)  # rank 1's own stall
    assert c["input_stall"].worst_rank == 1
    assert c["straggler_wait"].rank_seconds == pytest.approx(50 * 30 / 1000)  # rank 0 waited for it
    assert (c["straggler_wait"].culprit_rank, c["straggler_wait"].worst_rank) == (1, 0)
    assert c["communication"].rank_seconds == pytest.approx(1 * 2 * 30 / 1000)  # the floor, on both
    assert c["communication"].worst_rank is None  # spread evenly: nobody stands out
    assert c["h2d"].rank_seconds == 0.0 and c["drift"].rank_seconds == 0.0
    assert ledger.total_rank_seconds == pytest.approx(3.06)
    assert ledger.window_rank_seconds == pytest.approx(86 * 2 * 30 / 1000)
    assert ledger.total_share == pytest.approx(3.06 / 5.16)
    assert c["straggler_wait"].share == pytest.approx(1.5 / 5.16)
    # CPU run: no device known, so no device-hours at all.
    assert ledger.devices_known == 0 and ledger.total_device_hours is None
    assert all(x.device_hours is None for x in c.values())

    (what_if,) = ledger.what_ifs
    assert (what_if.kind, what_if.culprit_rank, what_if.basis) == ("INPUT_STRAGGLER", 1, "median")
    assert what_if.step_time_ms == pytest.approx(86.0)
    assert what_if.predicted_step_time_ms == pytest.approx(36.0)  # rank 0 stops waiting 50 ms
    assert what_if.speedup == pytest.approx(86 / 36)
    assert what_if.speedup_low == pytest.approx(86 / 36) == what_if.speedup_high  # no spread
    # Its lost time: rank 0's wait for it and its own extra input wait over the victim's.
    assert what_if.rank_seconds == pytest.approx(1.5 + 1.5)


def test_a_balanced_window_loses_only_its_communication():
    a = analysis_of(lambda r, s: step(iw=0.0, cw=4.0), ranks=4, steps=30)
    c = a.ledger.causes
    assert a.diagnosis.primary.kind == "BALANCED"
    assert c["straggler_wait"].rank_seconds == 0.0 and c["straggler_wait"].culprit_rank is None
    assert c["input_stall"].rank_seconds == 0.0
    assert c["communication"].rank_seconds == pytest.approx(4 * 4 * 30 / 1000)
    assert a.ledger.total_rank_seconds == pytest.approx(c["communication"].rank_seconds)
    assert a.ledger.what_ifs == ()


def test_the_what_if_interval_is_the_10th_to_90th_percentile_of_the_per_step_predictions():
    rng = random.Random(5)
    # Rank 1 is late by a jittered 30-70 ms of input each step; every phase jitters too.
    draws = [(rng.uniform(30, 70), rng.uniform(8, 12), rng.uniform(18, 22), rng.uniform(0.5, 1.5))
             for _ in range(40)]

    def payload(rank, s):
        late, fwd, bwd, link = draws[s]
        if rank == 1:
            return step(iw=late, fwd=fwd, bwd=bwd, cw=link)
        return step(iw=0.0, fwd=fwd, bwd=bwd, cw=link + late)

    what_if = analysis_of(payload, ranks=2, steps=40).ledger.what_ifs[0]
    now = np.array([fwd + bwd + 5.0 + link + late for late, fwd, bwd, link in draws])  # rank 0's step
    predicted = np.array([fwd + bwd + 5.0 + link for late, fwd, bwd, link in draws])  # without the wait
    q10, q90 = np.percentile(predicted, [10, 90])
    assert what_if.step_time_ms == pytest.approx(now.mean())
    assert what_if.predicted_step_time_ms == pytest.approx(predicted.mean())
    assert what_if.speedup_low == pytest.approx(now.mean() / max(q90, predicted.mean()))
    assert what_if.speedup_high == pytest.approx(now.mean() / min(q10, predicted.mean()))
    assert what_if.speedup_low < what_if.speedup < what_if.speedup_high


def test_without_collective_wait_the_visible_phase_counts_the_wait_and_communication_is_unknown():
    # The contract's DDP straggler: rank 0's input 100 ms; rank 1 waits in its backward (120 = 20 + 100).
    def payload(rank, s):
        return step(iw=100.0, bwd=20.0, opt=None) if rank == 0 else step(iw=0.0, bwd=120.0, opt=None)

    a = analysis_of(payload, ranks=2, steps=24)
    c = a.ledger.causes
    assert c["communication"].rank_seconds is None and c["communication"].share is None
    assert c["straggler_wait"].rank_seconds == pytest.approx(100 * 24 / 1000)
    assert c["straggler_wait"].culprit_rank == 0
    (what_if,) = a.ledger.what_ifs
    assert what_if.predicted_step_time_ms == pytest.approx(30.0)  # rank 1's own 10 + 20 ms
    assert a.ledger.total_rank_seconds == pytest.approx((100 + 100) * 24 / 1000)


def test_a_drift_counts_its_excess_over_its_own_best_window_once():
    # Every rank's forward grows by 30 ms from step 20 on; its input wait grows by 10 ms too.
    def payload(rank, s):
        return step(iw=5.0 + (10.0 if s >= 20 else 0.0), fwd=40.0 if s >= 20 else 10.0, cw=1.0)

    a = analysis_of(payload, ranks=2, steps=40)
    kinds = [i.kind for i in a.diagnosis.issues]
    assert "STEP_TIME_DRIFT" in kinds
    c = a.ledger.causes
    assert c["drift"].rank_seconds == pytest.approx(30 * 20 * 2 / 1000)  # the forward growth only
    assert c["input_stall"].rank_seconds == pytest.approx((5 * 20 + 15 * 20) * 2 / 1000)  # its own cause
    drift = next(w for w in a.ledger.what_ifs if w.kind == "STEP_TIME_DRIFT")
    assert (drift.basis, drift.step_time_ms, drift.predicted_step_time_ms) == ("best_window", 81.0, 41.0)
    assert drift.rank_seconds == pytest.approx(40 * 20 * 2 / 1000)  # every phase's growth


def test_a_wait_that_grows_without_collective_wait_measured_is_the_stragglers_not_the_drifts():
    # No collective wait: rank 0 waits in its backward for rank 1's input, 50 ms, then 80 ms from
    # step 20 on. The job drifts (85 -> 115 ms), but every added ms is rank 1's input and rank 0's wait.
    def payload(rank, s):
        late = 80.0 if s >= 20 else 50.0
        return step(iw=late, bwd=20.0) if rank == 1 else step(iw=0.0, bwd=20.0 + late)

    a = analysis_of(payload, ranks=2, steps=40)
    assert "STEP_TIME_DRIFT" in [i.kind for i in a.diagnosis.issues]
    c = a.ledger.causes
    assert c["communication"].rank_seconds is None
    assert c["straggler_wait"].rank_seconds == pytest.approx((50 + 80) * 20 / 1000)
    assert c["input_stall"].rank_seconds == pytest.approx((50 + 80) * 20 / 1000)
    assert c["drift"].rank_seconds == pytest.approx(0.0, abs=1e-9)  # counted once, in its own causes
    assert a.ledger.total_rank_seconds == pytest.approx(2 * 2.6)


def test_a_short_window_cannot_judge_drift_and_a_loop_without_input_wait_has_no_input_stall():
    a = analysis_of(lambda r, s: step(cw=2.0), ranks=2, steps=12)
    c = a.ledger.causes
    assert a.ledger.step_basis == "traced_step_time"
    assert c["input_stall"].rank_seconds is None  # nobody measured it: unknown, not zero
    assert c["drift"].rank_seconds is None  # 12 < 20 steps: the drift rule could not run
    assert a.ledger.total_rank_seconds == pytest.approx(c["communication"].rank_seconds)


def test_device_hours_count_only_the_ranks_whose_gpu_is_known():
    resources = ResourceWindow(run_id="ledger", start_time=None, end_time=None, ranks={
        0: RankResources(0, "h", "GPU-0000", {}, 3), 1: RankResources(1, "h", None, {}, 3)})
    ledger = analysis_of(input_straggler, ranks=2, steps=30, resources=resources).ledger
    assert ledger.devices_known == 1
    # Rank 0 (the GPU) lost its wait and its share of the communication floor; rank 1 has no device.
    assert ledger.causes["straggler_wait"].device_hours == pytest.approx(50 * 30 / 1000 / 3600)
    assert ledger.causes["input_stall"].device_hours == pytest.approx(0.0)
    assert ledger.total_device_hours == pytest.approx((50 + 1) * 30 / 1000 / 3600)


def test_the_run_ledger_scales_the_window_and_adds_restarts_unscaled():
    window = analysis_of(input_straggler, ranks=2, steps=30).ledger  # steps 0..29
    restarts = RestartLoss(attempts=2, redone_steps=10, redone_rank_seconds=4.0, downtime_s=3.0,
                           downtime_rank_seconds=6.0)
    run = run_ledger(window, first_step_stored=-90, restarts=restarts)  # 120 steps so far
    assert (run.run_steps, run.scale) == (120, 4.0)
    assert run.causes["straggler_wait"].rank_seconds == pytest.approx(4 * 1.5)
    assert run.causes["restarts"].rank_seconds == pytest.approx(10.0)
    assert run.total_rank_seconds == pytest.approx(4 * 3.06 + 10.0)
    assert run.total_device_hours is None
    # The live view reads no attempts: restarts unknown, the run the window.
    live = run_ledger(window)
    assert live.scale == 1.0 and live.causes["restarts"].rank_seconds is None
    assert live.total_rank_seconds == pytest.approx(window.total_rank_seconds)


def test_restarts_count_the_steps_done_again_and_the_time_between_attempts():
    spans = [AttemptSpan(0, 2, 0, 9, 100.0, 110.0), AttemptSpan(1, 2, 5, 14, 125.0, 135.0),
             AttemptSpan(2, 4, 0, 3, 140.0, 144.0)]
    loss = restart_loss(spans, {0: (10, 5.0), 1: (20, 10.0)})
    assert (loss.attempts, loss.redone_steps, loss.redone_rank_seconds) == (3, 30, 15.0)
    assert loss.downtime_s == pytest.approx(15.0 + 5.0)
    assert loss.downtime_rank_seconds == pytest.approx(15.0 * 2 + 5.0 * 4)
    assert loss.rank_seconds == pytest.approx(65.0)
    assert restart_loss(spans[:1], {}).rank_seconds == 0.0


def test_the_restart_facts_are_read_from_the_attempt_tables(tmp_path):
    from traceml.processor.sqlite_writer import StepTimeStore
    from traceml.processor.step_time.model import RawEventValue, StepTimeIngestRecord
    from traceml.processor.store_read import read_run_restarts

    def record(rank, s, attempt, start):
        return StepTimeIngestRecord(
            run_id="r", identity=RankIdentity(rank, world_size=2), step=s, start_time=start,
            sample_time=start + 0.5, events={RAW_STEP_TIME: RawEventValue(500.0, None, 1)}, attempt=attempt)

    db = tmp_path / "t.sqlite"
    with StepTimeStore(db) as store:  # attempt 0: steps 0-9; attempt 1 resumes at step 6, 20 s later
        store.write([record(r, s, 0, 1_000.0 + s) for s in range(10) for r in (0, 1)], receive_time=2_000.0)
        store.write([record(r, s, 1, 1_030.0 + s) for s in range(6, 12) for r in (0, 1)], receive_time=2_100.0)
    spans, redone = read_run_restarts(db, "r")
    assert [(s.attempt, s.ranks, s.first_step, s.last_step) for s in spans] == [(0, 2, 0, 9), (1, 2, 6, 11)]
    assert redone == {0: (8, pytest.approx(8 * 0.5))}  # steps 6-9 of both ranks were done again
    loss = restart_loss(spans, redone)
    assert loss.downtime_s == pytest.approx(1_036.0 - 1_009.5)  # attempt 1's first step (6) began at 1,036
    telemetry = RunTelemetry(first_step_stored=6, attempt_spans=tuple(spans), redone_steps=redone)
    analysis = analysis_of(input_straggler, ranks=2, steps=30)
    assert run_ledger_from(analysis, telemetry).restarts == loss


def test_an_empty_window_has_a_ledger_of_nulls_that_projects_every_key():
    from traceml.processor.step_time.analysis import empty_window

    window = empty_window("nothing")
    analysis = StepTimeAnalysis(window=window, diagnosis=diagnose(window),
                                ledger=window_ledger(window, diagnose(window)))
    section = project_badput(run_ledger_from(analysis, RunTelemetry()))
    assert section["available"] is False and badput_lines(section) == []
    assert all(section["window"]["causes"][c]["rank_seconds"] is None for c in LEDGER_CAUSES)
    assert section["what_if"] == [] and section["restarts"] is None
    none = project_badput(None)
    assert json.dumps(none, sort_keys=True) == json.dumps(section, sort_keys=True)  # same nulls, same shape


def test_the_card_and_the_pages_show_the_ledger_and_escape_what_they_show():
    from traceml.processor.web.pages import badput_section

    analysis = analysis_of(input_straggler, ranks=2, steps=30)
    section = project_badput(run_ledger_from(analysis, RunTelemetry(first_step_stored=0)))
    text = "\n".join(badput_lines(section))
    assert "Lost time: 3.1 rank-s over the window (59%)" in text
    assert "straggler wait 1.5 rank-s (29%), waiting for rank 1" in text
    assert "device-hours: none known" in text
    assert "What if: INPUT_STRAGGLER (rank 1) at the median: step 86.0 -> 36.0 ms, 2.39x faster" in text
    hostile = dict(section, what_if=[dict(section["what_if"][0], kind="<script>x</script>")])
    html = badput_section({"badput": hostile})
    assert "<script>" not in html and "&lt;script&gt;" in html
