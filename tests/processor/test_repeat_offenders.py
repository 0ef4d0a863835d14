"""Repeat offenders across runs (issue 35 item 2): the culprit history, the finding, the fleet
listing and its Prometheus series, recording rules and alert over two processor replicas.

Runs are the harness's (`harness.host_runs`): two ranks in TraceML's wire format over
OTLP/HTTP, rank 0 an input straggler whose resource claims the culprit host, then both end
markers, so each processor summarises the run at once. Replica A gets three runs whose
culprit sits on host-a (the third is flagged), one on host-b and one on host-c; replica B
two more on host-c: host-c reaches the alert's threshold only when the replicas are summed.
"""
from __future__ import annotations

import io
import json
import shutil

import pytest

from harness.host_runs import send_straggler_run
from harness.processor_process import ProcessorProcess
from harness.prometheus_server import PrometheusServer
from harness.waiting import wait_until
from traceml.processor import fleet
from traceml.schema import diagnosis as d

RULES = __import__("pathlib").Path(__file__).resolve().parents[2] / "deploy/prometheus/rules/traceml.rules.yml"
REPLICA_A_RUNS = (("ro-1", "host-a"), ("ro-2", "host-a"), ("ro-3", "host-a"), ("ro-4", "host-b"),
                  ("ro-5", "host-c"))
GPU = {"ro-1": "GPU-0a1b", "ro-2": "GPU-0a1b", "ro-3": "GPU-0a1b"}
"""The host-a culprit's GPU (NVML's `hw.id` on its resource metrics): the same one each time."""
REPLICA_B_RUNS = (("ro-6", "host-c"), ("ro-7", "host-c"))
FLAGS = ["--repeat-offender-runs", "3", "--repeat-offender-window", "5"]


def _summarise(replica: ProcessorProcess, runs) -> dict[str, dict]:
    out = {}
    for i, (run_id, host) in enumerate(runs):
        send_straggler_run(replica.http, run_id, host, f"victim-{run_id}", culprit_gpu=GPU.get(run_id))
        path = replica.summary_dir / run_id / "final_summary.json"
        # The culprit is recorded right after the summary file is written: wait for both before the
        # next run, whose rule reads that record.
        assert wait_until(lambda: path.exists() and f"run {run_id!r} ended" in replica.log_text(), 60, 0.05), \
            replica.log_text()[-3000:]
        out[run_id] = json.loads(path.read_text())
    return out


@pytest.fixture(scope="module")
def fleet_runs(tmp_path_factory):
    if shutil.which("prometheus") is None:
        pytest.skip("needs prometheus (apt-get install prometheus)")
    root = tmp_path_factory.mktemp("repeat_offenders")
    a = ProcessorProcess(root / "a", extra_args=FLAGS).start()
    b = ProcessorProcess(root / "b", extra_args=FLAGS).start()
    try:
        summaries = {**_summarise(a, REPLICA_A_RUNS), **_summarise(b, REPLICA_B_RUNS)}
        with PrometheusServer(root / "prometheus", [f"127.0.0.1:{a.prom}", f"127.0.0.1:{b.prom}"],
                              job="traceml-processor", rule_files=[RULES]) as prom:
            prom.wait_for('traceml:fleet_host_flagged_runs:sum{traceml_host="host-c"} == 3')
            assert wait_until(lambda: _firing(prom, {"host-a", "host-c"}), 60, 0.5), prom.api("alerts")
            alerts = _firing(prom, {"host-a", "host-c"})
            yield {"a": a, "b": b, "summaries": summaries, "prom": prom, "alerts": alerts,
                   "recorded": {r["metric"]["traceml_host"]: float(r["value"][1])
                                for r in prom.query("traceml:fleet_host_flagged_runs:sum")},
                   "metrics_a": a.metrics_text()}
    finally:
        a.stop()
        b.stop()


def _firing(prom: PrometheusServer, hosts: set[str]):
    firing = [alert for alert in prom.api("alerts")["alerts"]
              if alert["labels"].get("alertname") == "TraceMLRepeatOffenderHost" and alert["state"] == "firing"]
    return firing if {alert["labels"]["traceml_host"] for alert in firing} >= hosts else None


def _repeat(summary: dict) -> list[dict]:
    return [issue for issue in summary["issues"] if issue["kind"] == d.REPEAT_OFFENDER_HOST]


@pytest.mark.slow
def test_the_third_run_on_the_same_host_is_flagged_and_no_other(fleet_runs):
    summaries = fleet_runs["summaries"]
    for run_id in summaries:
        assert summaries[run_id]["issues"][0]["kind"] == d.INPUT_STRAGGLER, run_id
        assert summaries[run_id]["issues"][0]["culprit_rank"] == 0
    [issue] = _repeat(summaries["ro-3"])
    assert issue["culprit_rank"] == 0 and issue["severity"] == d.SEVERITY_WARN
    evidence = issue["evidence"]
    # The GPU the resource metrics named was the culprit in the same three runs.
    assert evidence["host"] == "host-a" and evidence["device"] == GPU["ro-3"]
    assert evidence["device_flagged_runs"] == ["ro-3", "ro-2", "ro-1"]
    assert evidence["flagged_runs"] == ["ro-3", "ro-2", "ro-1"] and evidence["min_flagged_runs"] == 3
    # The lost time is the ledger's straggler wait, summed over the three runs.
    ledger_waits = [summaries[r]["badput"]["run"]["causes"]["straggler_wait"]["rank_seconds"]
                    for r in ("ro-1", "ro-2", "ro-3")]
    assert all(w and w > 0 for w in ledger_waits)
    assert evidence["lost_rank_seconds"] == pytest.approx(sum(ledger_waits), rel=1e-3)
    assert "host host-a (GPU GPU-0a1b)" in issue["summary"] and "3 of its last 3 runs" in issue["summary"]
    # Fewer than three on one host, a run on another host, and host-c split over two replicas: none.
    for run_id in ("ro-1", "ro-2", "ro-4", "ro-5", "ro-6", "ro-7"):
        assert _repeat(summaries[run_id]) == [], run_id


@pytest.mark.slow
def test_the_series_and_the_alert_aggregate_across_replicas(fleet_runs):
    assert fleet_runs["recorded"] == {"host-a": 3.0, "host-b": 1.0, "host-c": 3.0}
    firing = {alert["labels"]["traceml_host"] for alert in fleet_runs["alerts"]}
    assert firing == {"host-a", "host-c"}  # host-b (one run) never; host-c only as A + B
    text = fleet_runs["metrics_a"]
    assert 'traceml_fleet_host_flagged_runs{traceml_host="host-c"} 1.0' in text
    assert 'traceml_fleet_host_runs{traceml_host="host-a"} 3.0' in text
    # One series per culprit host and name: victims' hosts and runs make none.
    assert "victim-" not in text and "ro-1" not in "".join(l for l in text.splitlines() if "fleet" in l)


@pytest.mark.slow
def test_traceml_fleet_and_the_web_page_list_hosts_by_runs_flagged(fleet_runs):
    from traceml.launcher import fleet as fleet_cli
    from traceml.processor.web.app import WebApp
    from traceml.processor.web.feed import RunFeed

    a = fleet_runs["a"]
    out = io.StringIO()
    assert fleet_cli.main(["--db", str(a.db)], out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[2].split()[:4] == ["host-a", "-", "3", "3"]  # host, gpu, runs flagged, runs seen
    assert lines[3].split()[:2] == ["GPU-0a1b", "3"]  # its GPU's line: the culprit's GPU in all three
    assert [line.split()[0] for line in lines[2:]] == ["host-a", "GPU-0a1b", "host-b", "host-c"]
    out = io.StringIO()
    assert fleet_cli.main(["--db", str(a.db), "--json"], out=out) == 0
    listing = json.loads(out.getvalue())
    assert listing[0]["host"] == "host-a" and listing[0]["latest_runs"] == ["ro-3", "ro-2", "ro-1"]
    assert listing[0]["lost_rank_seconds"] > 0

    page = WebApp(RunFeed(a.db)).handle("GET", "/ui/fleet", "", {})
    assert page.status == 200
    html = page.body.decode()
    assert html.index(">host-a<") < html.index(">host-b<") < html.index(">host-c<")


def test_a_gpu_that_repeats_on_a_host_is_named_and_a_cuda_index_never_is():
    def record(run_id, device):
        return fleet.CulpritRecord(run_id, 3, d.INPUT_STRAGGLER, "node-9", fleet.machine_device(device), 0.0,
                                   10.0, 0.002)

    history = [fleet.HostRun("old-2", 2.0, True, ("GPU-aaaa",), 10.0, 0.002),
               fleet.HostRun("old-1", 1.0, True, ("GPU-bbbb",), 10.0, 0.002),
               fleet.HostRun("old-0", 0.5, True, ("GPU-aaaa",), 10.0, 0.002)]
    offence = fleet.repeat_offence(record("now", "GPU-aaaa"), history, k=3, n=5)
    assert offence is not None and offence.device == "GPU-aaaa"
    assert offence.device_flagged_runs == ("now", "old-2", "old-0")
    assert offence.lost_device_hours == pytest.approx(0.008)
    assert fleet.machine_device("cuda:0") == "" and fleet.machine_device("index:1") == ""
    # N bounds the runs counted: with N = 2 only this run and the newest other one count.
    assert fleet.repeat_offence(record("now", "GPU-aaaa"), history, k=3, n=2) is None
    # Unflagged runs of the host count against it.
    quiet = [fleet.HostRun(f"q{i}", float(i), False) for i in range(4)]
    assert fleet.repeat_offence(record("now", ""), quiet + history, k=3, n=5) is None


def test_wire_strings_in_the_fleet_listing_are_escaped_on_the_page_and_the_terminal(tmp_path):
    """Host and GPU names come from the wire: markup stays text on the page, control sequences
    are spelled out on the terminal, and the JSON keeps the true strings."""
    from traceml.launcher import fleet as fleet_cli
    from traceml.processor.sqlite_writer import StepTimeStore
    from traceml.processor.web.app import WebApp
    from traceml.processor.web.feed import RunFeed
    import time

    db = tmp_path / "traceml.db"
    host, gpu = "<script>alert(1)</script>\x1b[2J", "GPU-<i>"
    with StepTimeStore(db) as store:
        store.record_culprits("r1", [fleet.CulpritRecord("r1", 0, d.INPUT_STRAGGLER, host, gpu, time.time(), 5.0, None)])
    html = WebApp(RunFeed(db)).handle("GET", "/ui/fleet", "", {}).body.decode()
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "GPU-&lt;i&gt;" in html
    listing = json.loads(WebApp(RunFeed(db)).handle("GET", "/ui/api/fleet", "", {}).body)
    assert [(e["host"], e["device"], e["runs_flagged"]) for e in listing] == [(host, "", 1), (host, gpu, 1)]
    out = io.StringIO()
    assert fleet_cli.main(["--db", str(db)], out=out) == 0
    assert "\x1b" not in out.getvalue() and "\\x1b[2J" in out.getvalue()


def test_the_finding_takes_its_place_in_the_diagnosis_order():
    """A warn repeat-offender finding goes after every crit finding and before lower warn scores,
    whatever the straggler finding it repeats ranks as; the others keep their order."""
    import dataclasses

    from traceml.processor.diagnosis.api import issue_order_key
    from traceml.processor.step_time.model import DiagnosisIssue, StepTimeDiagnosis

    issues = (DiagnosisIssue(d.INPUT_STRAGGLER, d.SEVERITY_CRIT, d.STATUS_CONFIRMED, 0.7, "s", culprit_rank=0),
              DiagnosisIssue(d.INPUT_BOUND, d.SEVERITY_CRIT, d.STATUS_CONFIRMED, 0.35, "b"),
              DiagnosisIssue(d.RESIDUAL_HEAVY, d.SEVERITY_WARN, d.STATUS_CONFIRMED, 0.12, "r"))
    analysis = dataclasses.make_dataclass("A", [("diagnosis", object)], frozen=True)(StepTimeDiagnosis(issues))
    offence = fleet.repeat_offence(fleet.CulpritRecord("now", 0, d.INPUT_STRAGGLER, "h", "", 0.0, 1.0, None),
                                   [fleet.HostRun("a", 1.0, True), fleet.HostRun("b", 0.5, True)], k=3, n=5)
    out = fleet.with_repeat_offences(analysis, [offence]).diagnosis.issues
    assert [i.kind for i in out] == [d.INPUT_STRAGGLER, d.INPUT_BOUND, d.REPEAT_OFFENDER_HOST, d.RESIDUAL_HEAVY]
    assert [issue_order_key(i) for i in out] == sorted(issue_order_key(i) for i in out)
