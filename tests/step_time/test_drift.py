"""STEP_TIME_DRIFT on analysed windows built from real SQLite rows (issue 19 item 5)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from tests.step_time.scenarios import SCENARIO_SPECS, Scenario, _base, build_scenario
from traceml.processor.diagnosis.drift import change_points
from traceml.processor.step_time.pipeline import PROFILE_SUMMARY, StepTimePipeline, StepTimeRequest
from traceml.schema import diagnosis as d


def _issues(tmp_path, name, payload, ranks=2, steps=40, monkeypatch=None):
    spec = Scenario(name, ranks, tuple(range(1, steps + 1)), "cpu", "ddp", payload, "test")
    monkeypatch.setitem(SCENARIO_SPECS, name, spec)
    db = build_scenario(name, tmp_path / f"{name}.db")
    return StepTimePipeline().run(StepTimeRequest(db, name, profile=PROFILE_SUMMARY)).diagnosis.issues


def test_change_point_finds_the_step_a_level_shift_began():
    x = np.r_[np.full(17, 100.0), np.full(23, 130.0)][:, None]
    assert change_points(x, 5).tolist() == [17]


def test_one_rank_drifting_alone_is_named_with_its_onset(tmp_path, monkeypatch):
    def payload(rank, step):  # rank 1's input from step 26 on; rank 0 waits for it in its backward
        if step < 26:
            return _base()
        return _base(iw=45.0) if rank == 1 else _base(bwd=85.0, traced=135.0)
    issues = _issues(tmp_path, "one_rank_drift", payload, ranks=3, monkeypatch=monkeypatch)
    drift = [i for i in issues if i.kind == d.STEP_TIME_DRIFT]
    assert drift and drift[0].evidence["onset_step"] == 26


@pytest.mark.parametrize("factor", [0.7, 1.1])
def test_no_drift_for_a_speed_up_or_a_small_slow_down(tmp_path, monkeypatch, factor):
    def payload(rank, step):
        rng = random.Random(31 * rank + step)
        base = _base(fwd=30.0 * factor if step > 20 else 30.0)
        return {k: v * rng.uniform(0.95, 1.05) for k, v in base.items()}
    issues = _issues(tmp_path, f"no_drift_{factor}", payload, monkeypatch=monkeypatch)
    assert d.STEP_TIME_DRIFT not in [i.kind for i in issues]


def test_drift_on_the_job_names_no_rank_and_the_grown_phase(tmp_path, monkeypatch):
    def payload(rank, step):
        return _base(iw=35.0) if step >= 15 else _base()
    issues = _issues(tmp_path, "job_input_drift", payload, monkeypatch=monkeypatch)
    (drift,) = [i for i in issues if i.kind == d.STEP_TIME_DRIFT]
    assert drift.culprit_rank is None and drift.evidence["scope"] == "job"
    assert drift.evidence["onset_step"] == 15 and drift.evidence["grown_phase"] == "input_wait"
    assert drift.severity == d.SEVERITY_CRIT and drift.score == pytest.approx(0.30)
