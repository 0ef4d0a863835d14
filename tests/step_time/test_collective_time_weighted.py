"""COLLECTIVE_BOUND on runs whose steps are not alike: the score must not hinge on which side of
the threshold the median step happens to fall (checks/peers_agreement.py found a two-phase run
scoring 0.07-0.17 from run to run by the median, 0.085-0.098 by time)."""
from __future__ import annotations

import pytest

from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.model import RankIdentity, RawEventValue, StepTimeIngestRecord
from traceml.processor.step_time.pipeline import PROFILE_SUMMARY, StepTimePipeline, StepTimeRequest
from traceml.schema import diagnosis as d
from traceml.schema import vocabulary as v

START = 1_700_000_000.0


def _run(path, phases):
    """Two ranks alike; `phases` = [(steps, traced ms, collective wait ms inside backward)]."""
    records, step, t = [], 1, START
    for count, traced, wait in phases:
        for _ in range(count):
            for rank in (0, 1):
                events = {v.RAW_DATALOADER_NEXT: RawEventValue(1.0, None, 1),
                          v.RAW_FORWARD: RawEventValue(traced * 0.3, None, 1),
                          v.RAW_BACKWARD: RawEventValue(traced * 0.6, None, 1),
                          v.RAW_OPTIMIZER_STEP: RawEventValue(traced * 0.05, None, 1),
                          v.RAW_STEP_TIME: RawEventValue(traced, None, 1),
                          v.RAW_COLLECTIVE_WAIT: RawEventValue(wait + 0.1 * rank, None, 1)}
                records.append(StepTimeIngestRecord(
                    run_id="r", identity=RankIdentity(rank, local_rank=rank, node_rank=0, world_size=2,
                                                      local_world_size=2, hostname="n"),
                    step=step, start_time=t, sample_time=t + traced / 1e3, events=events, training_strategy="ddp"))
            t += traced / 1e3 + 0.001
            step += 1
    with StepTimeStore(path) as store:
        store.write(records, receive_time=START)
    return StepTimePipeline().run(StepTimeRequest(path, "r", profile=PROFILE_SUMMARY)).diagnosis


def _collective(diagnosis):
    return [i for i in diagnosis.issues if i.kind == d.COLLECTIVE_BOUND]


def test_most_steps_short_and_waiting_but_most_time_long_and_not_is_not_collective_bound(tmp_path):
    # 31 steps of 49 ms waiting 10 (0.20 by the median step) and 29 of 199 ms waiting 4: 6 % of the
    # run's time was spent in collectives.
    diagnosis = _run(tmp_path / "a.db", [(31, 49.0, 10.0), (29, 199.0, 4.0)])
    assert not _collective(diagnosis), diagnosis.issues


def test_a_run_waiting_alike_in_every_step_is_scored_the_same_both_ways(tmp_path):
    [issue] = _collective(_run(tmp_path / "b.db", [(40, 99.0, 30.0)]))
    assert issue.evidence["median_least_share"] == pytest.approx(0.30, abs=1e-9)
    assert issue.evidence["time_weighted_least_share"] == pytest.approx(0.30, abs=1e-9)
    assert issue.score == pytest.approx(0.30, abs=1e-9) and issue.severity == d.SEVERITY_CRIT
