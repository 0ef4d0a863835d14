"""Read a run's resource samples over a time range, joined to its ranks and hosts.

One read-only connection, three kinds of rows: the run's own (`resource_samples` rows
with its run id: each rank's process, allocator and GPU figures, and its local rank 0's
host figures), foreign rows on the run's hosts (run id NULL: the Collector's
`hostmetrics` receiver, DCGM), and the per-step peak allocated memory of the window's
steps (`step_memory_samples`). The joins, in one place:

- host figures (`schema.resources.HOST_METRICS`) belong to a host, whoever sent them;
  a host whose own rank 0 sent them ignores a foreign sender's copy of the same metric
  (one source per host and metric: the run's own first);
- a foreign GPU row joins the rank whose own GPU rows named the same `hw.id` (UUID),
  else the rank on that host whose local rank equals DCGM's GPU index (`index:N`; true
  when CUDA_VISIBLE_DEVICES does not reorder the devices, documented);
- a foreign process row (`hostmetrics`' process scraper) joins the rank on that host
  whose own resource said the same `process.pid`, and only where the rank sent no
  process figures of its own.

What comes out is arrays of (time, value) per rank or host and metric: the analysis
(`resources.analysis`) turns them into window figures and trends.
"""
from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from traceml.processor.sqlite_layout import connect_readonly
from traceml.schema import resources as r

_HOST_METRICS = frozenset(r.HOST_METRICS)
_GPU_METRICS = frozenset(r.GPU_METRICS)
_PROCESS_METRICS = frozenset({r.PROCESS_CPU_UTILIZATION, r.PROCESS_MEMORY_USAGE})
_IN_CHUNK = 500  # hosts per `IN (...)` list: far below SQLite's variable limit

Series = tuple[tuple[float, ...], tuple[float, ...]]  # (times, values), time-ordered


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
    rank_series: Mapping[int, Mapping[str, Series]]  # rank -> metric -> series (process, allocator, GPU)
    host_series: Mapping[str, Mapping[str, Series]]  # host -> metric -> series (HOST_METRICS)
    rank_devices: Mapping[int, str]  # rank -> its GPU hw.id (else its `cuda:N`)
    host_sources: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    peak_allocated: Mapping[int, Series] = field(default_factory=dict)  # rank -> (steps, bytes) in the window

    @property
    def is_empty(self) -> bool:
        return not self.rank_series and not self.host_series and not self.peak_allocated


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
            peaks = (_peak_allocated(conn, run_id, first_step, last_step)
                     if first_step is not None and last_step is not None else {})
            if "resource_samples" not in tables:
                return ResourceSamples(run_id, start_time, end_time, placements, {}, {}, {},
                                       peak_allocated=peaks)
            own = conn.execute(
                "SELECT global_rank, host, device, metric, sample_time, value, source, pid"
                " FROM resource_samples WHERE run_id = ? AND sample_time BETWEEN ? AND ?"
                " ORDER BY sample_time", (run_id, start_time, end_time)).fetchall()
            hosts = sorted({p.host for p in placements.values() if p.host})
            foreign = []
            for i in range(0, len(hosts), _IN_CHUNK):
                chunk = hosts[i:i + _IN_CHUNK]
                foreign += conn.execute(
                    "SELECT NULL, host, device, metric, sample_time, value, source, pid FROM resource_samples"
                    f" WHERE run_id IS NULL AND host IN ({','.join('?' * len(chunk))})"
                    " AND sample_time BETWEEN ? AND ? ORDER BY sample_time",
                    (*chunk, start_time, end_time)).fetchall()
        finally:
            conn.execute("COMMIT")
    except sqlite3.OperationalError:
        return empty
    finally:
        conn.close()
    return _join(run_id, start_time, end_time, placements, own, foreign, peaks)


def _placements(conn: sqlite3.Connection, run_id: str) -> dict[int, RankPlacement]:
    return {int(rank): RankPlacement(int(rank), host, local, node) for rank, host, local, node in conn.execute(
        "SELECT global_rank, hostname, local_rank, node_rank FROM step_time_ranks WHERE run_id = ?", (run_id,))}


def _peak_allocated(conn: sqlite3.Connection, run_id: str, first: int, last: int) -> dict[int, Series]:
    per: dict[int, tuple[list, list]] = {}
    for rank, step, peak in conn.execute(
            "SELECT global_rank, step, max(peak_allocated_bytes) FROM step_memory_samples"
            " WHERE run_id = ? AND step BETWEEN ? AND ? AND peak_allocated_bytes IS NOT NULL"
            " GROUP BY global_rank, step ORDER BY step", (run_id, first, last)):
        steps, values = per.setdefault(int(rank), ([], []))
        steps.append(float(step))
        values.append(float(peak))
    return {rank: (tuple(s), tuple(v)) for rank, (s, v) in per.items()}


def _join(run_id: str, start: float, end: float, placements: Mapping[int, RankPlacement],
          own: Sequence[tuple], foreign: Sequence[tuple], peaks: Mapping[int, Series]) -> ResourceSamples:
    rank_acc: dict[int, dict[str, tuple[list, list]]] = {}
    host_acc: dict[str, dict[str, tuple[list, list]]] = {}
    host_src: dict[str, set[str]] = {}
    devices: dict[int, str] = {}
    uuid_rank: dict[tuple[str, str], int] = {}  # (host, hw.id) -> rank
    pid_rank: dict[tuple[str, int], int] = {}  # (host, pid) -> rank
    own_host_metrics: set[tuple[str, str]] = set()
    own_process: set[int] = set()

    def add(acc: dict, key, metric: str, time: float, value: float) -> None:
        times, values = acc.setdefault(key, {}).setdefault(metric, ([], []))
        times.append(float(time))
        values.append(float(value))

    for rank, host, device, metric, time, value, source, pid in own:
        if rank is None:
            continue
        rank = int(rank)
        if pid is not None and host:
            pid_rank.setdefault((host, int(pid)), rank)
        if metric in _HOST_METRICS:
            if host:
                add(host_acc, host, metric, time, value)
                own_host_metrics.add((host, metric))
                host_src.setdefault(host, set()).add(source)
            continue
        if metric in _GPU_METRICS and device:
            devices[rank] = device
            if host:
                uuid_rank.setdefault((host, device), rank)
        elif metric in (r.CUDA_MEMORY_ALLOCATED, r.CUDA_MEMORY_RESERVED) and device:
            devices.setdefault(rank, device)
        if metric in _PROCESS_METRICS:
            own_process.add(rank)
        add(rank_acc, rank, metric, time, value)

    index_rank = {(p.host, f"{r.DEVICE_INDEX_PREFIX}{p.local_rank}"): p.rank
                  for p in placements.values() if p.host and p.local_rank is not None}
    own_gpu = {rank: {m for m in metrics if m in _GPU_METRICS} for rank, metrics in rank_acc.items()}
    for _, host, device, metric, time, value, source, pid in foreign:
        if metric in _HOST_METRICS:
            if (host, metric) not in own_host_metrics:
                add(host_acc, host, metric, time, value)
                host_src.setdefault(host, set()).add(source)
            continue
        if metric in _GPU_METRICS:
            rank = uuid_rank.get((host, device), index_rank.get((host, device)))
            if rank is None or metric in own_gpu.get(rank, ()):  # the rank's own NVML measured it
                continue
            devices.setdefault(rank, device)
            add(rank_acc, rank, metric, time, value)
        elif metric in _PROCESS_METRICS and pid is not None:
            rank = pid_rank.get((host, int(pid)))
            if rank is None or rank in own_process:
                continue
            add(rank_acc, rank, metric, time, value)

    def freeze(acc: dict) -> dict:
        return {key: {m: _sorted(times, values) for m, (times, values) in metrics.items()}
                for key, metrics in acc.items()}

    return ResourceSamples(run_id, start, end, dict(placements), freeze(rank_acc), freeze(host_acc), devices,
                           {h: tuple(sorted(s)) for h, s in host_src.items()}, dict(peaks))


def _sorted(times: list, values: list) -> Series:
    if all(times[i] <= times[i + 1] for i in range(len(times) - 1)):
        return tuple(times), tuple(values)
    pairs = sorted(zip(times, values))
    return tuple(t for t, _ in pairs), tuple(v for _, v in pairs)
