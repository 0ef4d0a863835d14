"""Per-mode and per-state resource points of one export request -> one value per sender and time.

Senders split some figures by attribute: `system.cpu.utilization` and `system.cpu.time`
by `cpu.mode` (and, from the Collector's `hostmetrics`, by `cpu.logical_number`),
`system.memory.usage` by `system.memory.state`, `hostmetrics`' `process.cpu.utilization`
by mode. The store keeps one value per (sender, host, time) instead (`schema.resources.
STORED_METRICS`), so nothing that reads it needs the other points of the request. This
module folds; it judges no value (the decoder checked every point before and checks
every folded value after) and reads no wire format (it is handed plain numbers).

The rules:

- CPU busy fraction, per CPU: 1 - idle when the idle mode was sent, else the sum of
  the modes sent (a sender of busy modes only); then the mean over the CPUs sent.
- CPU seconds (`system.cpu.time`, cumulative): busy = every mode but idle, total =
  every mode, each summed over the CPUs; folded only when every CPU sent its idle
  mode (without it the total is the busy time and utilisation would read 100 %).
- Memory: the `used` state is stored as `system.memory.usage`; when the request
  carries no `system.memory.limit` for that sender, the sum of the states in
  `MEMORY_STATES_TOTAL` is stored as the limit, provided `used` and `free` are both
  there (`used` alone would read as a full host).
- Process CPU: the sum over the modes sent (one point without a mode: that value).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from traceml.schema import resources as sr

_STATE_FREE = "free"


class SampleKey(NamedTuple):
    """Who measured, where and when: the points folded into one stored value share it."""

    source: str  # schema.resources.SOURCES
    run_id: str | None
    global_rank: int | None
    host: str
    pid: int | None
    attempt: int
    time_ns: int


class Folded(NamedTuple):
    """One folded value, not yet judged: `points` is how many points it came from."""

    key: SampleKey
    metric: str
    value: float
    points: int


@dataclass
class ResourceFolder:
    """Collects one request's split points (`add_*`), then `fold()` gives the stored values.

    `unused` counts points that fold into nothing (a memory state other than those the
    rules read, CPU seconds without an idle mode): the decoder reports them as unused.
    """

    _cpu_busy: dict[SampleKey, dict[object, dict[str | None, float]]] = field(default_factory=dict)
    _cpu_time: dict[SampleKey, dict[object, dict[str | None, float]]] = field(default_factory=dict)
    _memory: dict[SampleKey, dict[str, float]] = field(default_factory=dict)
    _limits: set[tuple] = field(default_factory=set)  # senders (key without time) that sent a limit
    _process_cpu: dict[SampleKey, dict[str | None, float]] = field(default_factory=dict)

    def add_cpu_utilization(self, key: SampleKey, cpu: object, mode: str | None, value: float) -> None:
        self._cpu_busy.setdefault(key, {}).setdefault(cpu, {})[mode] = value

    def add_cpu_time(self, key: SampleKey, cpu: object, mode: str | None, value: float) -> None:
        self._cpu_time.setdefault(key, {}).setdefault(cpu, {})[mode] = value

    def add_memory_usage(self, key: SampleKey, state: str, value: float) -> None:
        self._memory.setdefault(key, {})[state] = value

    def saw_memory_limit(self, key: SampleKey) -> None:
        self._limits.add(key[:-1])

    def add_process_cpu(self, key: SampleKey, mode: str | None, value: float) -> None:
        self._process_cpu.setdefault(key, {})[mode] = value

    def fold(self) -> tuple[list[Folded], int]:
        """(the folded values, points that folded into nothing)."""
        out: list[Folded] = []
        unused = 0
        for key, cpus in self._cpu_busy.items():
            busy = [1.0 - modes[sr.CPU_MODE_IDLE] if sr.CPU_MODE_IDLE in modes else sum(modes.values())
                    for modes in cpus.values()]
            points = sum(len(modes) for modes in cpus.values())
            out.append(Folded(key, sr.SYSTEM_CPU_UTILIZATION, sum(busy) / len(busy), points))
        for key, cpus in self._cpu_time.items():
            points = sum(len(modes) for modes in cpus.values())
            if not all(sr.CPU_MODE_IDLE in modes for modes in cpus.values()):
                unused += points
                continue
            total = sum(sum(modes.values()) for modes in cpus.values())
            idle = sum(modes[sr.CPU_MODE_IDLE] for modes in cpus.values())
            out.append(Folded(key, sr.SYSTEM_CPU_TIME_BUSY, total - idle, points))
            out.append(Folded(key, sr.SYSTEM_CPU_TIME_TOTAL, total, 0))
        for key, states in self._memory.items():
            read = 0
            if sr.MEMORY_STATE_USED in states:
                out.append(Folded(key, sr.SYSTEM_MEMORY_USAGE, states[sr.MEMORY_STATE_USED], 1))
                read = 1
            if (key[:-1] not in self._limits and sr.MEMORY_STATE_USED in states and _STATE_FREE in states):
                parts = [states[s] for s in sr.MEMORY_STATES_TOTAL if s in states]
                out.append(Folded(key, sr.SYSTEM_MEMORY_LIMIT, sum(parts), len(parts) - 1))
                read = len(parts)
            unused += len(states) - read
        for key, modes in self._process_cpu.items():
            out.append(Folded(key, sr.PROCESS_CPU_UTILIZATION, sum(modes.values()), len(modes)))
        return out, unused


__all__ = ["Folded", "ResourceFolder", "SampleKey"]
