"""Repeat offenders across runs (issue 35 item 2): the culprit history, the finding, the fleet
listing and its Prometheus series, recording rules and alert over two processor replicas, and
the badput ledger's device-hours of runs whose ranks have GPUs.

Replica A, a real `traceml-processor`, gets four real runs, one after the other
(`harness.host_launches`: `traceml run` of the demo workload, 2 gloo ranks, rank 1 an input
straggler, TraceML's OTLP sent to A): three on host-a, one on host-b, each launch in a UTS
namespace whose hostname is its host (a rank's `host.name` is its hostname). The host-a runs'
ranks have GPUs, faked where nothing else can be (`harness.fake_gpu`: NVML and the CUDA device
the resource sampler reads): rank 1 the same GPU each time, rank 0 another. The third host-a
run is flagged, with rank 1's GPU; host-b's is not.

The replicas' sum is the recording rules' business, not the runs': for it, harness senders
(`harness.host_runs`: TraceML's wire format built by hand, rank 0 the input straggler, cheap)
put one host-c run on A and two on B, so host-c reaches the alert's threshold only when a real
Prometheus with the repository's rules sums the replicas; it fires for host-a (the real runs)
and host-c, never host-b.
"""
from __future__ import annotations

import io
import json
import shutil

import pytest

from harness.host_launches import launch_on_host, uts_namespaces_unavailable
from harness.host_runs import send_straggler_run
from harness.processor_process import ProcessorProcess
from harness.prometheus_server import PrometheusServer
from harness.waiting import wait_until
from traceml.processor import fleet
from traceml.schema import diagnosis as d

RULES = __import__("pathlib").Path(__file__).resolve().parents[2] / "deploy/prometheus/rules/traceml.rules.yml"
CULPRIT_GPU = "GPU-5a1e0000-0000-4000-8000-00000000a001"
VICTIM_GPU = "GPU-5a1e0000-0000-4000-8000-00000000a000"
HOST_A_GPUS = {0: VICTIM_GPU, 1: CULPRIT_GPU}
"""The host-a runs' GPUs by rank (NVML UUIDs): the culprit, rank 1, is on the same one each time."""
REAL_RUNS = (("ra-1", "host-a"), ("ra-2", "host-a"), ("ra-3", "host-a"), ("rb-1", "host-b"))
STEPS = 24
"""Aligned steps per real run: a straggler finding is confirmed from 20 (DiagnosisPolicy.crit_min_steps),
and only a confirmed culprit is recorded; a few more in case the window leaves a step out."""
REPLICA_A_SENT = (("ro-5", "host-c"),)
REPLICA_B_SENT = (("ro-6", "host-c"), ("ro-7", "host-c"))
FLAGS = ["--repeat-offender-runs", "3", "--repeat-offender-window", "5"]


def _summary(replica: ProcessorProcess, run_id: str, sender_output: str = "") -> dict:
    path = replica.summary_dir / run_id / "final_summary.json"
    # The culprit is recorded right after the summary file is written: wait for both before the
    # next run, whose rule reads that record.
    assert wait_until(lambda: path.exists() and f"run {run_id!r} ended" in replica.log_text(), 60, 0.05), \
        (replica.log_text()[-3000:], sender_output[-3000:])
    return json.loads(path.read_text())


def _launch(replica: ProcessorProcess, root, runs) -> tuple[dict[str, dict], dict[str, float]]:
    out, cpu = {}, {}
    for run_id, host in runs:
        launch = launch_on_host(host, f"http://127.0.0.1:{replica.grpc}", run_id, root / run_id, steps=STEPS,
                                gpus=HOST_A_GPUS if host == "host-a" else None)
        assert launch.returncode == 0, launch.output[-3000:]
        out[run_id] = _summary(replica, run_id, launch.output)
        cpu[run_id] = round(launch.cpu_s, 1)
    return out, cpu


def _send(replica: ProcessorProcess, runs) -> dict[str, dict]:
    out = {}
    for run_id, host in runs:
        send_straggler_run(replica.http, run_id, host, f"victim-{run_id}")
        out[run_id] = _summary(replica, run_id)
    return out


@pytest.fixture(scope="module")
def fleet_runs(tmp_path_factory):
    if shutil.which("prometheus") is None:
        pytest.skip("needs prometheus (apt-get install prometheus)")
    reason = uts_namespaces_unavailable()
    if reason is not None:
        pytest.skip(f"the real runs need a host each: {reason}")
    root = tmp_path_factory.mktemp("repeat_offenders")
    a = ProcessorProcess(root / "a", extra_args=FLAGS).start()
    b = ProcessorProcess(root / "b", extra_args=FLAGS).start()
    try:
        real, cpu = _launch(a, root / "launches", REAL_RUNS)
        print(f"real runs' CPU seconds (launcher and ranks): {cpu}")
        summaries = {**real, **_send(a, REPLICA_A_SENT), **_send(b, REPLICA_B_SENT)}
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


def _straggler(summary: dict) -> dict:
    return next(issue for issue in summary["issues"] if issue["kind"] in d.STRAGGLER_KINDS)


@pytest.mark.slow
def test_the_third_real_run_on_the_same_host_is_flagged_with_its_gpu_and_no_other(fleet_runs):
    summaries = fleet_runs["summaries"]
    # Each real run's culprit, rank 1, is confirmed (the only culprits recorded). Which straggler
    # kind names it is the straggler rule's call: on a busy machine both ranks' loaders wait, and
    # the injected input delay may no longer cover the gap (STRAGGLER beside INPUT_BOUND).
    for run_id, _ in REAL_RUNS:
        straggler = _straggler(summaries[run_id])
        assert (straggler["culprit_rank"], straggler["status"]) == (1, d.STATUS_CONFIRMED), \
            (run_id, summaries[run_id]["issues"])
    for run_id, _ in REPLICA_A_SENT + REPLICA_B_SENT:
        assert _straggler(summaries[run_id])["culprit_rank"] == 0, run_id
    [issue] = _repeat(summaries["ra-3"])
    assert issue["culprit_rank"] == 1 and issue["severity"] == d.SEVERITY_WARN
    evidence = issue["evidence"]
    # The GPU rank 1's NVML named was the culprit in the same three runs; rank 0's GPU never is.
    assert evidence["host"] == "host-a" and evidence["device"] == CULPRIT_GPU
    assert evidence["device_flagged_runs"] == ["ra-3", "ra-2", "ra-1"]
    assert evidence["flagged_runs"] == ["ra-3", "ra-2", "ra-1"] and evidence["min_flagged_runs"] == 3
    # The lost time is the ledger's straggler wait over each run, summed over the three runs,
    # in rank-seconds and (the ranks' GPUs being known) device-hours.
    waits = [summaries[r]["badput"]["run"]["causes"]["straggler_wait"] for r in ("ra-1", "ra-2", "ra-3")]
    assert all(w["rank_seconds"] and w["rank_seconds"] > 0 and w["culprit_rank"] == 1 for w in waits), waits
    assert evidence["lost_rank_seconds"] == pytest.approx(sum(w["rank_seconds"] for w in waits), abs=2e-3)
    # (the summary writes a finding's evidence to 4 decimals, final_summary._json_safe)
    assert evidence["lost_device_hours"] == pytest.approx(sum(w["device_hours"] for w in waits), abs=5.1e-5)
    assert evidence["lost_device_hours"] > 0
    assert f"host host-a (GPU {CULPRIT_GPU})" in issue["summary"] and "3 of its last 3 runs" in issue["summary"]
    assert "device-hours lost" in issue["summary"]
    # Fewer than three on one host, a run on another host, and host-c split over two replicas: none.
    for run_id in ("ra-1", "ra-2", "rb-1", "ro-5", "ro-6", "ro-7"):
        assert _repeat(summaries[run_id]) == [], run_id


@pytest.mark.slow
def test_the_ledger_counts_device_hours_for_the_ranks_whose_gpus_nvml_named(fleet_runs):
    """Both host-a ranks had a GPU: every cause's device-hours are its rank-seconds over 3,600
    (one device per rank); host-b's ranks had none: rank-seconds only, device-hours unknown."""
    summaries = fleet_runs["summaries"]
    for run_id in ("ra-1", "ra-2", "ra-3"):
        summary = summaries[run_id]
        badput = summary["badput"]
        assert badput["devices_known"] == 2, (run_id, badput)
        # The GPUs were NVML's and the resource sampler's only: the steps were timed on the CPU clock.
        assert _straggler(summary)["evidence"]["clock"] == "cpu"
        gpu = summary["resources"]["global"]["ranks"]["gpu_utilization"]
        assert gpu["measured"] == 2 and gpu["median"]["value"] == pytest.approx(0.93), (run_id, gpu)
        for part in ("window", "run"):
            ledger = badput[part]
            assert ledger["total_rank_seconds"] > 0, (run_id, part, ledger)
            assert ledger["total_device_hours"] == pytest.approx(ledger["total_rank_seconds"] / 3600, abs=2e-6)
            for cause, figures in ledger["causes"].items():
                if figures["rank_seconds"] is None:  # not measured (restarts in the window)
                    assert figures["device_hours"] is None, (run_id, part, cause)
                    continue
                assert figures["device_hours"] == pytest.approx(figures["rank_seconds"] / 3600, abs=2e-6), \
                    (run_id, part, cause, figures)
        for what_if in badput["what_if"]:
            if what_if["lost_rank_seconds"] is not None:
                assert what_if["lost_device_hours"] == pytest.approx(what_if["lost_rank_seconds"] / 3600, abs=2e-6)
    plain = summaries["rb-1"]["badput"]
    assert plain["devices_known"] == 0 and plain["run"]["total_rank_seconds"] > 0, plain
    assert plain["run"]["total_device_hours"] is None
    assert all(c["device_hours"] is None for c in plain["run"]["causes"].values()), plain["run"]


@pytest.mark.slow
def test_the_series_and_the_alert_aggregate_across_replicas(fleet_runs):
    assert fleet_runs["recorded"] == {"host-a": 3.0, "host-b": 1.0, "host-c": 3.0}
    firing = {alert["labels"]["traceml_host"] for alert in fleet_runs["alerts"]}
    assert firing == {"host-a", "host-c"}  # host-b (one run) never; host-c only as A + B
    text = fleet_runs["metrics_a"]
    assert 'traceml_fleet_host_flagged_runs{traceml_host="host-c"} 1.0' in text
    assert 'traceml_fleet_host_runs{traceml_host="host-a"} 3.0' in text
    # One series per culprit host and name: victims' hosts, runs and GPUs make none.
    fleet_lines = "".join(line for line in text.splitlines() if "fleet" in line)
    assert "victim-" not in text and "ra-1" not in fleet_lines and "GPU-" not in fleet_lines


@pytest.mark.slow
def test_traceml_fleet_and_the_web_page_list_hosts_by_runs_flagged(fleet_runs):
    from traceml.launcher import fleet as fleet_cli
    from traceml.processor.web.app import WebApp
    from traceml.processor.web.feed import RunFeed

    a = fleet_runs["a"]
    out = io.StringIO()
    assert fleet_cli.main(["--db", str(a.db)], out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[2].split()[:4] == ["host-a", "-", "3", "3"], lines  # host, gpu, runs flagged, runs seen
    assert lines[3].split()[:2] == [CULPRIT_GPU, "3"], lines  # its culprit's GPU in all three; rank 0's none
    out = io.StringIO()
    assert fleet_cli.main(["--db", str(a.db), "--json"], out=out) == 0
    listing = json.loads(out.getvalue())
    assert listing[0]["host"] == "host-a" and listing[0]["latest_runs"] == ["ra-3", "ra-2", "ra-1"]
    assert listing[0]["lost_rank_seconds"] > 0 and listing[0]["lost_device_hours"] > 0
    # host-b and host-c were flagged once each: the one whose culprit cost more comes first.
    once = sorted((e for e in listing if e["host"] in ("host-b", "host-c")), key=lambda e: -e["lost_rank_seconds"])
    order = ["host-a", CULPRIT_GPU, *(e["host"] for e in once)]
    assert [line.split()[0] for line in lines[2:]] == order, lines
    assert [e["device"] or e["host"] for e in listing] == order, listing

    page = WebApp(RunFeed(a.db)).handle("GET", "/ui/fleet", "", {})
    assert page.status == 200
    html = page.body.decode()
    assert html.index(">host-a<") < html.index(f">{order[2]}<") < html.index(f">{order[3]}<")
    assert CULPRIT_GPU in html and VICTIM_GPU not in html


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
