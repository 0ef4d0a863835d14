"""Read a run's resource samples over a time range, joined to its ranks and hosts.

One read-only connection in one transaction, three kinds of rows: the run's own
(`resource_samples` rows with its run id: each rank's process, allocator and GPU
figures, and its local rank 0's host figures), foreign rows on the run's hosts (run id
NULL: the Collector's `hostmetrics` receiver, DCGM), and the per-step peak allocated
memory of the window's steps (`step_memory_samples`). The joins, in one place:

- host figures (`schema.resources.HOST_METRICS`) belong to a host, whoever sent them;
  a host whose own rank sent a metric ignores a foreign sender's copy of it (one source
  per host and metric: the run's own first);
- a foreign GPU row joins the rank whose own GPU rows named the same `hw.id` (UUID),
  else the rank on that host whose local rank equals DCGM's GPU index (`index:N`; true
  when CUDA_VISIBLE_DEVICES does not reorder the devices), and only for a metric the
  rank's own NVML did not measure;
- a foreign process row (`hostmetrics`' process scraper) joins the rank on that host
  whose own resource said the same `process.pid`, and only where the rank sent no
  process figures of its own.

What a figure needs is aggregated by SQLite (count, mean, max per rank or host and
metric), so a refresh costs one row per (rank, metric), not one per sample; only the
series a trend or a rate needs (RSS, `system.cpu.time`, per-step peaks) are read as
series, and the per-step peaks of a large run at a stride (`PEAK_MAX_CELLS`).
"""
from __future__ import annotations

import math
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from traceml.processor.sqlite_layout import connect_readonly
from traceml.schema import resources as r

_HOST_METRICS = frozenset(r.HOST_METRICS)
_GPU_METRICS = frozenset(r.GPU_METRICS)
_PROCESS_METRICS = frozenset({r.PROCESS_CPU_UTILIZATION, r.PROCESS_MEMORY_USAGE})
_SERIES_METRICS = (r.PROCESS_MEMORY_USAGE, r.SYSTEM_CPU_TIME_BUSY, r.SYSTEM_CPU_TIME_TOTAL)
"""Read sample by sample: RSS for its trend, cumulative CPU time for its rate."""
_IN_CHUNK = 500  # hosts per `IN (...)` list: far below SQLite's variable limit
PEAK_MAX_CELLS = 16_384
"""Most (rank, step) per-step peaks read for the trends: a run whose window holds more is read
at a stride of steps (1,024 ranks x 100 steps: every 7th step), which a fit of tens of points
over a steady rise does not miss."""

Series = tuple[tuple[float, ...], tuple[float, ...]]  # (x: time or step, values), ordered


@dataclass(frozen=True, slots=True)
class Aggregate:
    """Samples of one metric in the window: how many, their mean and their largest."""

    count: int
    mean: float
    max: float


@dataclass(frozen=True)
class RankPlacement:
    """Where a rank runs, as the store knows it."""

    rank: int
    host: str | None
    local_rank: int | None
    node_rank: int | None


@dataclass(frozen=True)
class ResourceSamples:
    """A run's resource samples in [start, end], joined (see the module docstring)."""

    run_id: str
    start_time: float
    end_time: float
    placements: Mapping[int, RankPlacement]
    rank_figures: Mapping[int, Mapping[str, Aggregate]]  # rank -> metric -> aggregate
    host_figures: Mapping[str, Mapping[str, Aggregate]]  # host -> HOST_METRICS metric -> aggregate
    rank_devices: Mapping[int, str]  # rank -> its GPU hw.id (else its `cuda:N`)
    rss: Mapping[int, Series] = field(default_factory=dict)  # rank -> (times, bytes)
    host_series: Mapping[str, Mapping[str, Series]] = field(default_factory=dict)  # host -> cpu.time series
    host_sources: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    peak_allocated: Mapping[int, Series] = field(default_factory=dict)  # rank -> (steps, bytes)

    @property
    def is_empty(self) -> bool:
        return not self.rank_figures and not self.host_figures and not self.peak_allocated


def read_resource_samples(db_path: str | Path, run_id: str, start_time: float, end_time: float,
                          first_step: int | None = None, last_step: int | None = None) -> ResourceSamples:
    """The run's samples between `start_time` and `end_time` (unix seconds), and the per-step
    peaks of steps `first_step`..`last_step`; empty when the file or its tables are absent."""
    empty = ResourceSamples(run_id, start_time, end_time, {}, {}, {}, {})
    if not Path(db_path).exists():
        return empty
    conn = connect_readonly(db_path)
    try:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        conn.execute("BEGIN")
        try:
            placements = _placements(conn, run_id)
            peaks = (_peak_allocated(conn, run_id, first_step, last_step, len(placements))
                     if first_step is not None and last_step is not None else {})
            if "resource_samples" not in tables:
                return ResourceSamples(run_id, start_time, end_time, placements, {}, {}, {},
                                       peak_allocated=peaks)
            window = (start_time, end_time)
            own = conn.execute(
                "SELECT global_rank, max(host), device, metric, max(source), max(pid), count(*), avg(value),"
                " max(value) FROM resource_samples WHERE run_id = ? AND sample_time BETWEEN ? AND ?"
                " GROUP BY global_rank, metric, device", (run_id, *window)).fetchall()
            own_series = conn.execute(
                "SELECT global_rank, host, metric, sample_time, value FROM resource_samples"
                " WHERE run_id = ? AND sample_time BETWEEN ? AND ?"
                f" AND metric IN ({','.join('?' * len(_SERIES_METRICS))}) ORDER BY sample_time",
                (run_id, *window, *_SERIES_METRICS)).fetchall()
            hosts = sorted({p.host for p in placements.values() if p.host})
            foreign, foreign_series = [], []
            for i in range(0, len(hosts), _IN_CHUNK):
                chunk = hosts[i:i + _IN_CHUNK]
                marks = ",".join("?" * len(chunk))
                foreign += conn.execute(
                    "SELECT NULL, host, device, metric, max(source), pid, count(*), avg(value), max(value)"
                    f" FROM resource_samples WHERE run_id IS NULL AND host IN ({marks})"
                    " AND sample_time BETWEEN ? AND ? GROUP BY host, metric, device, pid",
                    (*chunk, *window)).fetchall()
                foreign_series += conn.execute(
                    "SELECT pid, host, metric, sample_time, value FROM resource_samples"
                    f" WHERE run_id IS NULL AND host IN ({marks}) AND sample_time BETWEEN ? AND ?"
                    f" AND metric IN ({','.join('?' * len(_SERIES_METRICS))}) ORDER BY sample_time",
                    (*chunk, *window, *_SERIES_METRICS)).fetchall()
        finally:
            conn.execute("COMMIT")
    except sqlite3.OperationalError:
        return empty
    finally:
        conn.close()
    return _join(run_id, start_time, end_time, placements, own, foreign, own_series, foreign_series, peaks)


def _placements(conn: sqlite3.Connection, run_id: str) -> dict[int, RankPlacement]:
    return {int(rank): RankPlacement(int(rank), host, local, node) for rank, host, local, node in conn.execute(
        "SELECT global_rank, hostname, local_rank, node_rank FROM step_time_ranks WHERE run_id = ?", (run_id,))}


def _peak_allocated(conn: sqlite3.Connection, run_id: str, first: int, last: int, ranks: int
                    ) -> dict[int, Series]:
    stride = max(1, math.ceil(max(1, ranks) * (last - first + 1) / PEAK_MAX_CELLS))
    per: dict[int, tuple[list, list]] = {}
    for rank, step, peak in conn.execute(
            "SELECT global_rank, step, max(peak_allocated_bytes) FROM step_memory_samples"
            " WHERE run_id = ? AND step BETWEEN ? AND ? AND (step - ?) % ? = 0"
            " AND peak_allocated_bytes IS NOT NULL GROUP BY global_rank, step ORDER BY step",
            (run_id, first, last, first, stride)):
        steps, values = per.setdefault(int(rank), ([], []))
        steps.append(float(step))
        values.append(float(peak))
    return {rank: (tuple(s), tuple(v)) for rank, (s, v) in per.items()}


def _join(run_id: str, start: float, end: float, placements: Mapping[int, RankPlacement], own, foreign,
          own_series, foreign_series, peaks: Mapping[int, Series]) -> ResourceSamples:
    rank_figures: dict[int, dict[str, Aggregate]] = {}
    host_figures: dict[str, dict[str, Aggregate]] = {}
    host_src: dict[str, set[str]] = {}
    devices: dict[int, str] = {}
    uuid_rank: dict[tuple[str, str], int] = {}  # (host, hw.id) -> rank
    pid_rank: dict[tuple[str, int], int] = {}  # (host, pid) -> rank
    own_process: set[int] = set()

    for rank, host, device, metric, source, pid, count, mean, largest in own:
        if rank is None:
            continue
        rank, figure = int(rank), Aggregate(int(count), float(mean), float(largest))
        if pid is not None and host:
            pid_rank.setdefault((host, int(pid)), rank)
        if metric in _HOST_METRICS:
            if host:
                _merge(host_figures.setdefault(host, {}), metric, figure)
                host_src.setdefault(host, set()).add(source)
            continue
        if metric in _GPU_METRICS and device:
            devices[rank] = device
            if host:
                uuid_rank.setdefault((host, device), rank)
        elif device and device.startswith("cuda"):
            devices.setdefault(rank, device)
        if metric in _PROCESS_METRICS:
            own_process.add(rank)
        _merge(rank_figures.setdefault(rank, {}), metric, figure)

    index_rank = {(p.host, f"{r.DEVICE_INDEX_PREFIX}{p.local_rank}"): p.rank
                  for p in placements.values() if p.host and p.local_rank is not None}
    own_gpu = {rank: {m for m in figures if m in _GPU_METRICS} for rank, figures in rank_figures.items()}
    own_host = {(host, m) for host, figures in host_figures.items() for m in figures}
    for _, host, device, metric, source, pid, count, mean, largest in foreign:
        figure = Aggregate(int(count), float(mean), float(largest))
        if metric in _HOST_METRICS:
            if (host, metric) not in own_host:
                _merge(host_figures.setdefault(host, {}), metric, figure)
                host_src.setdefault(host, set()).add(source)
            continue
        rank = _foreign_rank(metric, host, device, pid, uuid_rank, index_rank, pid_rank)
        if rank is None or metric in own_gpu.get(rank, ()) or (metric in _PROCESS_METRICS and rank in own_process):
            continue
        if metric in _GPU_METRICS:
            devices.setdefault(rank, device)
        _merge(rank_figures.setdefault(rank, {}), metric, figure)

    rss: dict[int, tuple[list, list]] = {}
    cpu_times: dict[str, dict[str, tuple[list, list]]] = {}
    for rank, host, metric, time, value in own_series:
        if metric == r.PROCESS_MEMORY_USAGE:
            _append(rss.setdefault(int(rank), ([], [])), time, value)
        elif host:
            _append(cpu_times.setdefault(host, {}).setdefault(metric, ([], [])), time, value)
    for pid, host, metric, time, value in foreign_series:
        if metric == r.PROCESS_MEMORY_USAGE:
            rank = None if pid is None else pid_rank.get((host, int(pid)))
            if rank is not None and rank not in own_process:
                _append(rss.setdefault(rank, ([], [])), time, value)
        elif (host, metric) not in own_host:
            _append(cpu_times.setdefault(host, {}).setdefault(metric, ([], [])), time, value)

    return ResourceSamples(
        run_id, start, end, dict(placements), rank_figures, host_figures, devices,
        rss={rank: (tuple(t), tuple(v)) for rank, (t, v) in rss.items()},
        host_series={h: {m: (tuple(t), tuple(v)) for m, (t, v) in ms.items()} for h, ms in cpu_times.items()},
        host_sources={h: tuple(sorted(s)) for h, s in host_src.items()}, peak_allocated=dict(peaks))


def _foreign_rank(metric: str, host: str, device: str, pid, uuid_rank, index_rank, pid_rank) -> int | None:
    if metric in _GPU_METRICS:
        return uuid_rank.get((host, device), index_rank.get((host, device)))
    if metric in _PROCESS_METRICS and pid is not None:
        return pid_rank.get((host, int(pid)))
    return None


def _merge(figures: dict[str, Aggregate], metric: str, figure: Aggregate) -> None:
    """Two groups of one metric (two devices of a rank's allocator, say): one aggregate of both."""
    known = figures.get(metric)
    if known is None:
        figures[metric] = figure
        return
    count = known.count + figure.count
    figures[metric] = Aggregate(count, (known.mean * known.count + figure.mean * figure.count) / count,
                                max(known.max, figure.max))


def _append(series: tuple[list, list], time: float, value: float) -> None:
    series[0].append(float(time))
    series[1].append(float(value))
