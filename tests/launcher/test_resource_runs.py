"""Resource findings end to end: `traceml run` on real scripts, the resource sampler on each rank,
the embedded processor storing and analysing what it sent, the one final summary.

The scripts import nothing of TraceML. The sampler's interval is shortened (the default is 5 s)
so that a run of a few seconds carries enough samples; everything else is as a user runs it.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.launcher.launcher_helpers import SCRIPTS, traceml

SCRIPT = str(SCRIPTS / "resource_loop.py")
INTERVAL = {"TRACEML_RESOURCE_INTERVAL": "0.1"}


def _run(workdir, *args: str, nproc: int = 1):
    run = traceml(["run", "--nproc-per-node", str(nproc), SCRIPT, *args], workdir, timeout=300, **INTERVAL)
    assert run.returncode == 0, run.output[-3000:]
    return run.summary


def _issues(summary, kind):
    return [i for i in summary["issues"] if i["kind"] == kind]


@pytest.mark.slow
def test_a_run_that_leaks_host_memory_gets_memory_creep_with_its_onset(workdir):
    summary = _run(workdir, "--steps", "120", "--leak-from", "40", "--leak-mb", "8")
    creep = _issues(summary, "MEMORY_CREEP")
    assert creep, summary["issues"]
    evidence = creep[0]["evidence"]
    assert evidence["signal"] == "rss" and evidence["rank"] == 0, evidence
    assert abs(evidence["onset_step"] - 40) <= 6, evidence
    # 8 MiB kept per step: the fitted slope is the leak, within the sampler's resolution.
    assert 6 * 2**20 <= evidence["slope_bytes_per_step"] <= 10 * 2**20, evidence
    rss = summary["resources"]["global"]["ranks"]["rss_bytes"]["worst"]["value"]
    assert rss is not None and rss > 500 * 2**20, summary["resources"]["global"]


@pytest.mark.slow
def test_a_steady_run_gets_no_memory_creep_and_its_figures_are_measured(workdir):
    summary = _run(workdir, "--steps", "120")
    assert not _issues(summary, "MEMORY_CREEP"), summary["issues"]
    figures = summary["resources"]["global"]["ranks"]
    assert figures["cpu_utilization"]["median"]["value"] is not None, figures
    assert figures["rss_bytes"]["median"]["value"] > 0, figures
    assert figures["gpu_utilization"]["median"]["value"] is None, figures  # no GPU here: absent, not 0


def _burners(n: int):
    """n processes that burn a core each, in the idle scheduling class: they take every cycle the
    run leaves (the host is saturated by someone else) without slowing the run itself, which at
    the same priority would crawl through its start-up (torch's import on every process)."""
    burn = "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True: pass"
    return [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(n)]


@pytest.mark.slow
def test_an_input_bound_run_beside_a_cpu_burning_neighbour_is_told_the_cpus_are_saturated(workdir):
    burners = _burners(os.cpu_count() or 2)  # one per core: the host is saturated by someone else
    try:
        busy = _run(workdir, "--steps", "50", "--input-sleep", "0.06", "--step-sleep", "0.005")
    finally:
        for proc in burners:
            proc.kill()
            proc.wait()
    bound = _issues(busy, "INPUT_BOUND")
    assert bound, busy["issues"]
    host_cpu = bound[0]["evidence"]["host_cpu"]
    assert host_cpu["state"] == "saturated", host_cpu
    assert "will not help" in bound[0]["summary"], bound[0]

    (workdir / "quiet").mkdir()
    quiet = _run(workdir / "quiet", "--steps", "50", "--input-sleep", "0.06", "--step-sleep", "0.005")
    calm = _issues(quiet, "INPUT_BOUND")[0]["evidence"]["host_cpu"]
    assert calm["utilization"] < host_cpu["utilization"], (calm, host_cpu)
    if calm["utilization"] < calm["threshold"]:  # on a machine nobody else is using, always
        assert calm["state"] == "spare", calm
