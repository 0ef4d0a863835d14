"""Common-window Step Time analysis: repository snapshot -> `StepTimeWindow`.

Depends only on the model, the schema vocabulary and numpy. Everything is done on
(steps x ranks) arrays; Python objects are built only for what the window exposes
(per-rank averages, statistics), and per-step facts are built on access.

The rules (step-time-pipeline-contract.md, "Canonical window invariants"):

- Participating ranks are the ranks with at least one row in the selection; the
  common window is the latest `max_steps` step ids that every participating rank
  reported. `expected_ranks` is the whole persisted rank universe.
- One clock for the window: GPU when every value present on the aligned rows has
  its GPU twin (so the required metrics are all on the GPU clock and no phase mixes
  clocks); otherwise CPU.
- Required metrics (input_wait, forward, backward, traced_step_time) must be present
  on every aligned step of a rank, else that rank's value is unavailable (None).
- Occurrence-driven metrics (h2d, optimizer_step): once a rank shows one on any
  aligned step, its absent steps count 0.0. A rank that never shows H2D has no
  observed transfers: its h2d value stays unavailable (None, not 0.0) and it
  contributes 0 to the residual. A rank that never shows optimizer_step has no
  compute or residual (both need every compute phase).
- compute = forward + backward + optimizer_step; residual = max(0, traced - h2d -
  forward - backward - optimizer_step - collective_wait) per step (an absent collective
  wait counts 0; the measured wait first fills the time no phase explains, the rest lies
  inside the phases, e.g. DDP's backward); step_time = input_wait + traced.
- collective_wait is occurrence-driven like h2d: a rank that never reported it has no
  value (None), never 0.
  Explicit-clock aggregates keep both clocks; dataloader_fetch_cpu is input_wait
  on the CPU clock (supplemental, never added to the selected clock).
- Statistics use only the ranks that measured the metric; worst/worst_rank/skew
  need two measured ranks; the representative rank is the real rank nearest the
  median, then the lower value, then the lower rank id.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Mapping, Sequence

import numpy as np

from traceml.processor.step_time.model import (
    CLOCK_CPU,
    CLOCK_GPU,
    RankIdentity,
    StepTimeMetric,
    StepTimeRankFacts,
    StepTimeRepositorySnapshot,
    StepTimeSourceGrid,
    StepTimeStepFacts,
    StepTimeValues,
    StepTimeWindow,
    finite_ratio,
)
from traceml.schema.vocabulary import (
    CANONICAL_METRICS,
    METRIC_BACKWARD,
    METRIC_COLLECTIVE_WAIT,
    METRIC_FORWARD,
    METRIC_H2D,
    METRIC_INPUT_WAIT,
    METRIC_OPTIMIZER_STEP,
    METRIC_TRACED_STEP_TIME,
    OCCURRENCE_METRICS,
    STRATEGY_DDP,
)

WINDOW_METRICS: tuple[str, ...] = tuple(f.name for f in fields(StepTimeValues))
"""Every metric a window reports, in `StepTimeValues` field order."""

_TIE_RELATIVE = 1e-9  # distances to the median closer than this are ties (float noise)


class _RankSteps(Sequence[StepTimeStepFacts]):
    """One rank's aligned steps, each `StepTimeStepFacts` built when asked for."""

    __slots__ = ("_steps", "_table", "_column")

    def __init__(self, steps: tuple[int, ...], table: Sequence[np.ndarray], column: int):
        self._steps = steps
        self._table = table  # per metric: (steps, ranks), NaN = unavailable
        self._column = column

    def __len__(self) -> int:
        return len(self._steps)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self._steps)
        if not 0 <= index < len(self._steps):
            raise IndexError(index)
        raw = [float(array[index, self._column]) for array in self._table]
        return StepTimeStepFacts(self._steps[index], StepTimeValues(*(None if x != x else x for x in raw)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"<{len(self)} aligned steps of one rank>"

    def metric_series(self, metric: str) -> np.ndarray:
        """This rank's per-step values of one window metric (NaN = unavailable), no objects built."""
        return self._table[WINDOW_METRICS.index(metric)][:, self._column]


def rank_step_matrix(facts: Sequence, metric: str) -> np.ndarray:
    """(aligned steps, ranks) values of `metric` for the given rank facts (NaN = unavailable):
    the window's own arrays where it has them, else built from the typed steps."""
    if facts and all(isinstance(f.steps, _RankSteps) for f in facts):
        table = facts[0].steps._table
        if all(f.steps._table is table for f in facts):  # one window's arrays: no loop per rank
            array = np.asarray(table[WINDOW_METRICS.index(metric)], dtype=np.float64)
            return array[:, [f.steps._column for f in facts]]  # a copy: callers may write into it
    columns = []
    for f in facts:
        steps = f.steps
        if isinstance(steps, _RankSteps):
            columns.append(np.asarray(steps.metric_series(metric), dtype=np.float64))
        else:
            columns.append(np.asarray([np.nan if (x := s.values.get(metric)) is None else x
                                       for s in steps], dtype=np.float64))
    if not columns:
        return np.empty((0, 0))
    return np.stack(columns, axis=1)


class _MedianSeries(Sequence[float]):
    """Per aligned step, the median over the measured ranks; computed on first access
    (a partition per step and metric is the largest cost of a wide window, and only
    some surfaces draw the series)."""

    __slots__ = ("_per_step", "_columns", "_values")

    def __init__(self, per_step: np.ndarray, columns: np.ndarray | None):
        self._per_step = per_step  # (steps, ranks), window-owned
        self._columns = columns  # measured rank columns, None = all
        self._values: tuple[float, ...] | None = None

    def _tuple(self) -> tuple[float, ...]:
        if self._values is None:
            data = self._per_step if self._columns is None else self._per_step[:, self._columns]
            self._values = tuple(np.median(data, axis=1).tolist()) if data.size else ()
            self._per_step = self._columns = None
        return self._values

    def __len__(self) -> int:
        if self._values is None:
            return int(self._per_step.shape[0])
        return len(self._values)

    def __getitem__(self, index):  # type: ignore[override]
        return self._tuple()[index]

    def __iter__(self):
        return iter(self._tuple())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _MedianSeries):
            other = other._tuple()
        if isinstance(other, (tuple, list)):
            return self._tuple() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._tuple())

    def __repr__(self) -> str:
        return repr(self._tuple())


def grid_from_rows(snapshot: StepTimeRepositorySnapshot) -> StepTimeSourceGrid:
    """Build the columnar grid from typed rows (snapshots made without one, e.g. in tests).

    Rows are applied in row-id order, so a duplicate (rank, step) keeps the latest row.
    """
    rows = sorted(snapshot.rows, key=lambda r: r.row_id)
    metrics = CANONICAL_METRICS
    ranks = tuple(sorted({r.global_rank for r in rows} | set(snapshot.ranks)))
    steps = sorted({r.step for r in rows})
    rank_pos = {rank: i for i, rank in enumerate(ranks)}
    step_pos = {step: i for i, step in enumerate(steps)}
    shape = (len(steps), len(ranks))
    values = np.full(shape + (2 * len(metrics),), np.nan)
    present = np.zeros(shape, dtype=bool)
    row_ids = np.zeros(shape, dtype=np.int64)
    sample_times = np.full(shape, np.nan)
    for row in rows:
        s, r = step_pos[row.step], rank_pos[row.global_rank]
        present[s, r] = True
        row_ids[s, r] = row.row_id
        sample_times[s, r] = np.nan if row.sample_time is None else row.sample_time
        cell = np.full(2 * len(metrics), np.nan)
        for k, metric in enumerate(metrics):
            pair = row.values.get(metric)
            if pair is not None:
                cell[2 * k] = _finite_or_nan(pair.cpu_ms)
                cell[2 * k + 1] = _finite_or_nan(pair.gpu_ms)
        values[s, r] = cell
    return StepTimeSourceGrid(metrics=metrics, ranks=ranks, steps=np.asarray(steps, dtype=np.int64),
                              present=present, values=values, row_ids=row_ids,
                              sample_times=sample_times)


def _finite_or_nan(value: float | None) -> float:
    if value is None:
        return np.nan
    value = float(value)
    return value if np.isfinite(value) and value >= 0 else np.nan


def analyze_snapshot(snapshot: StepTimeRepositorySnapshot, max_steps: int) -> StepTimeWindow:
    if snapshot.tail_steps is not None:  # a run beyond the cell cap kept fewer step ids
        max_steps = min(max_steps, snapshot.tail_steps)
    return replace(_analyze(snapshot, max_steps), max_steps=max_steps)


def _analyze(snapshot: StepTimeRepositorySnapshot, max_steps: int) -> StepTimeWindow:
    grid = snapshot.grid if snapshot.grid is not None else grid_from_rows(snapshot)
    universe = tuple(sorted(set(snapshot.ranks) | set(grid.ranks)))
    identities = {r: snapshot.ranks.get(r) or RankIdentity(r) for r in universe}
    strategy = snapshot.training_strategy or STRATEGY_DDP

    steps_all = np.asarray(grid.steps, dtype=np.int64)
    present = np.asarray(grid.present, dtype=bool)
    if steps_all.size == 0 or not len(grid.ranks):
        return empty_window(snapshot.run_id, universe, identities, strategy)
    valid = steps_all >= 0
    participating = np.flatnonzero(present[valid].any(axis=0))
    if participating.size == 0:
        return empty_window(snapshot.run_id, universe, identities, strategy)
    common = np.flatnonzero(valid & present[:, participating].all(axis=1))
    if common.size == 0:
        return empty_window(snapshot.run_id, universe, identities, strategy)
    order = np.argsort(steps_all[common], kind="stable")
    slots = common[order][-max_steps:]
    steps = tuple(steps_all[slots].tolist())
    ranks = [grid.ranks[i] for i in participating]

    all_values = np.asarray(grid.values, dtype=np.float64)
    everyone = participating.size == len(grid.ranks)
    if everyone and not grid.shared and np.array_equal(slots, np.arange(len(steps_all))):
        values = all_values  # an unshared grid exactly covering the window: no copy needed
    elif everyone:
        values = all_values[slots]  # (T, P, 2M), a copy: the window owns it
    else:
        values = all_values[np.ix_(slots, participating)]
    index = {metric: k for k, metric in enumerate(grid.metrics)}
    cpu = values[:, :, 0::2]
    gpu = values[:, :, 1::2]
    gpu_complete = bool(np.all(np.isnan(cpu) | ~np.isnan(gpu))) and bool((~np.isnan(gpu)).any())
    clock = CLOCK_GPU if gpu_complete else CLOCK_CPU
    selected = gpu if gpu_complete else cpu

    def on(clock_values: np.ndarray, metric: str) -> np.ndarray:
        k = index.get(metric)
        if k is None:
            return np.full(clock_values.shape[:2], np.nan)
        return clock_values[:, :, k]

    # Explicit-clock aggregates equal to a selected-clock metric share its arrays and statistics.
    same_as = dict(_CPU_ALIASES if clock == CLOCK_CPU else _GPU_ALIASES)
    table = _per_step_table(on, selected, cpu, gpu, same_as)  # per metric (T, P), NaN = unavailable
    means: dict[int, np.ndarray] = {}
    for array in table:
        if id(array) not in means:
            means[id(array)] = array.mean(axis=0)  # NaN wherever any aligned step lacked the value
    averages = np.stack([means[id(array)] for array in table])  # (metrics, P)
    window = _window(snapshot.run_id, universe, identities, strategy, clock, steps, ranks, table,
                     averages, same_as)
    return replace(window, step_end_times=_step_end_times(grid, slots, participating))


def _step_end_times(grid: StepTimeSourceGrid, slots: np.ndarray, participating: np.ndarray) -> tuple[float, ...]:
    """Median over the participating ranks of each window step's end time (NaN where none said)."""
    times = np.asarray(grid.sample_times, dtype=np.float64)
    if times.ndim != 2 or times.shape[0] == 0:
        return tuple(float("nan") for _ in slots)
    cells = times[np.ix_(slots, participating)]
    with np.errstate(all="ignore"):
        known = ~np.isnan(cells).all(axis=1)
        medians = np.full(len(slots), np.nan)
        if known.any():
            medians[known] = np.nanmedian(cells[known], axis=1)
    return tuple(medians.tolist())


_CPU_ALIASES = {"step_time_cpu": "step_time", "traced_step_time_cpu": "traced_step_time",
                "dataloader_fetch_cpu": "input_wait"}
_GPU_ALIASES = {"step_time_gpu": "step_time", "traced_step_time_gpu": "traced_step_time"}


def _per_step_table(on, selected: np.ndarray, cpu: np.ndarray, gpu: np.ndarray,
                    same_as: Mapping[str, str]) -> list[np.ndarray]:
    """Per-step values of every window metric on the aligned steps, in WINDOW_METRICS order
    (a metric equal to another on this clock is the same array object)."""
    series: dict[str, np.ndarray] = {}
    for metric in CANONICAL_METRICS:
        series[metric] = on(selected, metric)
    for metric in OCCURRENCE_METRICS:
        raw = series[metric]
        observed = ~np.isnan(raw).all(axis=0)  # per rank: seen on any aligned step
        series[metric] = np.where(observed[None, :], np.nan_to_num(raw, nan=0.0), np.nan)
    h2d_or_zero = np.nan_to_num(series[METRIC_H2D], nan=0.0)
    wait_or_zero = np.nan_to_num(series[METRIC_COLLECTIVE_WAIT], nan=0.0)
    fwd, bwd = series[METRIC_FORWARD], series[METRIC_BACKWARD]
    opt, traced = series[METRIC_OPTIMIZER_STEP], series[METRIC_TRACED_STEP_TIME]
    series["compute"] = fwd + bwd + opt
    with np.errstate(invalid="ignore"):
        # Collective wait is measured time: it fills the unexplained time first (an explicit
        # collective between phases), the rest lies inside the phases (DDP's backward), so the
        # residual keeps only what nothing measured explains (docs/DIAGNOSIS.md).
        series["residual"] = np.maximum(traced - h2d_or_zero - fwd - bwd - opt - wait_or_zero, 0.0)
    series["step_time"] = series[METRIC_INPUT_WAIT] + traced
    iw_cpu, traced_cpu = on(cpu, METRIC_INPUT_WAIT), on(cpu, METRIC_TRACED_STEP_TIME)
    iw_gpu, traced_gpu = on(gpu, METRIC_INPUT_WAIT), on(gpu, METRIC_TRACED_STEP_TIME)
    series["traced_step_time_cpu"] = traced_cpu
    series["traced_step_time_gpu"] = traced_gpu
    series["dataloader_fetch_cpu"] = iw_cpu
    for name, twin in same_as.items():
        series[name] = series[twin]
    if "step_time_cpu" not in series:
        series["step_time_cpu"] = iw_cpu + traced_cpu
    if "step_time_gpu" not in series:
        series["step_time_gpu"] = iw_gpu + traced_gpu
    return [series[m] for m in WINDOW_METRICS]


def _window(run_id: str, universe: tuple[int, ...], identities: Mapping[int, RankIdentity],
            strategy: str, clock: str, steps: tuple[int, ...], ranks: list[int],
            table: list[np.ndarray], averages: np.ndarray, same_as: Mapping[str, str]) -> StepTimeWindow:
    by_rank = averages.T.astype(object)  # per participating rank: one value per metric
    by_rank[np.isnan(averages.T)] = None
    rank_facts: dict[int, StepTimeRankFacts] = {}
    for p, (rank, row) in enumerate(zip(ranks, by_rank.tolist())):
        rank_facts[rank] = StepTimeRankFacts(rank, identities[rank], StepTimeValues(*row),
                                             _RankSteps(steps, table, p))
    for rank in universe:
        if rank not in rank_facts:
            rank_facts[rank] = StepTimeRankFacts(rank, identities[rank], StepTimeValues(), ())
    rank_facts = {rank: rank_facts[rank] for rank in universe}

    rank_array = np.asarray(ranks, dtype=np.int64)
    metrics: dict[str, StepTimeMetric] = {}
    coverage: dict[str, tuple[int, int]] = {}
    for m, name in enumerate(WINDOW_METRICS):
        measured = ~np.isnan(averages[m])
        count = int(measured.sum())
        coverage[name] = (count, len(universe))
        if name in same_as:
            continue
        if count == measured.size:
            metrics[name] = _metric(name, _MedianSeries(table[m], None), averages[m], rank_array)
        else:
            metrics[name] = _metric(name, _MedianSeries(table[m], np.flatnonzero(measured)),
                                    averages[m][measured], rank_array[measured])
    for name, twin in same_as.items():
        metrics[name] = replace(metrics[twin], name=name)
    metrics = {name: metrics[name] for name in WINDOW_METRICS}
    return StepTimeWindow(run_id=run_id, clock=clock, steps=steps, expected_ranks=universe,
                          rank_facts=rank_facts, metrics=metrics, coverage=coverage,
                          shares=window_shares(metrics), training_strategy=strategy)


def _metric(name: str, series: _MedianSeries | int, values: np.ndarray,
            ranks: np.ndarray) -> StepTimeMetric:
    """Statistics over the ranks that measured `name` (`values[i]` belongs to `ranks[i]`);
    `series` is the median series, or the step count when no rank measured the metric."""
    if values.size == 0:
        steps = series if isinstance(series, int) else len(series)
        return StepTimeMetric(name=name, series=(None,) * steps,
                              rank_values={}, median=None, average=None, worst=None,
                              worst_rank=None, skew=None, representative_rank=None,
                              representative_value=None)
    median = float(np.median(values))
    average = float(values.mean())
    worst = worst_rank = skew = None
    if values.size >= 2:
        w = int(np.argmax(values))  # first maximum; ranks ascend, so the lower rank on ties
        worst, worst_rank = float(values[w]), int(ranks[w])
        skew = finite_ratio(worst - median, median)
    rep = representative_index(values, ranks, median)
    return StepTimeMetric(
        name=name, series=series,
        rank_values=dict(zip(ranks.tolist(), values.tolist())),
        median=median, average=average, worst=worst, worst_rank=worst_rank, skew=skew,
        representative_rank=int(ranks[rep]), representative_value=float(values[rep]))


def representative_index(values: np.ndarray, ranks: np.ndarray, median: float) -> int:
    """Index of the real rank nearest the median, then lower value, then lower rank id."""
    distance = np.abs(values - median)
    candidates = np.flatnonzero(distance <= distance.min() + _TIE_RELATIVE * max(1.0, abs(median)))
    if candidates.size == 1:
        return int(candidates[0])
    order = np.lexsort((ranks[candidates], values[candidates]))  # value first, then rank id
    return int(candidates[order[0]])


def window_shares(metrics: Mapping[str, StepTimeMetric]) -> dict[str, float | None]:
    """median(metric) / median(step_time); None where either is missing or the ratio is not finite."""
    step = metrics["step_time"].median
    out: dict[str, float | None] = {}
    for name, metric in metrics.items():
        out[name] = None if step is None or metric.median is None else finite_ratio(metric.median, step)
    return out


def empty_window(run_id: str, universe: Sequence[int] = (),
                 identities: Mapping[int, RankIdentity] | None = None,
                 strategy: str = STRATEGY_DDP) -> StepTimeWindow:
    """The canonical empty window: no clock, no steps, every metric unavailable."""
    identities = identities or {}
    universe = tuple(universe)
    metrics = {name: _metric(name, 0, np.empty(0), np.empty(0, dtype=np.int64))
               for name in WINDOW_METRICS}
    return StepTimeWindow(
        run_id=run_id, clock=None, steps=(), expected_ranks=universe,
        rank_facts={r: StepTimeRankFacts(r, identities.get(r) or RankIdentity(r), StepTimeValues(), ())
                    for r in universe},
        metrics=metrics, coverage={name: (0, len(universe)) for name in WINDOW_METRICS},
        shares={name: None for name in WINDOW_METRICS}, training_strategy=strategy)


__all__ = [
    "WINDOW_METRICS",
    "analyze_snapshot", "empty_window", "grid_from_rows", "rank_step_matrix", "representative_index",
]
