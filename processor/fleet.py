"""Repeat offenders across runs: which hosts and GPUs keep being a run's culprit.

A finding names a rank; whether that is the job's problem or the machine's shows only
across runs. When the processor summarises a run it records each *confirmed* straggler
culprit (a straggler finding over a window long enough to be critical, status
`confirmed`) with the host its rank ran on (`host.name` of the rank's resource), the
GPU's id when the resource metrics carried one (`hw.id`, the NVML UUID; a rank's
`cuda:N` names no machine and is left out), and the time the badput ledger says the
other ranks lost waiting for it (`straggler_wait`, over the run so far: the ledger's
figure, not one made here).

The rule (`repeat_offence`): the run's culprit host was the culprit in at least K of
the host's last N runs that this processor stored (the run itself included; a run
counts for a host when any of its ranks ran there), or the culprit GPU in at least K of
them. K and N are settings (`--repeat-offender-runs`, `--repeat-offender-window`). The
finding, `REPEAT_OFFENDER_HOST` (warn: it asks for a node to be drained or checked), is
added to the run's final summary beside the straggler finding it repeats.

This module decides; it reads no store (`store_read` answers the history and the fleet
listing with the records below) and writes none (`sqlite_writer.record_culprits`).
Standard library and the layers below only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from traceml.processor.metric_point import MetricPoint
from traceml.processor.step_time.model import DiagnosisIssue
from traceml.schema import diagnosis as d
from traceml.schema import vocabulary as v
from traceml.schema.badput import CAUSE_STRAGGLER_WAIT

_NOT_A_MACHINE = ("cuda:", "index:")
"""Device names that say which GPU of a process, not which physical GPU: never a fleet device."""


@dataclass(frozen=True, slots=True)
class CulpritRecord:
    """One confirmed culprit of one summarised run (one `fleet_culprits` row)."""

    run_id: str
    global_rank: int
    kind: str  # the straggler finding's kind
    host: str
    device: str  # the GPU's id (NVML UUID) when known, else ''
    ended_time: float  # unix seconds: when the run was summarised
    lost_rank_seconds: float | None  # the ledger's straggler wait over the run so far
    lost_device_hours: float | None  # the same in device-hours, when the ranks' devices were known


@dataclass(frozen=True, slots=True)
class HostRun:
    """One stored run with a rank on a host, and whether a culprit of it ran on that host."""

    run_id: str
    first_seen: float  # unix seconds, the run's first record
    flagged: bool  # a confirmed culprit of this run ran on the host
    devices: tuple[str, ...] = ()  # the culprits' GPU ids on this host ('' left out)
    lost_rank_seconds: float | None = None
    lost_device_hours: float | None = None


@dataclass(frozen=True)
class RepeatOffence:
    """The rule's verdict for one culprit: the host (and GPU) and the runs that make it a repeat."""

    host: str
    device: str  # '' when the GPU is not known or not itself a repeat
    culprit_rank: int
    k: int
    n: int
    runs: tuple[HostRun, ...]  # the host's last runs counted, newest first (this run first)
    flagged_runs: tuple[str, ...]  # of `runs`, those whose culprit ran on the host
    device_flagged_runs: tuple[str, ...]  # of `runs`, those whose culprit was this GPU
    lost_rank_seconds: float | None  # summed over the flagged runs (None: no ledger figure)
    lost_device_hours: float | None


@dataclass(frozen=True, slots=True)
class FleetEntry:
    """One line of the fleet listing: a host (device '') or one GPU of it, over a period."""

    host: str
    device: str
    runs_flagged: int
    runs_seen: int  # runs with a rank on the host in the period (hosts only; GPUs: runs flagged)
    lost_rank_seconds: float | None
    lost_device_hours: float | None
    last_flagged: float | None  # unix seconds
    latest_runs: tuple[str, ...]  # the latest flagged runs, newest first (at most a few)


def machine_device(device: str | None) -> str:
    """The GPU id a fleet record keeps: an `hw.id` (NVML UUID) or '' (unknown, or a `cuda:N`)."""
    if not device or device.startswith(_NOT_A_MACHINE):
        return ""
    return device


def confirmed_culprits(analysis, ledger, ended_time: float) -> tuple[CulpritRecord, ...]:
    """The run's confirmed straggler culprits with a known host, one per rank (the first finding).

    `ledger`: the run's `RunLedger` (or None); its straggler wait is the lost time, when the
    ledger names the same rank as waited for (or names none)."""
    window = analysis.window
    resources = getattr(analysis, "resources", None)
    out: dict[int, CulpritRecord] = {}
    for issue in analysis.diagnosis.issues:
        rank = issue.culprit_rank
        if issue.kind not in d.STRAGGLER_KINDS or issue.status != d.STATUS_CONFIRMED or rank is None or rank in out:
            continue
        facts = window.rank_facts.get(rank)
        rank_resources = None if resources is None else resources.ranks.get(rank)
        host = (facts.identity.hostname if facts is not None else None) or (
            rank_resources.host if rank_resources is not None else None)
        if not host:
            continue
        lost_s = lost_h = None
        cause = None if ledger is None else ledger.causes.get(CAUSE_STRAGGLER_WAIT)
        if cause is not None and cause.culprit_rank in (None, rank):
            lost_s, lost_h = cause.rank_seconds, cause.device_hours
        out[rank] = CulpritRecord(
            run_id=window.run_id, global_rank=rank, kind=issue.kind, host=host,
            device=machine_device(None if rank_resources is None else rank_resources.device),
            ended_time=ended_time, lost_rank_seconds=_finite(lost_s), lost_device_hours=_finite(lost_h))
    return tuple(out.values())


def repeat_offence(culprit: CulpritRecord, history: Sequence[HostRun], *, k: int, n: int) -> RepeatOffence | None:
    """Whether `culprit`'s host (or GPU) was the culprit in at least `k` of the host's last `n` runs.

    `history`: the host's other stored runs, newest first (at least `n - 1` when there are that
    many); this run is counted first, as flagged."""
    own = HostRun(culprit.run_id, culprit.ended_time, True, (culprit.device,) if culprit.device else (),
                  culprit.lost_rank_seconds, culprit.lost_device_hours)
    runs = (own, *[run for run in history if run.run_id != culprit.run_id][:max(n - 1, 0)])
    flagged = tuple(run.run_id for run in runs if run.flagged)
    device_flagged = tuple(run.run_id for run in runs if culprit.device and culprit.device in run.devices)
    if len(flagged) < k and len(device_flagged) < k:
        return None
    counted = [run for run in runs if run.flagged]
    return RepeatOffence(
        host=culprit.host, device=culprit.device if len(device_flagged) >= k else "",
        culprit_rank=culprit.global_rank, k=k, n=n, runs=runs, flagged_runs=flagged,
        device_flagged_runs=device_flagged,
        lost_rank_seconds=_sum(run.lost_rank_seconds for run in counted),
        lost_device_hours=_sum(run.lost_device_hours for run in counted))


def repeat_offender_issue(offence: RepeatOffence) -> DiagnosisIssue:
    """The finding: which machine, in how many of its last runs, what those runs lost."""
    what = f"host {offence.host}" + (f" (GPU {offence.device})" if offence.device else "")
    count = len(offence.device_flagged_runs if offence.device else offence.flagged_runs)
    lost = ""
    if offence.lost_device_hours is not None:
        lost = f"; {offence.lost_device_hours:.3g} device-hours lost waiting for it over those runs"
    elif offence.lost_rank_seconds is not None:
        lost = f"; {offence.lost_rank_seconds:.3g} rank-seconds lost waiting for it over those runs"
    summary = (f"Rank {offence.culprit_rank}'s {what} was the straggler in {count} of its last "
               f"{len(offence.runs)} runs{lost}: a node to drain or check, not code to debug.")
    return DiagnosisIssue(
        kind=d.REPEAT_OFFENDER_HOST, severity=d.SEVERITY_WARN, status=d.STATUS_CONFIRMED,
        score=round(count / len(offence.runs), 4), summary=summary, culprit_rank=offence.culprit_rank,
        evidence={
            "host": offence.host,
            "device": offence.device or None,
            "flagged_runs": list(offence.flagged_runs),
            "device_flagged_runs": list(offence.device_flagged_runs),
            "runs_considered": [run.run_id for run in offence.runs],
            "min_flagged_runs": offence.k,
            "window_runs": offence.n,
            "lost_rank_seconds": _round(offence.lost_rank_seconds, 3),
            "lost_device_hours": _round(offence.lost_device_hours, 6),
        })


def with_repeat_offences(analysis, offences: Iterable[RepeatOffence]):
    """`analysis` with a REPEAT_OFFENDER_HOST issue per offence, each placed where the diagnosis's
    order puts it (`diagnosis.api.issue_order_key`: severity, score, ...) among the others, which
    keep their places."""
    from dataclasses import replace

    from traceml.processor.diagnosis.api import issue_order_key
    from traceml.processor.step_time.model import StepTimeDiagnosis

    issues = list(analysis.diagnosis.issues)
    added = [repeat_offender_issue(offence) for offence in offences]
    if not added:
        return analysis
    for new in added:
        key = issue_order_key(new)
        at = next((i for i, issue in enumerate(issues) if issue_order_key(issue) > key), len(issues))
        issues.insert(at, new)
    return replace(analysis, diagnosis=StepTimeDiagnosis(tuple(issues)))


def fleet_points(entries: Sequence[FleetEntry]) -> list[MetricPoint]:
    """The fleet series of the hosts in `entries` (GPU lines are left to the CLI and the web view:
    the series stay one per host and name)."""
    points = []
    for entry in entries:
        if entry.device:
            continue
        labels = {v.ATTR_HOST: entry.host}
        points.append(MetricPoint(v.METRIC_FLEET_HOST_FLAGGED_RUNS, labels, float(entry.runs_flagged)))
        points.append(MetricPoint(v.METRIC_FLEET_HOST_RUNS, labels, float(entry.runs_seen)))
        if entry.lost_rank_seconds is not None:
            points.append(MetricPoint(v.METRIC_FLEET_HOST_LOST_TIME, labels, float(entry.lost_rank_seconds)))
    return points


FLEET_COLUMNS = ("host", "gpu", "runs flagged", "runs seen", "rank-seconds lost", "device-hours lost",
                 "latest flagged runs")


def fleet_rows(entries: Sequence[FleetEntry]) -> list[tuple[str, ...]]:
    """The listing's cells (`FLEET_COLUMNS`), as `traceml fleet` and the web view's page show them:
    a host's line, then its GPUs' lines. Wire strings are returned raw: each surface escapes them."""
    hosts = [e for e in entries if not e.device]
    gpus: dict[str, list[FleetEntry]] = {}
    for entry in entries:
        if entry.device:
            gpus.setdefault(entry.host, []).append(entry)
    rows = []
    for host in hosts:
        for entry in (host, *gpus.get(host.host, ())):
            rows.append((entry.host if not entry.device else "", entry.device or "-", str(entry.runs_flagged),
                         str(entry.runs_seen) if not entry.device else "-",
                         "-" if entry.lost_rank_seconds is None else f"{entry.lost_rank_seconds:.1f}",
                         "-" if entry.lost_device_hours is None else f"{entry.lost_device_hours:.3f}",
                         ", ".join(entry.latest_runs)))
    return rows


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def _sum(values: Iterable[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return sum(known) if known else None


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


__all__ = ["CulpritRecord", "FLEET_COLUMNS", "FleetEntry", "fleet_rows", "HostRun", "RepeatOffence", "confirmed_culprits", "fleet_points",
           "machine_device", "repeat_offence", "repeat_offender_issue", "with_repeat_offences"]
