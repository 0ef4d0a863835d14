"""Property tests: random rank/step/missing patterns never crash the analyzer, and its
window matches a plain-Python reference written straight from the contract's sentences.
The same random data written through SQLite (grid path) gives the same window."""
from __future__ import annotations

import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.analysis import WINDOW_METRICS, analyze_snapshot
from traceml.processor.step_time.model import (
    ClockPair,
    RankIdentity,
    RawEventValue,
    StepTimeIngestRecord,
    StepTimeRepositorySnapshot,
    StepTimeSourceCursor,
    StepTimeSourceRow,
)
from traceml.processor.step_time.sqlite_reader import load_summary_snapshot
from traceml.schema.vocabulary import (
    CANONICAL_METRICS,
    OCCURRENCE_METRICS,
    RAW_EVENT_TO_METRIC,
)

METRIC_TO_RAW = {metric: raw for raw, metric in RAW_EVENT_TO_METRIC.items()}
VALUES = st.sampled_from([0.0, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 45.0, 95.0, 120.0])


@st.composite
def pairs(draw):
    cpu = draw(st.one_of(st.none(), VALUES))
    gpu = draw(st.one_of(st.none(), VALUES)) if draw(st.booleans()) else (None if cpu is None else cpu / 2)
    return ClockPair(cpu, gpu)


@st.composite
def source_rows(draw):
    ranks = draw(st.integers(1, 4))
    steps = draw(st.integers(1, 10))
    all_gpu = draw(st.booleans())
    rows, row_id = [], 0
    for step in range(steps):
        for rank in range(ranks):
            if not draw(st.booleans()) and draw(st.booleans()):
                continue  # about a quarter of the rows never arrive
            values = {}
            for metric in CANONICAL_METRICS:
                if draw(st.integers(0, 9)) == 0:
                    continue  # this event is absent on this row
                pair = draw(pairs())
                if all_gpu and pair.cpu_ms is not None:
                    pair = ClockPair(pair.cpu_ms, pair.cpu_ms / 2)
                if pair.cpu_ms is not None or pair.gpu_ms is not None:
                    values[metric] = pair
            row_id += 1
            rows.append(StepTimeSourceRow(row_id, rank, step, 1.0 + step, values))
    extra_ranks = draw(st.integers(0, 2))  # universe members that never sent a row
    return rows, ranks + extra_ranks, draw(st.integers(1, 12))


def _snapshot(rows, universe):
    return StepTimeRepositorySnapshot(
        run_id="p", training_strategy="ddp", ranks={r: RankIdentity(r) for r in range(universe)},
        cursor=StepTimeSourceCursor(len(rows), None), rows=rows)


def _mean(xs):
    return sum(xs) / len(xs)


def reference(rows, universe, max_steps):
    """The contract's window rules, written plainly (no numpy)."""
    by_rank = defaultdict(dict)
    for row in sorted(rows, key=lambda r: r.row_id):
        by_rank[row.global_rank][row.step] = row.values
    participating = sorted(by_rank)
    common = set.intersection(*(set(by_rank[r]) for r in participating)) if participating else set()
    steps = sorted(common)[-max_steps:]
    if not steps:
        return None
    present = [p for r in participating for s in steps for p in by_rank[r][s].values()]
    gpu = all(p.gpu_ms is not None for p in present) and any(p.gpu_ms is not None for p in present)

    def series(rank, metric, clock):
        out = []
        for s in steps:
            pair = by_rank[rank][s].get(metric)
            out.append(None if pair is None else (pair.gpu_ms if clock == "gpu" else pair.cpu_ms))
        return out

    def add(*xs):
        return None if any(x is None for x in xs) else sum(xs)

    facts = {}
    for rank in participating:
        sel = "gpu" if gpu else "cpu"
        per = {m: series(rank, m, sel) for m in CANONICAL_METRICS}
        for m in OCCURRENCE_METRICS:
            if any(x is not None for x in per[m]):
                per[m] = [0.0 if x is None else x for x in per[m]]
        h2d0 = [0.0 if x is None else x for x in per["h2d"]]
        wait0 = [0.0 if x is None else x for x in per["collective_wait"]]  # measured: not residual
        fwd, bwd, opt, tr, iw = (per[m] for m in ("forward", "backward", "optimizer_step",
                                                  "traced_step_time", "input_wait"))
        per["compute"] = [add(f, b, o) for f, b, o in zip(fwd, bwd, opt)]
        per["residual"] = [None if add(t, f, b, o) is None else max(0.0, t - h - f - b - o - w)
                           for t, h, f, b, o, w in zip(tr, h2d0, fwd, bwd, opt, wait0)]
        per["step_time"] = [add(i, t) for i, t in zip(iw, tr)]
        for clock in ("cpu", "gpu"):
            iwc, trc = series(rank, "input_wait", clock), series(rank, "traced_step_time", clock)
            per[f"step_time_{clock}"] = [add(i, t) for i, t in zip(iwc, trc)]
            per[f"traced_step_time_{clock}"] = trc
        per["dataloader_fetch_cpu"] = series(rank, "input_wait", "cpu")
        facts[rank] = {m: (None if any(x is None for x in xs) else _mean(xs)) for m, xs in per.items()}
        facts[rank]["_per_step"] = per
    return {"steps": tuple(steps), "clock": "gpu" if gpu else "cpu", "facts": facts}


def _close(a, b):
    return (a is None and b is None) or (a is not None and b is not None and a == pytest.approx(b))


def check_against_reference(window, rows, universe, max_steps):
    ref = reference(rows, universe, max_steps)
    assert window.expected_ranks == tuple(range(universe))
    assert set(window.rank_facts) == set(range(universe))
    if ref is None:
        assert window.is_empty and window.clock is None
        assert all(m.median is None for m in window.metrics.values())
        return
    assert window.steps == ref["steps"] and window.clock == ref["clock"]
    for name in WINDOW_METRICS:
        measured = {r: f[name] for r, f in ref["facts"].items() if f[name] is not None}
        metric = window.metrics[name]
        assert window.coverage[name] == (len(measured), universe)
        for rank in range(universe):
            got = window.rank_facts[rank].average.get(name)
            assert _close(got, measured.get(rank)), (name, rank, got, measured.get(rank))
        if not measured:
            assert metric.median is None and metric.representative_rank is None
            continue
        median = statistics.median(measured.values())
        assert metric.median == pytest.approx(median)
        assert metric.average == pytest.approx(_mean(list(measured.values())))
        if len(measured) >= 2:
            top = max(measured.values())
            worst_ranks = [r for r, x in measured.items() if x == pytest.approx(top)]
            assert metric.worst_rank in worst_ranks and metric.worst == pytest.approx(top)
            assert metric.worst == pytest.approx(metric.rank_values[metric.worst_rank])
        else:
            assert metric.worst is None and metric.worst_rank is None and metric.skew is None
        best = min(abs(x - median) for x in measured.values())
        near = [r for r, x in measured.items() if abs(x - median) <= best + 1e-9 * max(1.0, abs(median))]
        expected_rep = min(near, key=lambda r: (measured[r], r))
        assert metric.representative_rank == expected_rep
        per_step = [ref["facts"][r]["_per_step"][name] for r in measured]
        expected_series = [statistics.median(col) for col in zip(*per_step)]
        assert list(metric.series) == pytest.approx(expected_series)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source_rows())
@pytest.mark.slow
def test_random_patterns_match_the_plain_python_reference(case):
    rows, universe, max_steps = case
    window = analyze_snapshot(_snapshot(rows, universe), max_steps)
    check_against_reference(window, rows, universe, max_steps)


@pytest.mark.slow  # among the fast loop's slowest (see the marker in pyproject.toml)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source_rows())
def test_the_sqlite_grid_path_gives_the_same_window_as_typed_rows(case):
    rows, universe, max_steps = case
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "p.db"
        records = [StepTimeIngestRecord(
            "p", RankIdentity(row.global_rank), row.step, row.sample_time - 0.5, row.sample_time,
            {METRIC_TO_RAW[m]: RawEventValue(pair.cpu_ms, pair.gpu_ms, 1) for m, pair in row.values.items()},
            "ddp") for row in rows]
        with StepTimeStore(db) as store:
            store.write(records)
            for rank in range(universe):
                store.mark_rank_finished("p", rank, {})
        snapshot = load_summary_snapshot(db, "p", max_steps=max_steps)
    window = analyze_snapshot(snapshot, max_steps)
    # The selection is bounded to the latest max_steps x lookback (4) step ids.
    latest = max((r.step for r in rows), default=0)
    selected = [r for r in rows if r.step > latest - 4 * max_steps]
    check_against_reference(window, selected, universe, max_steps)
    # The grid's lazy row view carries the same facts as the rows written.
    assert [(r.global_rank, r.step, dict(r.values)) for r in snapshot.rows] == \
           [(r.global_rank, r.step, dict(r.values))
            for r in sorted(selected, key=lambda r: (r.step, r.global_rank))]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), VALUES), min_size=1, max_size=12, unique_by=lambda t: t[0]))
def test_representative_rank_is_a_real_rank_nearest_the_median(rank_values):
    rows = [StepTimeSourceRow(i + 1, rank, 0, None, {m: ClockPair(value, None) for m in CANONICAL_METRICS})
            for i, (rank, value) in enumerate(rank_values)]
    window = analyze_snapshot(_snapshot(rows, 7), 10)
    metric = window.metrics["forward"]
    values = dict(rank_values)
    median = statistics.median(values.values())
    assert metric.representative_rank in values
    best = min(abs(x - median) for x in values.values())
    assert abs(values[metric.representative_rank] - median) == pytest.approx(best)
    assert metric.representative_value == values[metric.representative_rank]
