"""Real `traceml run` launches on a named host, exporting to a processor the caller runs.

A rank's `host.name` is its machine's hostname (`socket.gethostname()`, exporter/identity.py;
TraceML's identity keys win over OTEL_RESOURCE_ATTRIBUTES), so a test that needs runs on
"host-a" and "host-b" gives each launch a host of its own: a UTS namespace
(`unshare --uts`) whose hostname is set before `traceml run` starts, so the launcher, both
ranks and everything they report name that host. Nothing else is separated: the network is
this machine's loopback. That hostname resolves nowhere, so the launch tells torch's
elastic agent to use 127.0.0.1 (`--local-addr`) and gloo to use the loopback
(GLOO_SOCKET_IFNAME=lo), as a cluster's DNS would.

The job is `traceml demo`'s workload (`harness.fake_gpu_demo`: a fake GPU on the ranks
`gpus` names, see `harness.fake_gpu`), 2 gloo ranks, `--standalone` rendezvous on a free
port, TraceML's OTLP to `endpoint` (no embedded processor). Needs root or CAP_SYS_ADMIN:
`uts_namespaces_unavailable()` says why not, for a skip.
"""
from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from harness.child_python import ROOT
from harness.fake_gpu import FAKE_GPUS_ENV, fake_gpus_value

TRACEML = Path(sys.executable).with_name("traceml")
RESOURCE_INTERVAL_S = "0.1"
"""The resource sampler's interval (5 s by default): a run of a few seconds still sends samples."""


@dataclass(frozen=True)
class HostLaunch:
    """One finished launch: its exit code, output, wall time and the CPU seconds of its processes."""

    run_id: str
    host: str
    returncode: int
    output: str
    wall_s: float
    cpu_s: float


def uts_namespaces_unavailable() -> str | None:
    """None when this process can make a UTS namespace and name its host, else why not."""
    if shutil.which("unshare") is None:
        return "util-linux's `unshare` is not installed"
    try:
        done = subprocess.run(["unshare", "--uts", "hostname", "traceml-uts-probe"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run unshare: {exc}"
    if done.returncode != 0:
        return f"cannot create a UTS namespace (needs root/CAP_SYS_ADMIN): {done.stderr.strip()}"
    return None


def launch_on_host(host: str, endpoint: str, run_id: str, cwd: Path, *, scenario: str = "input-straggler",
                   steps: int = 24, gpus: Mapping[int, str] | None = None, nproc: int = 2,
                   timeout_s: float = 300) -> HostLaunch:
    """`traceml run` of the demo workload on `host`, exporting OTLP/gRPC to `endpoint`; waits for it."""
    cwd.mkdir(parents=True, exist_ok=True)
    env = {k: val for k, val in os.environ.items()
           if not k.startswith(("OTEL_", "TRACEML_", "PET_", "TORCHELASTIC_", "HARNESS_"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TRACEML_RESOURCE_INTERVAL=RESOURCE_INTERVAL_S,
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    if gpus:
        env[FAKE_GPUS_ENV] = fake_gpus_value(gpus)
    command = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host,
               str(TRACEML), "run", "--standalone", "--nproc-per-node", str(nproc), "--local-addr", "127.0.0.1",
               "--endpoint", endpoint, "--run-id", run_id, "--no-summary-print",
               "-m", "harness.fake_gpu_demo", "--scenario", scenario, "--steps", str(steps)]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s,
                          stdin=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    output = done.stdout + done.stderr
    (cwd / "launch.log").write_text(output)  # kept beside the run for a failure read later
    return HostLaunch(run_id, host, done.returncode, output, time.monotonic() - start, cpu_s)


__all__ = ["HostLaunch", "RESOURCE_INTERVAL_S", "TRACEML", "launch_on_host", "uts_namespaces_unavailable"]
