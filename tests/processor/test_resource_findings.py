"""Resource figures and the findings that read them, on a real store: the contract scenarios'
step rows (written by the real writer) with resource rows beside them, through the real
summary pipeline (reader -> analysis -> diagnosis)."""
from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from traceml.processor.diagnosis.policy import DEFAULT_POLICY
from traceml.processor.diagnosis.resource_rules import creeping
from traceml.processor.resources import model as m
from traceml.processor.resources.analysis import fit_trend
from traceml.processor.sqlite_layout import RESOURCE_COLUMNS
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.model import RankIdentity, RawEventValue, StepTimeIngestRecord
from traceml.processor.step_time.pipeline import PROFILE_SUMMARY, StepTimePipeline, StepTimeRequest
from traceml.schema import diagnosis as d
from traceml.schema import resources as r
from traceml.schema import vocabulary as v

from tests.step_time.scenarios import START_TIME, STEP_SECONDS, build_scenario

MiB = 2**20
GiB = 2**30


def _rows(db, rows):
    """Resource rows as a processor stores them (the table is the contract between the two sides)."""
    conn = sqlite3.connect(db)
    with conn:
        conn.executemany(
            f"INSERT INTO resource_samples ({', '.join(RESOURCE_COLUMNS)}) VALUES ({', '.join('?' * len(RESOURCE_COLUMNS))})",
            [(run, rank, host, device, metric, t, value, source, pid, START_TIME + 3600.0)
             for run, rank, host, device, metric, t, value, source, pid in rows])
    conn.close()


def _step_time(step: int) -> float:
    return START_TIME + step * STEP_SECONDS + 0.09  # the scenario's step end


def _summary(db, run):
    return StepTimePipeline().run(StepTimeRequest(db, run, profile=PROFILE_SUMMARY))


def _kinds(analysis):
    return [i.kind for i in analysis.diagnosis.issues]


# --- the fit ------------------------------------------------------------------------------


def _series(fn, steps=range(1, 101), noise=2 * MiB, seed=3):
    rng = np.random.default_rng(seed)
    x = np.asarray(list(steps), dtype=float)
    return x, np.asarray([fn(s) for s in x]) + rng.normal(0.0, noise, x.size)


def _judge(trend):
    class _Ctx:  # only the policy is read by `creeping`
        policy = DEFAULT_POLICY
    return creeping(trend, _Ctx())


def test_a_leak_from_step_30_is_fitted_with_its_onset_and_slope():
    x, y = _series(lambda s: 1 * GiB + max(0.0, s - 30) * 4 * MiB)
    trend = fit_trend(0, m.TREND_RSS, x, y)
    assert abs(trend.onset_step - 30) <= 2
    assert trend.slope_bytes_per_step == pytest.approx(4 * MiB, rel=0.05)
    assert trend.growth_bytes == pytest.approx(70 * 4 * MiB, rel=0.08)
    assert trend.fit_r2 > 0.99 and _judge(trend)


@pytest.mark.parametrize("shape", ["flat", "warm-up plateau", "one jump", "falling"])
def test_what_is_not_creep(shape):
    fn = {
        "flat": lambda s: 1 * GiB,
        "warm-up plateau": lambda s: 1 * GiB + min(s, 15) * 20 * MiB,  # grows then stays
        "one jump": lambda s: 1 * GiB + (300 * MiB if s >= 50 else 0.0),  # one big allocation
        "falling": lambda s: 2 * GiB - s * 4 * MiB,
    }[shape]
    trend = fit_trend(0, m.TREND_RSS, *_series(fn))
    assert trend is None or not _judge(trend), trend


def test_too_few_points_give_no_trend():
    assert fit_trend(0, m.TREND_RSS, np.arange(5.0), np.arange(5.0) * MiB) is None


# --- the store, the joins, the findings ---------------------------------------------------


def _rss_rows(run, rank, fn, host="node0", every=2, source=r.SOURCE_TRACEML, pid=100):
    return [(run, rank, host, "", r.PROCESS_MEMORY_USAGE, _step_time(s) - 0.01, fn(s), source, pid)
            for s in range(1, 101, every)]


def test_a_rank_leaking_host_memory_gets_memory_creep_with_its_onset(tmp_path):
    db = build_scenario("complete_gpu", tmp_path / "s.db")
    run = "complete_gpu"
    _rows(db, _rss_rows(run, 0, lambda s: 800 * MiB)
          + _rss_rows(run, 1, lambda s: 800 * MiB + max(0, s - 40) * 6 * MiB))
    analysis = _summary(db, run)
    assert analysis.resources is not None and analysis.resources.ranks[1].figures[m.RSS_BYTES] > 1.1 * GiB
    creep = next(i for i in analysis.diagnosis.issues if i.kind == d.MEMORY_CREEP)
    assert creep.culprit_rank == 1 and creep.component == m.TREND_RSS
    assert abs(creep.evidence["onset_step"] - 40) <= 3
    assert creep.evidence["slope_bytes_per_step"] == pytest.approx(6 * MiB, rel=0.1)
    assert creep.evidence["ranks_rising"] == [1]
    assert creep.severity == d.SEVERITY_WARN  # +45 %, 360 MiB: below the 50 % and 1 GiB of crit
    assert "from step" in creep.summary and "rank 1" in creep.summary


def test_per_step_peak_allocated_is_preferred_to_rss_and_every_rank_rising_names_no_rank(tmp_path):
    db = build_scenario("complete_gpu", tmp_path / "s.db")
    run = "complete_gpu"
    conn = sqlite3.connect(db)
    with conn:
        conn.executemany(
            "INSERT INTO step_memory_samples (run_id, global_rank, step, device, peak_allocated_bytes,"
            " peak_reserved_bytes, sample_time, receive_time) VALUES (?, ?, ?, 'cuda:0', ?, NULL, ?, ?)",
            [(run, rank, s, int(2 * GiB + max(0, s - 20) * 40 * MiB), _step_time(s), START_TIME)
             for rank in (0, 1) for s in range(1, 101)])
    conn.close()
    _rows(db, _rss_rows(run, 0, lambda s: 900 * MiB) + _rss_rows(run, 1, lambda s: 900 * MiB))
    creep = next(i for i in _summary(db, run).diagnosis.issues if i.kind == d.MEMORY_CREEP)
    assert creep.component == m.TREND_PEAK_ALLOCATED and creep.culprit_rank is None
    assert creep.evidence["ranks_rising"] == [0, 1]
    assert creep.severity == d.SEVERITY_CRIT  # +156 %, 3.1 GiB over 100 steps


def test_steady_memory_and_no_resource_rows_say_nothing(tmp_path):
    db = build_scenario("complete_gpu", tmp_path / "s.db")
    run = "complete_gpu"
    assert _kinds(_summary(db, run)) == [d.BALANCED]
    rng = np.random.default_rng(1)
    _rows(db, _rss_rows(run, 0, lambda s: 800 * MiB + rng.normal(0, 3 * MiB))
          + _rss_rows(run, 1, lambda s: 820 * MiB + rng.normal(0, 3 * MiB)))
    assert _kinds(_summary(db, run)) == [d.BALANCED]


def _gpu_rows(run, rank, util, device, host="node0", source=r.SOURCE_TRACEML):
    rows = []
    for s in range(1, 101, 5):
        t = _step_time(s)
        rows += [(run, rank, host, device, r.GPU_UTILIZATION, t, util, source, None),
                 (run, rank, host, device, r.GPU_MEMORY_USAGE, t, 30 * GiB, source, None),
                 (run, rank, host, device, r.HW_TEMPERATURE, t, 61.0 + s / 100, source, None)]
    return rows


def test_an_idle_gpu_that_no_phase_explains_is_reported_and_an_h2d_bound_one_is_not(tmp_path):
    db = build_scenario("complete_gpu", tmp_path / "a.db")
    _rows(db, _gpu_rows("complete_gpu", 0, 0.25, "GPU-a") + _gpu_rows("complete_gpu", 1, 0.35, "GPU-b"))
    analysis = _summary(db, "complete_gpu")
    idle = analysis.diagnosis.primary
    assert idle.kind == d.LOW_GPU_UTILIZATION and idle.severity == d.SEVERITY_WARN
    assert idle.evidence["gpu_utilization"] == pytest.approx(0.30)
    assert idle.evidence["worst_rank"] == 0 and idle.evidence["worst_gpu_utilization"] == pytest.approx(0.25)
    stat = analysis.resources.rank_figure(m.GPU_UTILIZATION)
    assert stat.worst_member == 0 and analysis.resources.ranks[1].device == "GPU-b"
    assert analysis.resources.ranks[0].figures[m.GPU_TEMPERATURE_C] == pytest.approx(61.96)

    db2 = build_scenario("h2d_bound_gpu", tmp_path / "b.db")
    _rows(db2, _gpu_rows("h2d_bound_gpu", 0, 0.2, "GPU-a") + _gpu_rows("h2d_bound_gpu", 1, 0.2, "GPU-b"))
    kinds = _kinds(_summary(db2, "h2d_bound_gpu"))
    assert d.H2D_BOUND in kinds and d.LOW_GPU_UTILIZATION not in kinds


def test_no_gpu_figure_means_no_gpu_finding(tmp_path):
    db = build_scenario("complete_gpu", tmp_path / "a.db")
    _rows(db, _rss_rows("complete_gpu", 0, lambda s: 800 * MiB))
    analysis = _summary(db, "complete_gpu")
    assert analysis.resources.ranks[0].figures[m.GPU_UTILIZATION] is None
    assert m.GPU_UTILIZATION not in analysis.resources.rank_stats
    assert _kinds(analysis) == [d.BALANCED]


def _host_cpu_rows(run, busy, host="node0", rank=0, source=r.SOURCE_TRACEML, cpus=2):
    rows = []
    for s in range(1, 25, 2):
        t = _step_time(s)
        rows += [(run, rank, host, "", r.SYSTEM_CPU_UTILIZATION, t, busy, source, None),
                 (run, rank, host, "", r.SYSTEM_CPU_LOGICAL_COUNT, t, cpus, source, None)]
    return rows


def _input_bound_run(path, run="input_bound"):
    """Two ranks alike, 40 of every 135 ms waiting on input, 24 steps (the scenarios' clock and host)."""
    records = []
    for step in range(1, 25):
        for rank in (0, 1):
            start = START_TIME + step * STEP_SECONDS
            events = {v.RAW_DATALOADER_NEXT: RawEventValue(40.0, None, 1), v.RAW_FORWARD: RawEventValue(30.0, None, 1),
                      v.RAW_BACKWARD: RawEventValue(45.0, None, 1), v.RAW_OPTIMIZER_STEP: RawEventValue(10.0, None, 1),
                      v.RAW_STEP_TIME: RawEventValue(95.0, None, 1)}
            records.append(StepTimeIngestRecord(
                run_id=run, identity=RankIdentity(rank, local_rank=rank, node_rank=0, world_size=2,
                                                  local_world_size=2, hostname="node0"),
                step=step, start_time=start, sample_time=start + STEP_SECONDS * 0.9, events=events,
                training_strategy="ddp"))
    with StepTimeStore(path) as store:
        store.write(records, receive_time=START_TIME + 3600.0)
    return path


@pytest.mark.parametrize("busy, state", [(0.97, d.HOST_CPU_SATURATED), (0.30, d.HOST_CPU_SPARE)])
@pytest.mark.parametrize("run", ["ddp_rank_straggler", "input_bound"])
def test_input_findings_say_whether_the_host_cpus_had_room(tmp_path, busy, state, run):
    db = (build_scenario(run, tmp_path / "s.db") if run == "ddp_rank_straggler"
          else _input_bound_run(tmp_path / "s.db"))
    _rows(db, _host_cpu_rows(run, busy))
    issues = {i.kind: i for i in _summary(db, run).diagnosis.issues}
    for kind in ((d.INPUT_STRAGGLER,) if run == "ddp_rank_straggler" else (d.INPUT_BOUND,)):
        host_cpu = issues[kind].evidence["host_cpu"]
        assert host_cpu["state"] == state and host_cpu["utilization"] == pytest.approx(busy)
        assert host_cpu["host"] == "node0"
        if state == d.HOST_CPU_SATURATED:
            assert "will not help" in issues[kind].summary
        else:
            assert host_cpu["idle_cpus"] == pytest.approx(1.4) and "can help" in issues[kind].summary


def _process_cpu_rows(run, rank, busy, host="node0"):
    return [(run, rank, host, "", r.PROCESS_CPU_UTILIZATION, _step_time(s), busy, r.SOURCE_TRACEML, None)
            for s in range(1, 25, 2)]


@pytest.mark.parametrize("rank_cpu, state", [(0.45, d.HOST_CPU_RANKS_BUSY), (0.05, d.HOST_CPU_SATURATED)])
def test_a_host_busy_with_the_ranks_own_processes_gives_no_worker_advice(tmp_path, rank_cpu, state):
    # Issue 30 item 4: a host 97 % busy, 90 % of it the two ranks themselves (a rank waiting in a
    # gloo collective spins on its CPU), says nothing about whether loader workers lack CPU; when
    # the ranks take 10 %, the rest of the host is busy with other work and workers will not help.
    run = "ddp_rank_straggler"
    db = build_scenario(run, tmp_path / "s.db")
    _rows(db, _host_cpu_rows(run, 0.97) + _process_cpu_rows(run, 0, rank_cpu) + _process_cpu_rows(run, 1, rank_cpu))
    issue = {i.kind: i for i in _summary(db, run).diagnosis.issues}[d.INPUT_STRAGGLER]
    host_cpu = issue.evidence["host_cpu"]
    assert host_cpu["state"] == state
    assert host_cpu["ranks_cpu"] == pytest.approx(2 * rank_cpu)
    assert host_cpu["other_cpu"] == pytest.approx(0.97 - 2 * rank_cpu)
    if state == d.HOST_CPU_RANKS_BUSY:
        assert "will not help" not in issue.summary and "can help" not in issue.summary
        assert "the training ranks' own processes" in issue.summary
    else:
        assert "will not help" in issue.summary


def test_an_input_finding_without_host_figures_gives_no_advice(tmp_path):
    run = "input_bound"
    db = _input_bound_run(tmp_path / "s.db")
    issues = {i.kind: i for i in _summary(db, run).diagnosis.issues}
    assert "host_cpu" not in issues[d.INPUT_BOUND].evidence and "DataLoader" not in issues[d.INPUT_BOUND].summary


def test_foreign_senders_join_by_host_device_and_pid(tmp_path):
    run = "complete_gpu"
    db = build_scenario(run, tmp_path / "s.db")
    rows = []
    for s in range(1, 101, 10):
        t = _step_time(s)
        rows += [
            # rank 0 named its GPU (its own NVML): DCGM's row for that UUID joins it, but not where
            # its own NVML measured the same metric.
            (run, 0, "node0", "GPU-a", r.GPU_UTILIZATION, t, 0.95, r.SOURCE_TRACEML, 100),
            (None, None, "node0", "GPU-a", r.GPU_UTILIZATION, t, 0.10, r.SOURCE_DCGM, None),
            (None, None, "node0", "GPU-a", r.HW_POWER, t, 300.0, r.SOURCE_DCGM, None),
            # rank 1 has no NVML: DCGM's `gpu` index joins it by local rank.
            (None, None, "node0", "index:1", r.GPU_UTILIZATION, t, 0.90, r.SOURCE_DCGM, None),
            # hostmetrics on the run's host (cpu.time: the default), and on another host.
            (None, None, "node0", "", r.SYSTEM_CPU_TIME_BUSY, t, 10.0 + s * 0.15, r.SOURCE_HOSTMETRICS, None),
            (None, None, "node0", "", r.SYSTEM_CPU_TIME_TOTAL, t, 40.0 + s * 0.2, r.SOURCE_HOSTMETRICS, None),
            (None, None, "elsewhere", "", r.SYSTEM_CPU_UTILIZATION, t, 0.99, r.SOURCE_HOSTMETRICS, None),
            # hostmetrics' process scraper: rank 1's pid; an unrelated pid.
            (run, 1, "node0", "", r.CUDA_MEMORY_ALLOCATED, t, 5 * GiB, r.SOURCE_TRACEML, 101),
            (None, None, "node0", "", r.PROCESS_MEMORY_USAGE, t, 3 * GiB, r.SOURCE_HOSTMETRICS, 101),
            (None, None, "node0", "", r.PROCESS_MEMORY_USAGE, t, 9 * GiB, r.SOURCE_HOSTMETRICS, 999),
        ]
    _rows(db, rows)
    res = _summary(db, run).resources
    assert res.ranks[0].figures[m.GPU_UTILIZATION] == pytest.approx(0.95)
    assert res.ranks[0].figures[m.GPU_POWER_W] == pytest.approx(300.0)
    assert res.ranks[1].figures[m.GPU_UTILIZATION] == pytest.approx(0.90)
    assert res.ranks[1].figures[m.RSS_BYTES] == 3 * GiB and res.ranks[0].figures[m.RSS_BYTES] is None
    assert set(res.nodes) == {"node0"}
    assert res.nodes["node0"].figures[m.HOST_CPU_UTILIZATION] == pytest.approx(0.75)
    assert res.nodes["node0"].sources == (r.SOURCE_HOSTMETRICS,)


def test_host_figures_of_the_runs_own_rank_win_over_a_foreign_copy(tmp_path):
    run = "complete_gpu"
    db = build_scenario(run, tmp_path / "s.db")
    _rows(db, _host_cpu_rows(run, 0.4) + _host_cpu_rows(None, 0.9, rank=None, source=r.SOURCE_HOSTMETRICS))
    res = _summary(db, run).resources
    assert res.nodes["node0"].figures[m.HOST_CPU_UTILIZATION] == pytest.approx(0.4)
    assert res.nodes["node0"].figures[m.HOST_CPU_COUNT] == 2


def test_samples_outside_the_window_are_left_out(tmp_path):
    run = "complete_gpu"
    db = build_scenario(run, tmp_path / "s.db")
    late = _step_time(100) + 60.0
    _rows(db, [(run, 0, "node0", "", r.PROCESS_CPU_UTILIZATION, _step_time(50), 0.5, r.SOURCE_TRACEML, 1),
               (run, 0, "node0", "", r.PROCESS_CPU_UTILIZATION, late, 1.0, r.SOURCE_TRACEML, 1)])
    res = _summary(db, run).resources
    assert res.ranks[0].figures[m.CPU_UTILIZATION] == pytest.approx(0.5)
    assert res.start_time < _step_time(1) and res.end_time == pytest.approx(_step_time(100))


def test_the_live_session_rereads_resources_only_after_its_refresh_interval(tmp_path):
    from traceml.processor.step_time.pipeline import LiveStepTimeSession

    run = "complete_gpu"
    db = build_scenario(run, tmp_path / "s.db")
    _rows(db, _gpu_rows(run, 0, 0.9, "GPU-a"))
    now = [100.0]
    session = LiveStepTimeSession(db, run, clock=lambda: now[0])
    first = session.refresh().analysis
    assert first.resources.ranks[0].figures[m.GPU_UTILIZATION] == pytest.approx(0.9)
    _rows(db, [(run, 0, "node0", "GPU-a", r.GPU_UTILIZATION, _step_time(100), 0.1, r.SOURCE_TRACEML, None)])
    with StepTimeStore(db) as store:  # a new step: the session analyses again
        store.write([_record(run, step=101)], receive_time=START_TIME + 3700.0)
    now[0] += 1.0
    second = session.refresh().analysis
    assert second is not first and second.resources is first.resources  # within 5 s: reused
    with StepTimeStore(db) as store:
        store.write([_record(run, step=102)], receive_time=START_TIME + 3701.0)
    now[0] += session.resource_refresh_s
    third = session.refresh().analysis
    assert third.resources is not first.resources
    assert third.resources.ranks[0].figures[m.GPU_UTILIZATION] < 0.9  # the newer sample counted


def _record(run, step, rank=0):
    start = START_TIME + step * STEP_SECONDS
    events = {raw: RawEventValue(value * 2, value, 1) for raw, value in
              ((v.RAW_DATALOADER_NEXT, 5.0), (v.RAW_H2D, 5.0), (v.RAW_FORWARD, 30.0), (v.RAW_BACKWARD, 45.0),
               (v.RAW_OPTIMIZER_STEP, 10.0), (v.RAW_STEP_TIME, 95.0))}
    return StepTimeIngestRecord(run_id=run, identity=RankIdentity(rank, local_rank=rank, node_rank=0, world_size=2,
                                                                  local_world_size=2, hostname="node0"),
                                step=step, start_time=start, sample_time=start + STEP_SECONDS * 0.9,
                                events=events, training_strategy="ddp")
