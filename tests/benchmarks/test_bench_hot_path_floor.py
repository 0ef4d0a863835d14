"""bench_hot_path_floor: its two reference implementations record what they claim to, and it
reports its figures (a tiny configuration; the figures are not judged on a shared machine)."""
from __future__ import annotations

import json
import subprocess
import threading

import pytest

from tests.harness.child_python import ROOT, child_env, module_command

torch = pytest.importorskip("torch")

from benchmarks import bench_hot_path_floor as floor  # noqa: E402
from traceml.schema import vocabulary as v  # noqa: E402


def _one_step(api) -> None:
    assert next(iter(api.wrap_dataloader([1, 2]))) == 1
    with api.trace_step(None):
        for attr, _ in floor.REGIONS:
            with getattr(api, attr)():
                pass


def test_the_bare_floor_times_every_region_and_publishes_each_step():
    api = floor.bare_api()
    _one_step(api)
    _one_step(api)
    (published,) = api._time_sampler._queues
    assert len(published) == 2
    for events in published:
        assert [e[0] for e in events] == [v.RAW_DATALOADER_NEXT, *[r for _, r in floor.REGIONS], v.RAW_STEP_TIME]
        assert all(t0 <= t1 for _, t0, t1 in events)
    api._time_sampler.run_once()
    assert not published


def test_the_contract_core_numbers_steps_bounds_its_queues_and_ignores_other_threads():
    api = floor.core_api()
    timing, memory = api._time_sampler._queues
    _one_step(api)

    def elsewhere():
        with api.timed_forward():
            pass
    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    _one_step(api)
    assert [step for step, _ in timing.items] == [0, 1] and [item[0] for item in memory.items] == [0, 1]
    first, second = (events for _, events in timing.items)
    assert [e[0] for e in first] == [v.RAW_DATALOADER_NEXT, *[r for _, r in floor.REGIONS], v.RAW_STEP_TIME]
    assert len(second) == len(first)  # the other thread's region went nowhere
    region = api.timed_h2d()
    with region:
        pass
    with region:  # entered again: state says closed, nothing recorded twice
        pass
    for _ in range(floor.QUEUE_CAPACITY):
        _one_step(api)
    assert len(timing.items) == floor.QUEUE_CAPACITY and timing.dropped == 2 and memory.dropped == 2


@pytest.mark.slow
def test_bench_hot_path_floor_prints_its_figures_as_json():
    out = subprocess.run(module_command("benchmarks.bench_hot_path_floor", "--rounds", "3", "--json"),
                         cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    document = json.loads(out.stdout)
    assert document["benchmark"] == "bench_hot_path_floor" and document["config"]["rounds"] == 3
    figures = document["figures"]
    for name in floor.IMPLEMENTATIONS:
        assert figures[f"{name}_plain_step_us"] > 0
        assert set(figures[f"{name}_glue_parts_us"]) == set(floor.GLUE_PARTS)
        assert 0.5 < figures[f"{name}_implied_ratio"] < 2.0
    assert figures["traceml_sampler_us"] > 0 and figures["bare_sampler_us"] == 0
