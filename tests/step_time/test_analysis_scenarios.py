"""Window facts of the eleven contract scenarios, read from real SQLite through the pipeline.

Diagnosis outcomes are part B's (test_diagnosis*.py); this file pins what the
analyzer hands them: clock, aligned steps, rank universe, coverage, per-rank values,
null versus 0.0, and the statistics. Both data profiles must agree.
"""
from __future__ import annotations

import statistics

import pytest

from tests.step_time.scenarios import SCENARIO_SPECS, SCENARIOS
from traceml.processor.step_time.analysis import WINDOW_METRICS
from traceml.processor.step_time.pipeline import (
    PROFILE_LIVE,
    PROFILE_SUMMARY,
    StepTimePipeline,
    StepTimeRequest,
)

_PIPELINE = StepTimePipeline()


def _window(scenario_db, name, profile=PROFILE_SUMMARY):
    return _PIPELINE.run(StepTimeRequest(scenario_db(name), name, profile=profile)).window


def _avg(window, rank, metric):
    return window.rank_facts[rank].average.get(metric)


@pytest.mark.parametrize("profile", [PROFILE_LIVE, PROFILE_SUMMARY])
@pytest.mark.slow
def test_every_scenario_analyses_on_both_profiles_identically(scenario_db, scenario_name, profile):
    window = _window(scenario_db, scenario_name, profile)
    reference = _window(scenario_db, scenario_name, PROFILE_SUMMARY)
    spec = SCENARIO_SPECS[scenario_name]
    assert window.run_id == scenario_name
    assert window.expected_ranks == tuple(range(spec.ranks))
    assert window.training_strategy == spec.strategy
    assert window.steps == reference.steps and window.clock == reference.clock
    for rank in window.expected_ranks:
        assert window.rank_facts[rank].average == reference.rank_facts[rank].average
    assert set(window.metrics) == set(WINDOW_METRICS) == set(window.coverage) == set(window.shares)


def test_complete_gpu_selects_gpu_and_keeps_both_clock_aggregates(scenario_db):
    w = _window(scenario_db, "complete_gpu")
    assert w.clock == "gpu"
    assert w.steps == tuple(range(1, 101))
    assert _avg(w, 0, "step_time_cpu") == 200.0 and _avg(w, 0, "step_time_gpu") == 100.0
    assert _avg(w, 0, "traced_step_time_cpu") == 190.0 and _avg(w, 0, "traced_step_time_gpu") == 95.0
    assert _avg(w, 0, "dataloader_fetch_cpu") == 10.0  # CPU evidence, not the selected input wait
    assert _avg(w, 0, "input_wait") == 5.0
    assert _avg(w, 0, "compute") == 85.0 and _avg(w, 0, "residual") == 5.0
    assert _avg(w, 0, "step_time") == 100.0
    assert all(c == (2, 2) for m, c in w.coverage.items() if m != "collective_wait")
    assert w.coverage["collective_wait"] == (0, 2)  # never reported: unmeasured, not 0
    assert w.shares["input_wait"] == pytest.approx(0.05)
    assert w.shares["compute"] == pytest.approx(0.85)
    assert w.metrics["step_time"].series == (100.0,) * 100


def test_live_profile_keeps_only_the_latest_hundred_common_steps(tmp_path):
    from tests.step_time.scenarios import build_scenario

    db = build_scenario("complete_gpu", tmp_path / "c.db")
    live = _PIPELINE.run(StepTimeRequest(db, "complete_gpu", profile=PROFILE_LIVE, max_steps=10)).window
    assert live.steps == tuple(range(91, 101))


def test_sparse_missing_forward_leaves_that_rank_unavailable_not_zero(scenario_db):
    w = _window(scenario_db, "sparse_missing_forward")
    assert w.clock == "cpu"
    for metric in ("forward", "compute", "residual"):
        assert _avg(w, 1, metric) is None
        assert _avg(w, 0, metric) is not None
        assert w.coverage[metric] == (1, 2)
        assert 1 not in w.metrics[metric].rank_values
    assert _avg(w, 1, "backward") == 45.0
    assert w.metrics["forward"].median == 30.0
    assert w.metrics["forward"].worst is None and w.metrics["forward"].skew is None  # one measured rank
    assert w.metrics["forward"].representative_rank == 0


def test_measured_zero_forward_stays_measured_and_feeds_compute_and_residual(scenario_db):
    w = _window(scenario_db, "measured_zero_forward")
    assert w.step_count == 4
    assert _avg(w, 1, "forward") == 0.0
    assert _avg(w, 1, "compute") == 55.0 and _avg(w, 1, "residual") == 35.0
    residual = w.metrics["residual"]
    assert residual.median == 20.0 and residual.worst == 35.0 and residual.worst_rank == 1
    assert residual.skew == pytest.approx(0.75)
    assert residual.representative_rank == 0  # equidistant: the lower value wins
    assert w.shares["residual"] == pytest.approx(0.20)
    assert w.coverage["forward"] == (2, 2)


def test_single_rank_cpu_has_no_cross_rank_worst_or_skew_and_no_gpu_values(scenario_db):
    w = _window(scenario_db, "single_rank_cpu")
    assert w.clock == "cpu" and w.expected_ranks == (0,)
    for name in WINDOW_METRICS:
        metric = w.metrics[name]
        assert metric.worst is None and metric.worst_rank is None and metric.skew is None
    for name in ("step_time_gpu", "traced_step_time_gpu"):
        assert _avg(w, 0, name) is None and w.coverage[name] == (0, 1)
        assert w.metrics[name].median is None
    assert w.metrics["step_time"].representative_rank == 0
    assert w.metrics["step_time"].median == 100.0


def test_ddp_rank_straggler_window_facts(scenario_db):
    w = _window(scenario_db, "ddp_rank_straggler")
    assert w.step_count == 24 and w.training_strategy == "ddp"
    assert (_avg(w, 0, "input_wait"), _avg(w, 0, "backward"), _avg(w, 0, "traced_step_time")) == (100.0, 20.0, 40.0)
    assert (_avg(w, 1, "input_wait"), _avg(w, 1, "backward"), _avg(w, 1, "traced_step_time")) == (0.0, 120.0, 140.0)
    assert w.metrics["step_time"].median == 140.0
    assert w.shares["input_wait"] == pytest.approx(50.0 / 140.0)
    # No h2d/optimizer events were sent: h2d stays unavailable, compute needs the optimizer.
    assert _avg(w, 0, "h2d") is None and _avg(w, 0, "compute") is None
    assert w.metrics["backward"].worst_rank == 1


def test_fsdp_strategy_reaches_the_window(scenario_db):
    w = _window(scenario_db, "fsdp_rank_straggler")
    assert w.training_strategy == "fsdp"
    assert _avg(w, 1, "forward") + _avg(w, 1, "backward") == 160.0


def test_jittered_ddp_statistics_match_a_plain_python_reference(scenario_db):
    w = _window(scenario_db, "jittered_ddp")
    assert w.step_count == 40
    for name in ("backward", "step_time", "residual"):
        metric = w.metrics[name]
        values = {r: _avg(w, r, name) for r in (0, 1)}
        assert metric.median == pytest.approx(statistics.median(values.values()))
        assert metric.worst_rank == max(values, key=lambda r: (values[r], -r))
        per_step = [[s.values.get(name) for s in w.rank_facts[r].steps] for r in (0, 1)]
        assert metric.series == pytest.approx([statistics.median(col) for col in zip(*per_step)])
    assert w.metrics["backward"].worst_rank == 1
    assert 55.0 < _avg(w, 1, "backward") < 65.0


def test_rank_missing_steps_drops_those_steps_from_the_window(scenario_db):
    w = _window(scenario_db, "rank_missing_steps")
    assert w.steps == tuple(s for s in range(1, 31) if s not in (11, 12, 13, 14))
    assert len(w.rank_facts[0].steps) == len(w.rank_facts[1].steps) == 26
    assert [s.step for s in w.rank_facts[0].steps] == list(w.steps)


def test_intermittent_metrics_fill_absent_steps_with_zero_once_observed(scenario_db):
    w = _window(scenario_db, "intermittent_metrics")
    assert w.step_count == 40
    for rank in (0, 1):
        assert _avg(w, rank, "optimizer_step") == 2.5 and _avg(w, rank, "h2d") == 2.5
    assert _avg(w, 0, "residual") == 5.0 and _avg(w, 0, "compute") == 77.5
    for metric in ("forward", "compute", "residual"):
        assert _avg(w, 1, metric) is None
    steps = w.rank_facts[0].steps
    assert steps[0].values.h2d == 0.0 and steps[1].values.h2d == 5.0  # step 1 odd, step 2 even
    assert steps[16].values.forward == 30.0 and w.rank_facts[1].steps[16].values.forward is None


def test_h2d_bound_gpu_window(scenario_db):
    w = _window(scenario_db, "h2d_bound_gpu")
    assert w.clock == "gpu"
    assert w.shares["h2d"] == pytest.approx(0.20)


def test_forward_missing_everywhere_has_zero_coverage(scenario_db):
    w = _window(scenario_db, "forward_missing_everywhere")
    assert w.coverage["forward"] == (0, 2)
    assert w.metrics["forward"].median is None and w.shares["forward"] is None
    assert w.coverage["backward"] == (2, 2)


def test_several_runs_in_one_database_never_mix(tmp_path):
    from harness.stored_rows import stored_run_ids
    from tests.step_time.scenarios import scenario_records
    from traceml.processor.sqlite_writer import StepTimeStore

    db = tmp_path / "all.db"
    with StepTimeStore(db) as store:
        for name in SCENARIOS:
            store.write(scenario_records(name))
    assert stored_run_ids(db) == list(SCENARIOS)
    for name in ("complete_gpu", "ddp_rank_straggler", "single_rank_cpu"):
        alone = tmp_path / f"{name}.db"
        with StepTimeStore(alone) as store:
            store.write(scenario_records(name))
        for profile in (PROFILE_LIVE, PROFILE_SUMMARY):
            mixed = _PIPELINE.run(StepTimeRequest(db, name, profile=profile)).window
            single = _PIPELINE.run(StepTimeRequest(alone, name, profile=profile)).window
            assert mixed.steps == single.steps and mixed.expected_ranks == single.expected_ranks
            assert mixed.clock == single.clock
            assert {r: f.average for r, f in mixed.rank_facts.items()} == \
                   {r: f.average for r, f in single.rank_facts.items()}


def test_unknown_run_gives_the_canonical_empty_window(scenario_db):
    w = _window(scenario_db, "complete_gpu", PROFILE_LIVE)
    empty = _PIPELINE.run(StepTimeRequest(scenario_db("complete_gpu"), "no-such-run")).window
    assert w.step_count == 100
    assert empty.is_empty and empty.clock is None and empty.expected_ranks == ()
    assert all(m.median is None for m in empty.metrics.values())
