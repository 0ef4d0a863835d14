"""Diagnosis agreement with the original TraceML: the same injected scenarios under both tools.

    .venv/bin/python -m checks.peers_agreement [--steps 200] [--scenarios ...] [--json]

Two sets of scenarios, each a real multi-rank CPU job on gloo, run once under this
project's `traceml run` and once under the original's `traceml run` (the peer
environment of benchmarks/lib/peers.py, built once and shared with bench_peers); the order of the two
tools alternates between scenarios.

- The four of `traceml demo` (launcher/demo_workload.py: balanced, input-bound,
  input-straggler, compute-straggler; 2 ranks, the delays calibrated on the machine,
  the last rank the straggler). The workload's `import traceml` is served, for the
  original, by benchmarks/lib/peers.py's shim, which calls the original's `init(mode="auto")` and
  `trace_step`, as its own demos do. Judged against launcher/demo.py's EXPECTED (the
  one owner of what each demo scenario should produce).
- The collective-wait ones of tests/launcher/scripts/collective_ddp.py, a DDP script
  that imports nothing of TraceML (our steps come from its optimizer updates; the
  original marks each loop iteration as a step through checks/original_step_runner.py):
  a rank slowed inside backward, a job that all-reduces 16 MiB a step, and a job that
  slows down half way, at the length tests/launcher/test_collective_diagnosis.py runs
  it (60 steps) and at 300, where the original's trend can speak (it needs 200 points
  after trimming a 10 % warm-up: at least 223 steps). Judged against COLLECTIVE_CASES
  below, which say what those tests assert of ours: the finding among the run's issues
  (as the primary diagnosis where the tests ask for that), the rank it names or that
  no finding names one, the onset within ONSET_TOLERANCE steps.

Read from each tool's own final_summary.json: ours `diagnosis` and `issues`; the
original's `step_time.diagnosis` and `step_time.issues` (a rank is its culprit only in
its straggler kinds: elsewhere its `ranks` holds the slowest rank, which no rule
blamed). Also the `Trend:` note of the original's summary diagnosis, recomputed from
its store by its own StepTimePipeline: the note is on its diagnosis object (its
step-time renderer prints it) but its final_summary.json and .txt leave it out.

Each tool's answer is judged: `ok` (what was injected); `WRONG` (a demo scenario: a
kind EXPECTED does not allow, or the wrong rank; a collective case: a rank blamed that
was not slowed); `missed` (nothing false said, the injected problem not named);
`partly` (a drift the original's trend note calls a rising step or residual time,
with no onset). The original's own vocabulary (its DiagnosisKind) is read from its
package and printed, so a kind it has no word for shows as such.

Exit status 0 when both tools ran every scenario (a wrong diagnosis is a finding,
reported in the table, not a failure of the check); 1 when a run failed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.lib.peers import PEER_PYTHON, ROOT, build_peers, peer_env, run_job
from benchmarks.lib.json_output import add_json_flag, print_json, table_output
from traceml.launcher.demo import EXPECTED
from traceml.launcher.demo_workload import SCENARIOS
from traceml.schema.diagnosis import (COLLECTIVE_BOUND, COMPUTE_STRAGGLER, STEP_TIME_DRIFT,
                                      STRAGGLER_KINDS)

STRAGGLER = 1  # the demo workload's default straggler on 2 ranks: the last rank
COLLECTIVE_SCRIPT = ROOT / "tests" / "launcher" / "scripts" / "collective_ddp.py"
ORIGINAL_RUNNER = ROOT / "checks" / "original_step_runner.py"
ONSET_TOLERANCE = 2  # steps, as tests/launcher/test_collective_diagnosis.py allows


@dataclass(frozen=True)
class CollectiveCase:
    """One collective_ddp.py job and what a right diagnosis of it says."""

    story: str
    nproc: int
    args: tuple[str, ...]
    kind: str
    culprit_rank: int | None  # the rank to name; None: no rank may be named by any finding
    primary: bool  # the finding must be the primary diagnosis, not only among the issues
    onset_step: int | None = None


COLLECTIVE_CASES: dict[str, CollectiveCase] = {
    "ddp-compute-straggler": CollectiveCase(
        "rank 2 of 3 sleeps 40 ms in backward (a gradient hook, before DDP's all-reduce); the others wait in it",
        3, ("--steps", "100", "--slow-rank", "2", "--delay", "0.04"), COMPUTE_STRAGGLER, 2, True),
    "collective-bound": CollectiveCase(
        "every rank all-reduces 16 MiB each step, nobody late",
        2, ("--steps", "100", "--allreduce-mb", "16"), COLLECTIVE_BOUND, None, False),
    "drift-60": CollectiveCase(
        "every rank sleeps 30 ms more per step from step 30 of 60",
        2, ("--steps", "60", "--drift-from", "30", "--drift-delay", "0.03"), STEP_TIME_DRIFT, None, False, 30),
    "drift-300": CollectiveCase(
        "every rank sleeps 30 ms more per step from step 150 of 300",
        2, ("--steps", "300", "--drift-from", "150", "--drift-delay", "0.03"), STEP_TIME_DRIFT, None, False, 150),
}
ALL_SCENARIOS = (*SCENARIOS, *COLLECTIVE_CASES)


def _finding(kind, culprit, onset=None, summary=None) -> dict:
    return {"kind": kind, "culprit_rank": culprit, "onset_step": onset, "summary": summary}


def ours_said(summary: dict) -> dict:
    d = summary.get("diagnosis") or {}
    findings = [_finding(i.get("kind"), i.get("culprit_rank"), (i.get("evidence") or {}).get("onset_step"),
                         i.get("summary")) for i in summary.get("issues") or []]
    ranks = {}
    for group in summary.get("groups") or []:
        m = group.get("metrics") or {}
        ranks[str(group.get("global_rank"))] = {k: m.get(k) for k in
                                                ("step_time_ms", "backward_ms", "residual_ms", "collective_wait_ms")}
    return {"kind": d.get("kind"), "culprit_rank": d.get("culprit_rank"),
            "summary": d.get("summary") or d.get("reason"), "findings": findings, "note": None, "ranks": ranks}


def _original_culprit(d: dict):
    """The rank the original blames: only its straggler kinds name one (elsewhere `ranks` is the slowest)."""
    if d.get("kind") not in STRAGGLER_KINDS:
        return None
    evidence = d.get("evidence") or {}
    if evidence.get("culprit_rank") is not None:
        return evidence["culprit_rank"]
    return d["ranks"][0] if d.get("ranks") else None


def original_said(summary: dict) -> dict:
    section = summary.get("step_time") or {}
    d = section.get("diagnosis") or {}
    findings = [_finding(i.get("kind"), _original_culprit(i), None, i.get("summary"))
                for i in section.get("issues") or []]
    ranks = {}
    for rank, row in ((section.get("groups") or {}).get("rows") or {}).items():
        m = row.get("metrics") or {}
        ranks[rank] = {k: m.get(k) for k in ("step_time_ms", "backward_ms", "residual_ms")}
    return {"kind": d.get("kind"), "culprit_rank": _original_culprit(d), "summary": d.get("summary"),
            "findings": findings, "note": None, "ranks": ranks,
            "slowest_rank": (d.get("ranks") or [None])[0]}


def judged_demo(scenario: str, said: dict) -> str:
    expected = EXPECTED[scenario]
    if said["kind"] not in expected.kinds:
        return "WRONG"
    if expected.culprit_is_straggler and said["culprit_rank"] != STRAGGLER:
        return "WRONG"
    return "ok"


def judged_collective(case: CollectiveCase, said: dict) -> str:
    if any(f["culprit_rank"] not in (None, case.culprit_rank) for f in said["findings"]) \
            or said["culprit_rank"] not in (None, case.culprit_rank):
        return "WRONG"  # a rank blamed that was not slowed (with the right finding or without it)
    findings = said["findings"] if not case.primary else [_finding(said["kind"], said["culprit_rank"])]
    for f in findings:
        if f["kind"] != case.kind or f["culprit_rank"] != case.culprit_rank:
            continue
        if case.onset_step is not None and (f["onset_step"] is None
                                            or abs(f["onset_step"] - case.onset_step) > ONSET_TOLERANCE):
            continue
        return "ok"
    if case.kind == STEP_TIME_DRIFT and said["note"] and re.search(r"time is (worsening|rising)", said["note"]):
        return "partly"
    return "missed"


# The original's summary diagnosis, recomputed from its own store by its own pipeline: its
# trend note lives on the diagnosis object (its live renderers print it), and its
# final_summary.json and .txt leave it out.
_ORIGINAL_NOTE = """
import json, sqlite3, sys
from traceml_ai.step_time import pipeline
from traceml_ai.step_time.model import StepTimeLoadRequest
from traceml_ai.step_time.sqlite import SQLiteStepTimeRepository
with sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True) as conn:
    conn.row_factory = sqlite3.Row
    analysis = pipeline.StepTimePipeline(repository=SQLiteStepTimeRepository(conn), profile="summary").run(
        StepTimeLoadRequest(window_size=10_000, lookback_factor=1))
primary = analysis.diagnosis.primary
print(json.dumps({"kind": primary.kind, "note": primary.note}))
"""


def original_note(run_folder: Path) -> str | None:
    """The `Trend:` note of the original's summary diagnosis of this run, if it has one."""
    out = subprocess.run([str(PEER_PYTHON), "-c", _ORIGINAL_NOTE, str(run_folder / "aggregator" / "telemetry")],
                         env=peer_env(), capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return None
    note = json.loads(out.stdout.strip().splitlines()[-1]).get("note") or ""
    trend = re.search(r"Trend: .*", note)
    return trend.group(0) if trend else None


def original_vocabulary() -> list[str]:
    """The diagnosis kinds the original can say (its own DiagnosisKind), read from its package."""
    out = subprocess.run([str(PEER_PYTHON), "-c", (
        "import json, typing\n"
        "from traceml_ai.diagnostics.step_time import api\n"
        "print(json.dumps(list(typing.get_args(api.DiagnosisKind))))")],
        env=peer_env(), capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else []


def _cell(said: dict) -> str:
    rank = f" r{said['culprit_rank']}" if said.get("culprit_rank") is not None else ""
    return f"{said['kind']}{rank} {said['verdict']}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per demo-workload run (default 200)")
    parser.add_argument("--scenarios", nargs="*", choices=ALL_SCENARIOS, default=list(ALL_SCENARIOS))
    parser.add_argument("--runs-dir", type=Path, default=None,
                        help="keep every run's folder (its final_summary.json) here (default: a temporary folder)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    rows, failed = [], False
    started = time.perf_counter()
    with table_output(args.json):
        stamp = build_peers()
        vocabulary = original_vocabulary()
        print(f"original TraceML: traceml-ai {stamp['versions']['traceml-ai']} (its diagnosis kinds: "
              f"{', '.join(vocabulary) or 'unread'}); gloo; demo scenarios 2 ranks, {args.steps} steps; "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        with (contextlib.nullcontext(str(args.runs_dir)) if args.runs_dir
              else tempfile.TemporaryDirectory(prefix="peers-agreement-")) as tmp:
            for i, scenario in enumerate(args.scenarios):
                case = COLLECTIVE_CASES.get(scenario)
                if case is None:
                    row = {"scenario": scenario, "injected": EXPECTED[scenario].story,
                           "expected": " or ".join(EXPECTED[scenario].kinds)
                           + (f" r{STRAGGLER}" if EXPECTED[scenario].culprit_is_straggler else "")}
                else:
                    row = {"scenario": scenario, "injected": case.story, "nproc": case.nproc,
                           "expected": case.kind + (f" r{case.culprit_rank}" if case.culprit_rank is not None
                                                    else ", no rank")
                           + (f", onset {case.onset_step}" if case.onset_step is not None else ""),
                           "original_has_kind": case.kind in vocabulary}
                for tool in (("ours", "original") if i % 2 == 0 else ("original", "ours")):
                    try:
                        if case is None:
                            run = run_job(tool, Path(tmp) / tool, scenario, scenario, args.steps)
                        else:
                            script = [str(COLLECTIVE_SCRIPT), *case.args]
                            run = run_job(tool, Path(tmp) / tool, scenario, scenario, 0, nproc=case.nproc,
                                          argv=script if tool == "ours" else [str(ORIGINAL_RUNNER), *script])
                    except Exception as exc:  # reported, the other runs go on
                        print(f"  {scenario}, {tool}: run failed: {exc}", flush=True)
                        row[tool] = {"kind": None, "culprit_rank": None, "summary": f"run failed: {exc}"[:300],
                                     "findings": [], "verdict": "run failed"}
                        failed = True
                        continue
                    said = (ours_said if tool == "ours" else original_said)(run["summary"])
                    if tool == "original":
                        said["note"] = original_note(run["folder"])
                    said["verdict"] = judged_demo(scenario, said) if case is None else judged_collective(case, said)
                    said["wall_s"] = run["wall_s"]
                    row[tool] = said
                    others = [f"{f['kind']}" + (f" r{f['culprit_rank']}" if f["culprit_rank"] is not None else "")
                              + (f" onset {f['onset_step']}" if f["onset_step"] is not None else "")
                              for f in said["findings"]]
                    print(f"  {scenario}, {tool} ({run['wall_s']:.0f} s): {said['kind']} (culprit "
                          f"{said['culprit_rank']}) -> {said['verdict']}; findings [{'; '.join(others)}]"
                          f"{'; ' + said['note'] if said['note'] else ''}; {said['summary']}", flush=True)
                    for f in said["findings"][1:]:
                        print(f"    also {f['kind']}: {f['summary']}", flush=True)
                    print(f"    per rank: {json.dumps(said['ranks'])}", flush=True)
                rows.append(row)
        table = [("scenario", "expected", "ours", "original")] + [
            (row["scenario"], row["expected"], _cell(row["ours"]), _cell(row["original"])) for row in rows]
        widths = [max(len(line[i]) for line in table) for i in range(4)]
        print()
        for line in table:
            print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
        wall = time.perf_counter() - started
        print(f"check took {wall:.0f} s; load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        print_json("peers_agreement", args, {"traceml_ai": stamp["versions"]["traceml-ai"],
                                             "original_kinds": vocabulary, "wall_s": wall, "scenarios": rows})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
