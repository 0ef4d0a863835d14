"""`traceml demo`: a self-contained CPU run whose diagnosis names a bottleneck we injected.

It launches `demo_workload.py` on 2-4 gloo ranks through exactly the machinery
of `traceml run` (torch's elastic launcher, the per-rank bootstrap, the
embedded processor, the final summary), then checks the final diagnosis
against the scenario it injected and says whether TraceML found it.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, TextIO

from traceml.launcher import run_dir as rd
from traceml.launcher.demo_workload import SCENARIOS
from traceml.schema.diagnosis import (
    BALANCED,
    COLLECTIVE_BOUND,
    COMPUTE_BOUND,
    COMPUTE_STRAGGLER,
    INPUT_BOUND,
    INPUT_STRAGGLER,
    STEP_TIME_DRIFT,
)

WORKLOAD = Path(__file__).with_name("demo_workload.py")


@dataclass(frozen=True, slots=True)
class Expectation:
    kinds: tuple[str, ...]  # any of these as the primary diagnosis
    culprit_is_straggler: bool  # the culprit rank must be the injected rank
    story: str


EXPECTED: dict[str, Expectation] = {
    # Nothing is injected, so no input, H2D or residual bottleneck and no straggler may be
    # named. What describes the machine rather than the workload may be: COLLECTIVE_BOUND (gloo's
    # all-reduce on a CPU whose cores the ranks already fill waits for a core, a few ms a step on
    # 2 cores) and STEP_TIME_DRIFT (a neighbour that starts mid-run slows every rank alike).
    "balanced": Expectation((BALANCED, COMPUTE_BOUND, COLLECTIVE_BOUND, STEP_TIME_DRIFT), False,
                            "nothing injected: no input bottleneck or straggler should be reported"),
    "input-bound": Expectation((INPUT_BOUND,), False,
                               "every rank's DataLoader sleeps before each batch"),
    "input-straggler": Expectation((INPUT_STRAGGLER,), True,
                                   "one rank's DataLoader sleeps before each batch; the others wait for it"),
    "compute-straggler": Expectation((COMPUTE_STRAGGLER,), True,
                                     "one rank does extra matmuls in forward; the others wait for it"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="traceml demo",
        description="Run a tiny CPU DDP job (gloo) with an injected bottleneck and show that "
                    "TraceML's diagnosis finds it. Needs no GPU and no network; takes under a minute.")
    parser.add_argument("--scenario", choices=SCENARIOS, default="input-straggler",
                        help="the bottleneck to inject (default input-straggler)")
    parser.add_argument("--nproc", type=int, default=2, help="number of ranks, 2 to 4 (default 2)")
    parser.add_argument("--steps", type=int, default=150, help="training steps per rank (default 150)")
    parser.add_argument("--straggler-rank", type=int, default=None,
                        help="rank that gets the slowdown in straggler scenarios (default: the last)")
    live = parser.add_mutually_exclusive_group()
    live.add_argument("--live", dest="live", action="store_true", default=None,
                      help="show the live view (default when stdout is a terminal)")
    live.add_argument("--no-live", dest="live", action="store_false", help="no live view")
    parser.add_argument("--runs-dir", default=rd.DEFAULT_RUNS_DIR,
                        help="where run folders go (default ./traceml_runs)")
    parser.add_argument("--run-id", default=None, help="run id (default: generated)")
    return parser


def run_arguments(options: argparse.Namespace, live: bool) -> list[str]:
    """The `traceml run` command line the demo stands for (printed, then executed)."""
    argv = ["--standalone", "--nproc-per-node", str(options.nproc),
            "--runs-dir", str(options.runs_dir)]
    if options.run_id:
        argv += ["--run-id", options.run_id]
    if live:
        argv.append("--live")
    argv += [str(WORKLOAD), "--scenario", options.scenario, "--steps", str(options.steps)]
    if options.straggler_rank is not None:
        argv += ["--straggler-rank", str(options.straggler_rank)]
    return argv


def verdict(scenario: str, straggler_rank: int, diagnosis: dict | None) -> tuple[bool, str]:
    """Did the final diagnosis name the injected problem (and rank)?"""
    expected = EXPECTED[scenario]
    if not diagnosis:
        return False, "no diagnosis was produced"
    kind = diagnosis.get("kind")
    culprit = diagnosis.get("culprit_rank")
    if kind not in expected.kinds:
        return False, f"expected {' or '.join(expected.kinds)}, got {kind}"
    if expected.culprit_is_straggler and culprit != straggler_rank:
        return False, f"{kind} found, but culprit rank {culprit} instead of rank {straggler_rank}"
    if scenario == "balanced":
        if kind in (COLLECTIVE_BOUND, STEP_TIME_DRIFT):
            return True, (f"nothing injected and no input bottleneck or straggler named; {kind} describes "
                          "this machine (gloo's all-reduce waiting for a CPU core, or a neighbour slowing "
                          "every rank alike), not the workload")
        return True, f"nothing injected and no bottleneck reported ({kind})"
    where = f" on rank {culprit}" if expected.culprit_is_straggler else ""
    return True, f"TraceML found the injected problem: {kind}{where}"


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    out = out or sys.stdout
    parser = build_parser()
    options = parser.parse_args(list(argv))
    if not 2 <= options.nproc <= 4:
        parser.error("--nproc must be between 2 and 4")
    if options.steps < 10:
        parser.error("--steps must be at least 10")
    straggler = options.nproc - 1 if options.straggler_rank is None else options.straggler_rank
    if not 0 <= straggler < options.nproc:
        parser.error("--straggler-rank must be a rank of the run")
    live = options.live if options.live is not None else out.isatty()

    import os

    from traceml.launcher import run

    # One thread per rank (the workload sets it too); setting it here also spares the
    # user torchrun's OMP_NUM_THREADS banner.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_argv = run_arguments(options, live)
    print(f"[traceml] demo '{options.scenario}': {EXPECTED[options.scenario].story}", file=out)
    print(f"[traceml] equivalent to: traceml run {' '.join(run_argv)}", file=out, flush=True)
    args, run_options = run.parse(run_argv)
    result = run.launch(args, run_options, out=out)
    if result.exit_code != 0:
        print(f"[traceml] demo run failed with exit code {result.exit_code}", file=out, flush=True)
        return result.exit_code
    diagnosis = result.report.diagnosis if result.report is not None else None
    ok, message = verdict(options.scenario, straggler, diagnosis)
    print(f"[traceml] {'OK' if ok else 'MISMATCH'}: {message}", file=out, flush=True)
    return 0 if ok else 1
