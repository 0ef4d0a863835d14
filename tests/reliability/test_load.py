"""256 simulated ranks against one processor for ~20 s: memory and lag stay bounded,
every step is stored, and the diagnosis names the one straggler rank.

The bounds are generous "stays bounded" limits, not performance claims (the
figures themselves come from checks/load.py), and the step durations are the senders'
own, not timed: so the test shares the machine with the suite's other tests. With both
cores kept busy by two spinning processes it passed three times out of three, the lag
under 1 s and no scrape naming another rank (2026-12-07).
"""
from __future__ import annotations

import pytest

from harness.reliability.load_scenario import run_load

RSS_BOUND_MIB = 500  # issue 5: under 500 MiB with 1,024 ranks
LAG_BOUND_S = 30.0  # "did not fall behind without bound" on a shared 2-core machine
STRAGGLER = 137


@pytest.mark.slow
def test_256_ranks_memory_and_lag_bounded_and_the_straggler_named(tmp_path):
    result = run_load(tmp_path, ranks=256, steps_per_s=2.0, duration_s=20.0, straggler=STRAGGLER)
    print("\n" + result.line() + "\n" + result.rss_trajectory())
    assert result.rows_stored == result.spans_sent  # every acknowledged step stored, nothing extra
    assert result.rss_max_mib < RSS_BOUND_MIB
    assert result.lag_samples and result.lag_max_s < LAG_BOUND_S
    assert result.culprit_found, result.diagnosis
    kinds = {kind for kind, culprit, _ in result.diagnosis if culprit == str(STRAGGLER)}
    assert "INPUT_STRAGGLER" in kinds, result.diagnosis
    assert {culprit for _, culprit, _ in result.diagnosis if culprit} == {str(STRAGGLER)}  # no false culprit
    assert result.false_culprit_samples == 0  # at no scrape during the run either
