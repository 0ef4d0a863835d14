"""Diagnosis agreement with the original TraceML: the same injected scenarios under both tools.

    .venv/bin/python -m checks.peers_agreement [--steps 200] [--scenarios ...] [--json]

Each scenario of `traceml demo` (launcher/demo_workload.py: balanced, input-bound,
input-straggler, compute-straggler; the delays calibrated on the machine, the
last rank the straggler) runs as a real 2-rank CPU job on gloo, once under this
project's `traceml run` and once under the original's `traceml run` (the peer
environment of benchmarks/bench_peers.py, built there once; the workload's
`import traceml` is served by a shim that calls the original's
`init(mode="auto")` and `trace_step`, as its own demos do). The order of the
two tools alternates between scenarios.

Read from each tool's own final_summary.json: ours `diagnosis.kind` and
`culprit_rank`; the original's `step_time.diagnosis.kind` and its culprit
(`evidence.culprit_rank`, else its `ranks`). Judged against what `traceml demo`
expects of each scenario (launcher/demo.py's EXPECTED: the one owner of what
each scenario should produce). Printed: one table of what each tool said, and
whether it is what the scenario injected. The collective-wait scenarios are not
in the demo workload yet, so they are not run here.

Exit status 0 when both tools ran every scenario (a wrong diagnosis is a
finding, reported in the table, not a failure of the check); 1 when a run failed.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_peers import build_peers, run_job
from benchmarks.json_output import add_json_flag, print_json, table_output
from traceml.launcher.demo import EXPECTED
from traceml.launcher.demo_workload import SCENARIOS

STRAGGLER = 1  # the workload's default straggler on 2 ranks: the last rank


def ours_said(summary: dict) -> dict:
    d = summary.get("diagnosis") or {}
    return {"kind": d.get("kind"), "culprit_rank": d.get("culprit_rank"), "summary": d.get("summary") or d.get("reason")}


def original_said(summary: dict) -> dict:
    d = (summary.get("step_time") or {}).get("diagnosis") or {}
    evidence = d.get("evidence") or {}
    culprit = evidence.get("culprit_rank")
    if culprit is None and d.get("ranks"):
        culprit = d["ranks"][0]
    return {"kind": d.get("kind"), "culprit_rank": culprit, "summary": d.get("summary")}


def judged(scenario: str, said: dict) -> bool:
    expected = EXPECTED[scenario]
    if said["kind"] not in expected.kinds:
        return False
    return not expected.culprit_is_straggler or said["culprit_rank"] == STRAGGLER


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per run (default 200)")
    parser.add_argument("--scenarios", nargs="*", choices=SCENARIOS, default=list(SCENARIOS))
    add_json_flag(parser)
    args = parser.parse_args(argv)
    rows, failed = [], False
    with table_output(args.json):
        stamp = build_peers()
        print(f"original TraceML: traceml-ai {stamp['versions']['traceml-ai']}; 2 ranks, gloo, {args.steps} steps")
        with tempfile.TemporaryDirectory(prefix="peers-agreement-") as tmp:
            for i, scenario in enumerate(args.scenarios):
                row = {"scenario": scenario, "expected": list(EXPECTED[scenario].kinds),
                       "straggler_rank": STRAGGLER if EXPECTED[scenario].culprit_is_straggler else None}
                for tool in (("ours", "original") if i % 2 == 0 else ("original", "ours")):
                    try:
                        run = run_job(tool, Path(tmp) / tool, scenario, scenario, args.steps)
                    except Exception as exc:  # reported, the other runs go on
                        print(f"  {scenario}, {tool}: run failed: {exc}", flush=True)
                        row[tool] = {"kind": None, "culprit_rank": None, "summary": f"run failed: {exc}"[:300],
                                     "correct": False}
                        failed = True
                        continue
                    said = (ours_said if tool == "ours" else original_said)(run["summary"])
                    said["correct"] = judged(scenario, said)
                    said["wall_s"] = run["wall_s"]
                    row[tool] = said
                    print(f"  {scenario}, {tool}: {said['kind']} (culprit {said['culprit_rank']}), "
                          f"{'as injected' if said['correct'] else 'NOT what was injected'}; {said['summary']}",
                          flush=True)
                rows.append(row)
        print(f"\n{'scenario':18s} {'expected':28s} {'ours':28s} {'original':28s}")
        for row in rows:
            cells = []
            for tool in ("ours", "original"):
                said = row[tool]
                rank = f" r{said['culprit_rank']}" if said["culprit_rank"] is not None else ""
                cells.append(f"{said['kind']}{rank} {'ok' if said['correct'] else 'WRONG'}")
            rank = f" r{row['straggler_rank']}" if row["straggler_rank"] is not None else ""
            print(f"{row['scenario']:18s} {' or '.join(row['expected']) + rank:28s} {cells[0]:28s} {cells[1]:28s}")
    if args.json:
        print_json("peers_agreement", args, {"traceml_ai": stamp["versions"]["traceml-ai"], "scenarios": rows})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
