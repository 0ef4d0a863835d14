"""Findings that read the run's resource figures: memory creep, an idle GPU, the host CPUs of input.

Each reads `RuleContext.resources` (a `ResourceWindow` over the same steps as the phases) and
says nothing when the figure it needs was not measured: no GPU utilisation, no finding about
it; no host CPU, no advice about workers. Thresholds live in `policy.DiagnosisPolicy`.
"""
from __future__ import annotations

from typing import Iterable

from traceml.processor.diagnosis.context import RuleContext
from traceml.processor.resources.model import (
    CPU_UTILIZATION,
    GPU_UTILIZATION,
    HOST_CPU_COUNT,
    HOST_CPU_UTILIZATION,
    TREND_PEAK_ALLOCATED,
    MemoryTrend,
    ResourceWindow,
)
from traceml.processor.step_time.model import DiagnosisIssue
from traceml.schema.diagnosis import (
    HOST_CPU_RANKS_BUSY,
    HOST_CPU_SATURATED,
    HOST_CPU_SPARE,
    LOW_GPU_UTILIZATION,
    MEMORY_CREEP,
    SEVERITY_CRIT,
    SEVERITY_WARN,
)

_SIGNAL_WORDING = {TREND_PEAK_ALLOCATED: "peak allocated GPU memory", "rss": "process RSS"}


def _resources(ctx: RuleContext) -> ResourceWindow | None:
    resources = ctx.resources
    return resources if isinstance(resources, ResourceWindow) and not resources.is_empty else None


def creeping(trend: MemoryTrend, ctx: RuleContext) -> bool:
    """The one rule for "this trend is creep" (every gate in DiagnosisPolicy)."""
    p = ctx.policy
    if trend.growth_ratio is None or trend.fit_r2 is None or trend.slope_bytes_per_step <= 0:
        return False
    late = trend.late_slope_bytes_per_step
    return (p.at_least(trend.growth_ratio, p.creep_warn_growth)
            and p.at_least(trend.growth_bytes, p.creep_warn_bytes)
            and p.at_least(trend.fit_r2, p.creep_min_fit_r2)
            and p.at_least(trend.rising_fraction, p.creep_min_rising)
            and late is not None and p.at_least(late, p.creep_min_late_slope * trend.slope_bytes_per_step)
            and trend.last_step - trend.onset_step >= p.creep_min_steps)


def memory_creep(ctx: RuleContext) -> DiagnosisIssue | None:
    resources = _resources(ctx)
    if resources is None or not resources.memory_trends:
        return None
    rising = [t for t in resources.memory_trends.values() if creeping(t, ctx)]
    if not rising:
        return None
    p = ctx.policy
    worst = max(rising, key=lambda t: (t.growth_ratio or 0.0, t.growth_bytes, -t.rank))
    uncapped = (SEVERITY_CRIT if p.at_least(worst.growth_ratio, p.creep_crit_growth)
                and p.at_least(worst.growth_bytes, p.creep_crit_bytes) else SEVERITY_WARN)
    severity, caps = ctx.capped(uncapped)
    # One rank's leak names it; most ranks rising is the job's (the same code on every rank). Ranks
    # beyond the fitted ones count as rising by their growth estimate.
    estimates = resources.memory_growth_estimates or {t.rank: t.growth_ratio or 0.0 for t in rising}
    fitted = max(len(estimates), len(resources.memory_trends))
    unfitted_rising = sum(1 for rank, growth in estimates.items()
                          if rank not in resources.memory_trends and p.at_least(growth, p.creep_warn_growth))
    rising_count = len(rising) + unfitted_rising
    culprit = worst.rank if rising_count * 2 <= fitted and fitted > 1 else None
    evidence = {
        **ctx.common_evidence(),
        "signal": worst.signal,
        "rank": worst.rank,
        "onset_step": worst.onset_step,
        "slope_bytes_per_step": worst.slope_bytes_per_step,
        "growth_bytes": worst.growth_bytes,
        "growth_ratio": worst.growth_ratio,
        "level_bytes": worst.level_bytes,
        "fit_r2": worst.fit_r2,
        "ranks_rising": sorted(t.rank for t in rising),
        "ranks_rising_estimated": rising_count,
        "ranks_with_memory": fitted,
        "first_step": worst.first_step,
        "last_step": worst.last_step,
        "warn_growth": p.creep_warn_growth,
        "crit_growth": p.creep_crit_growth,
        "uncapped_severity": uncapped,
        "severity_caps": caps,
    }
    who = f"rank {worst.rank}'s" if culprit is not None or fitted == 1 else f"{rising_count} of {fitted} ranks'"
    summary = (f"{who} {_SIGNAL_WORDING.get(worst.signal, worst.signal)} rose {_mib(worst.growth_bytes)}"
               f" (+{worst.growth_ratio:.0%}) from step {worst.onset_step}, about "
               f"{_mib(worst.slope_bytes_per_step)} per step, and was still rising at step {worst.last_step}")
    return DiagnosisIssue(kind=MEMORY_CREEP, severity=severity, status=ctx.status,
                          score=min(1.0, float(worst.growth_ratio)), summary=summary,
                          culprit_rank=culprit, component=worst.signal, evidence=evidence)


def low_gpu_utilization(ctx: RuleContext) -> DiagnosisIssue | None:
    """The GPUs idle while no phase finding explains it (the caller runs this only then)."""
    resources = _resources(ctx)
    stat = None if resources is None else resources.rank_figure(GPU_UTILIZATION)
    if stat is None or stat.median is None:
        return None
    p = ctx.policy
    if stat.median >= p.gpu_util_warn - p.tolerance:
        return None
    uncapped = SEVERITY_CRIT if stat.median < p.gpu_util_crit - p.tolerance else SEVERITY_WARN
    severity, caps = ctx.capped(uncapped)
    evidence = {
        **ctx.common_evidence(),
        "gpu_utilization": stat.median,
        "median_rank": stat.median_member,
        "worst_rank": stat.worst_member,
        "worst_gpu_utilization": stat.worst,
        "ranks_measured": len(stat.values),
        "threshold": p.gpu_util_warn,
        "crit_threshold": p.gpu_util_crit,
        "uncapped_severity": uncapped,
        "severity_caps": caps,
    }
    summary = (f"the median rank's GPU was busy {stat.median:.0%} of the window (rank {stat.worst_member}:"
               f" {stat.worst:.0%}) and no input or host-to-device finding explains the idle time")
    return DiagnosisIssue(kind=LOW_GPU_UTILIZATION, severity=severity, status=ctx.status,
                          score=1.0 - stat.median, summary=summary, evidence=evidence)


def host_cpu_evidence(ctx: RuleContext, ranks: Iterable[int]) -> dict | None:
    """The CPUs of the hosts running `ranks` (an input finding's ranks), or None when not measured:
    {state, utilization (their median host), host (the busiest), idle_cpus (on that median host)}."""
    resources = _resources(ctx)
    if resources is None or not resources.nodes:
        return None
    hosts = {rr.host for rank in ranks if (rr := resources.ranks.get(rank)) is not None and rr.host}
    if not hosts:  # ranks that sent no sample of their own still have a host in the store
        hosts = {n.host for n in resources.nodes.values() if set(n.ranks) & set(ranks)}
    measured = sorted((n.figures.get(HOST_CPU_UTILIZATION), n.host) for h in hosts
                      if (n := resources.nodes.get(h)) is not None and n.figures.get(HOST_CPU_UTILIZATION) is not None)
    if not measured:
        return None
    utilization, median_host = measured[(len(measured) - 1) // 2]
    busiest = measured[-1][1]
    node = resources.nodes[median_host]
    cpus = node.figures.get(HOST_CPU_COUNT)
    ranks_cpu = _ranks_cpu(resources, node.ranks)
    other_cpu = None if ranks_cpu is None else max(0.0, utilization - ranks_cpu)
    threshold = ctx.policy.host_cpu_saturated
    if not ctx.policy.at_least(utilization, threshold):
        state = HOST_CPU_SPARE
    elif other_cpu is not None and not ctx.policy.at_least(other_cpu, threshold):
        # Busy, but mostly with the training ranks' own processes, whose CPU holds their waits
        # (gloo spins in a collective): no evidence that loader workers would lack CPU.
        state = HOST_CPU_RANKS_BUSY
    else:
        state = HOST_CPU_SATURATED
    return {
        "state": state,
        "utilization": utilization,
        "host": busiest,
        "hosts": len(measured),
        "idle_cpus": None if cpus is None else round((1.0 - utilization) * cpus, 1),
        "ranks_cpu": ranks_cpu,
        "other_cpu": other_cpu,
        "threshold": threshold,
    }


def _ranks_cpu(resources: ResourceWindow, ranks: Iterable[int]) -> float | None:
    """The host's share taken by its training ranks' own processes (their process CPU, each a
    fraction of the CPUs available to it, summed), or None unless every one of them measured it."""
    total = 0.0
    ranks = tuple(ranks)
    for rank in ranks:
        rr = resources.ranks.get(rank)
        value = None if rr is None else rr.figures.get(CPU_UTILIZATION)
        if value is None:
            return None
        total += float(value)
    return min(1.0, total) if ranks else None


def host_cpu_sentence(host_cpu: dict) -> str:
    """What an input finding adds about its hosts' CPUs (the advice follows the state)."""
    if host_cpu["state"] == HOST_CPU_RANKS_BUSY:
        return (f"; the host CPUs were {host_cpu['utilization']:.0%} busy, {host_cpu['ranks_cpu']:.0%} of them "
                "the training ranks' own processes (a rank waiting in a collective can spin there), so "
                "the CPU figures say nothing about more DataLoader workers")
    if host_cpu["state"] == HOST_CPU_SATURATED:
        return (f"; the host CPUs were {host_cpu['utilization']:.0%} busy, so more DataLoader workers will not "
                "help: make the input pipeline cheaper or move work off the host")
    idle = host_cpu.get("idle_cpus")
    spare = f"about {idle:g} CPUs idle" if idle is not None else "idle CPU time"
    return (f"; the host CPUs were {host_cpu['utilization']:.0%} busy ({spare}), so more DataLoader "
            "workers can help")


def _mib(value: float) -> str:
    return f"{value / 2**20:,.1f} MiB"
