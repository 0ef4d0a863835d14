"""`traceml demo` scenarios, and the surfaces that read their results (live, summary, top, compare).

Each demo scenario injects a real bottleneck into a 2-rank gloo run; the final
diagnosis must name it (and the injected rank). The recorded runs are then
reused: `summary` rebuilds them, `top` reads their database, `compare`
compares two of them, and the compute straggler's run, made with `--live` in a real
terminal, is also the one whose live view is checked (one run, not a second one
for the terminal).
"""
from __future__ import annotations

import json
import re
import sys

import pytest

from tests.launcher.launcher_helpers import TRACEML, TracemlRun, clean_env, traceml

STEPS = "60"  # >= 20 aligned steps, so findings are confirmed; each run takes ~15-25 s here

# In running order: the two scenarios that share the machine first, then the two that run alone
# (tests/serial_tests.py) right before the balanced run's ledger test that runs alone too, so the
# three hold the machine in one stretch instead of waiting twice for the other worker's test to end.
EXPECTED = {
    "input-bound": ({"INPUT_BOUND"}, None),
    "compute-straggler": ({"COMPUTE_STRAGGLER"}, 1),
    # Nothing injected: no input bottleneck or straggler; findings about the machine may lead
    # (gloo's all-reduce waiting for a core; a neighbour slowing every rank alike).
    "balanced": ({"BALANCED", "COMPUTE_BOUND", "COLLECTIVE_BOUND", "STEP_TIME_DRIFT"}, None),
    "input-straggler": ({"INPUT_STRAGGLER"}, 1),
}


IN_A_TERMINAL = "compute-straggler"
"""The scenario whose shared run is made with `--live` in a real terminal: its verdict does not
depend on the machine being quiet, so the terminal test needs no run of its own, nor the machine
to itself."""


def _demo_in_a_terminal(folder, scenario: str) -> TracemlRun:
    """`traceml demo --live` in a pseudo-terminal (60 x 160): its exit status and all it drew."""
    import pexpect

    folder.mkdir(parents=True, exist_ok=True)
    child = pexpect.spawn(str(TRACEML), ["demo", "--scenario", scenario, "--steps", STEPS, "--live"],
                          cwd=str(folder), env=clean_env(TERM="xterm-256color"), encoding="utf-8",
                          timeout=240, dimensions=(60, 160))
    child.expect(pexpect.EOF)
    child.close()
    return TracemlRun(child.exitstatus, child.before, folder)


def _has_pexpect() -> bool:
    try:
        import pexpect  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    """scenario -> finished demo run, each launched once for the whole module."""
    cache = {}

    def get(scenario: str):
        if scenario not in cache:
            workdir = tmp_path_factory.mktemp(scenario)
            if scenario == IN_A_TERMINAL and _has_pexpect():
                cache[scenario] = _demo_in_a_terminal(workdir, scenario)
            else:
                extra = ["--live"] if scenario == "input-bound" else []  # plain live lines (not a TTY)
                cache[scenario] = traceml(["demo", "--scenario", scenario, "--steps", STEPS, *extra], workdir)
        return cache[scenario]

    return get


@pytest.mark.parametrize("scenario", list(EXPECTED))
@pytest.mark.slow
def test_demo_diagnosis_names_the_injected_problem_and_rank(demo_runs, scenario, tmp_path):
    run = demo_runs(scenario)
    if scenario == "balanced" and run.returncode == 1 and "STRAGGLER" in run.summary["diagnosis"]["kind"]:
        # Nothing is injected, so "balanced" is only as balanced as this shared 2-core
        # machine: a rank starved of CPU by other jobs for the whole run is a real
        # straggler. One fresh run must then come out balanced.
        run = traceml(["demo", "--scenario", scenario, "--steps", STEPS], tmp_path)
    assert run.returncode == 0, run.output[-4000:]
    kinds, culprit = EXPECTED[scenario]
    diagnosis = run.summary["diagnosis"]
    assert diagnosis["kind"] in kinds, run.output[-4000:]
    if culprit is not None:
        assert diagnosis["culprit_rank"] == culprit
        assert diagnosis["severity"] == "crit" and diagnosis["status"] == "confirmed"
    assert run.summary["global"]["window"]["steps"] == int(STEPS)
    assert "[traceml] OK:" in run.output


def _balanced(demo_runs, tmp_path):
    """The shared balanced run, or, when this shared machine starved one of its ranks for the whole
    run (a real straggler: the verdict test above reruns it too), one fresh run."""
    run = demo_runs("balanced")
    if any("STRAGGLER" in issue["kind"] for issue in run.summary["issues"]):
        run = traceml(["demo", "--scenario", "balanced", "--steps", STEPS], tmp_path)
    return run


@pytest.mark.slow
def test_a_balanced_runs_ledger_is_near_zero(demo_runs, tmp_path):
    """Nothing injected: no rank's lateness and no input costs anything worth naming. Its
    communication (gloo's all-reduce on two busy cores) and this machine's drift still cost time,
    and the ledger says so; together they stay far below the straggler's loss."""
    plain = _balanced(demo_runs, tmp_path).summary["badput"]
    slow = demo_runs("input-straggler").summary["badput"]
    causes = plain["window"]["causes"]
    shares = {c: causes[c]["share"] for c in causes}

    def attributable(ledger):  # per step: what a late rank or the input cost
        own = ledger["window"]["causes"]
        return sum(own[c]["rank_seconds"] or 0.0 for c in ("straggler_wait", "input_stall", "h2d")) \
            / ledger["window"]["steps"]

    # Under the straggler rule's warn level (10 % of the victim's step, over two ranks: 5 % of rank-time).
    assert shares["straggler_wait"] <= 0.05, shares
    assert causes["straggler_wait"]["culprit_rank"] is None, shares
    assert sum(shares[c] or 0.0 for c in ("straggler_wait", "input_stall", "h2d")) <= 0.20, shares
    assert attributable(plain) <= 0.25 * attributable(slow), (shares, slow["window"]["causes"])
    assert not [w for w in plain["what_if"] if "STRAGGLER" in w["kind"] or w["kind"] == "INPUT_BOUND"]
    per_step = plain["window"]["total_rank_seconds"] / plain["window"]["steps"]
    assert per_step <= 0.5 * slow["window"]["total_rank_seconds"] / slow["window"]["steps"], (shares, slow)


@pytest.mark.slow
def test_an_injected_input_stragglers_ledger_attributes_most_lost_time_to_it(demo_runs):
    """Issue 35: the input straggler's badput ledger and what-if on the demo. Whether the what-if
    predicts a second run of the same job without the delay is held on a job whose step is
    device-like (tests/launcher/test_collective_diagnosis.py): here the ranks' compute shares two
    cores, so the run without the delay is slower per rank than the straggler's others were."""
    slow = demo_runs("input-straggler").summary
    ledger = slow["badput"]
    window = ledger["window"]
    what_if = next(w for w in ledger["what_if"] if w["kind"] == "INPUT_STRAGGLER")
    assert what_if["culprit_rank"] == 1 and window["causes"]["straggler_wait"]["culprit_rank"] == 1
    # Most of the time the run lost is the straggler's: the others' wait for it and its own input stall.
    assert what_if["lost_rank_seconds"] >= 0.5 * window["total_rank_seconds"], ledger
    # The delay is about 1.5 plain steps: at the median the step is more than 1.5x faster.
    assert 1.5 <= what_if["speedup_low"] <= what_if["speedup"] <= what_if["speedup_high"], what_if
    assert ledger["devices_known"] == 0 and ledger["run"]["total_device_hours"] is None  # CPU: none known
    assert "What if: INPUT_STRAGGLER (rank 1) at the median" in slow["card"]
    assert "device-hours: none known" in slow["card"]


@pytest.mark.slow
def test_live_without_a_terminal_prints_plain_progress_lines(demo_runs):
    run = demo_runs("input-bound")
    lines = [line for line in run.output.splitlines() if re.match(r"\[traceml\] step \d+ \[", line)]
    assert lines, run.output[-4000:]
    assert "INPUT_BOUND" in lines[-1]
    assert "\x1b[" not in run.output  # no terminal control codes in a log


@pytest.mark.slow
def test_live_view_in_a_real_terminal_shows_the_diagnosis(demo_runs, tmp_path):
    pytest.importorskip("pexpect")
    run = demo_runs(IN_A_TERMINAL)  # made with --live in a pseudo-terminal
    status, output = run.returncode, run.output
    if status == 1 and "[traceml] MISMATCH" in output:
        # This test is about the terminal, not the verdict (test_demo_diagnosis_... judges that):
        # on a machine busy enough to blur the injected problem, the demo exits 1. One fresh run
        # must draw and pass.
        again = _demo_in_a_terminal(tmp_path / "again", IN_A_TERMINAL)
        status, output = again.returncode, again.output
    assert status == 0, output[-4000:]
    live_part, _, final_part = output.partition("TraceML Step Time summary")
    assert final_part, output[-4000:]
    # Frames of the Rich live panel, drawn before the final card.
    assert "freshness: live" in live_part
    assert "Step Time" in live_part and "median ms" in live_part
    assert "COMPUTE_STRAGGLER" in live_part


@pytest.mark.slow
def test_summary_rebuilds_the_same_result_from_the_run_folder(demo_runs, tmp_path):
    run = demo_runs("input-straggler")
    original = run.summary
    rebuilt = traceml(["summary", str(run.run_dir), "--out", str(tmp_path), "--json"], run.cwd)
    assert rebuilt.returncode == 0, rebuilt.output
    again = json.loads((tmp_path / "final_summary.json").read_text())
    for section in ("diagnosis", "issues", "global", "groups"):
        assert again[section] == original[section]
    assert (tmp_path / "summary_card.txt").exists()
    assert json.loads(rebuilt.output)["metadata"]["run_id"] == original["metadata"]["run_id"]


@pytest.mark.slow
def test_summary_reports_a_path_without_data_clearly(tmp_path):
    result = traceml(["summary", str(tmp_path)], tmp_path)
    assert result.returncode == 2
    assert "holds no TraceML database" in result.output


@pytest.mark.slow
def test_top_reads_a_processor_database(demo_runs):
    run = demo_runs("compute-straggler")
    top = traceml(["top", "--db", str(run.run_dir / "traceml.sqlite"), "--once"], run.cwd)
    assert top.returncode == 0, top.output
    assert "COMPUTE_STRAGGLER" in top.output
    assert run.summary["metadata"]["run_id"] in top.output


@pytest.mark.slow
def test_compare_marks_the_diagnosis_and_input_wait_changes_as_material(demo_runs):
    a, b = demo_runs("balanced"), demo_runs("input-straggler")
    result = traceml(["compare", str(a.run_dir), str(b.run_dir / "final_summary.json"), "--json"], a.cwd)
    assert result.returncode == 0, result.output
    report = json.loads(result.output)
    assert report["diagnosis"]["b"]["kind"] == "INPUT_STRAGGLER"
    assert "kind" in report["diagnosis"]["changed"] and report["diagnosis"]["material"]
    step = next(m for m in report["metrics"] if m["name"] == "step_time_ms" and m["statistic"] == "median")
    assert step["material"] and step["delta"] > 0  # the straggler slows every rank's step
    assert "Diagnosis: " not in result.output  # --json prints JSON only
    lost = next(d for d in report["badput"] if d["name"] == "lost_time" and d["statistic"] == "share")
    assert lost["b"] > lost["a"] and lost["material"]  # lost time before and after (issue 35)

    table = traceml(["compare", str(a.run_dir), str(b.run_dir)], a.cwd)
    assert table.returncode == 0
    assert "INPUT_STRAGGLER" in table.output and "Material changes:" in table.output
    assert "Lost time" in table.output and "Lost to straggler wait" in table.output
    gate = traceml(["compare", str(a.run_dir), str(b.run_dir), "--fail-on-material"], a.cwd)
    assert gate.returncode == 1
    same = traceml(["compare", str(b.run_dir), str(b.run_dir), "--fail-on-material"], a.cwd)
    assert same.returncode == 0 and "Material changes: none" in same.output


@pytest.mark.slow
def test_compare_thresholds_on_a_recorded_summary(demo_runs):
    """Below the documented thresholds a change is shown but not material; above, it is."""
    import copy

    from traceml.launcher.compare import compare

    base = demo_runs("balanced").summary

    def with_step(summary: dict, step_ms: float) -> dict:
        other = copy.deepcopy(summary)
        other["global"]["median"]["step_time_ms"]["value"] = step_ms
        return other

    # The documented floor: 5 % of the step, and never below 1 ms. Both regimes, set on
    # the recorded summary (the demo's own step time depends on this machine's speed).
    for step, floor in ((40.0, 2.0), (8.0, 1.0)):
        a = with_step(base, step)
        small = compare(a, with_step(a, step + 0.9 * floor))
        assert not small.material_changes, (step, small.material_changes)
        delta = next(m for m in small.metrics if m.name == "step_time_ms" and m.statistic == "median").delta
        assert delta == pytest.approx(0.9 * floor)
        large = compare(a, with_step(a, step + 1.1 * floor))
        assert large.material_changes == ("Step Time median",), step

    gpu = copy.deepcopy(base)
    gpu["memory"]["peak_allocated_bytes"] = {"value": 2 * 2**30, "rank": 0}
    appeared = compare(base, gpu)
    assert "Peak allocated peak" in appeared.material_changes  # available on one side only

    unmeasured = copy.deepcopy(base)
    unmeasured["global"]["median"]["forward_ms"]["value"] = None
    coverage = compare(base, unmeasured)
    forward = next(m for m in coverage.metrics if m.name == "forward_ms")
    assert forward.note == "measured in A only" and not forward.material

    newer = copy.deepcopy(base)
    newer["schema_version"] = "2.0"
    assert any("schema versions differ" in w for w in compare(base, newer).warnings)


def test_compare_refuses_files_that_are_not_summaries(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    result = traceml(["compare", str(bad), str(bad)], tmp_path)
    assert result.returncode == 2 and "not a TraceML final summary" in result.output
