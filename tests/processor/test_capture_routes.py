"""The capture paths on real processors over loopback (issue 33 items 1, 4, 7, 9).

Two `traceml-processor` replicas with one bearer token; the run's spans go to replica A only, as
the scale-out recipe's routing sends a run to one replica. A rank-like poller polls both (as
`TRACEML_CONTROL_ENDPOINT` lists both) and answers from the URL its request came from; the real
`traceml capture` command is given both URLs, B first."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from harness.otlp_payloads import steps_request
from harness.processor_process import ProcessorProcess
from harness.waiting import wait_until
from traceml.schema.capture import (
    CAPTURES_PATH,
    CONTROL_PATH,
    HOST_NAME,
    KIND_HOST,
    KIND_OP,
    CaptureRequest,
    ManualRequest,
    OpTime,
    RankCaptureSummary,
)

pytestmark = pytest.mark.slow

TOKEN = "capture-token"
RUN = "capture-routes-run"
TRACE_CAP = 4096


def call(base: str, method: str, path: str, body: bytes | None = None, token: str | None = TOKEN,
         content_type: str = "application/json") -> tuple[int, bytes]:
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(base + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def summary_of(request: CaptureRequest, step_ms: float, sort_ms: float) -> bytes:
    ops = (OpTime("aten::sort", KIND_OP, 5, sort_ms * 5), OpTime("aten::addmm", KIND_OP, 5, 10.0),
           OpTime(HOST_NAME, KIND_HOST, 5, 2.0))
    return RankCaptureSummary(capture_id=request.capture_id, run_id=request.run_id, rank=request.rank,
                              role=request.role, first_step=40, step_ms=(step_ms,) * request.steps,
                              activities=("cpu",), ops=ops, trace_bytes=100).to_json()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture-replicas")
    token_file = root / "token"
    token_file.write_text(TOKEN)
    flags = ["--auth-token-file", str(token_file), "--capture", "manual",
             "--capture-max-trace-bytes", str(TRACE_CAP), "--capture-deadline", "60"]
    a = ProcessorProcess(root / "a", extra_args=flags, prometheus_port=0)
    b = ProcessorProcess(root / "b", extra_args=flags, prometheus_port=0)
    a.start()
    b.start()
    try:
        base_a, base_b = f"http://127.0.0.1:{a.http}", f"http://127.0.0.1:{b.http}"
        for rank in (0, 1):
            body = steps_request(RUN, rank, range(1, 25)).SerializeToString()
            status, _ = call(base_a, "POST", "/v1/traces", body, content_type="application/x-protobuf")
            assert status == 200
        yield a, b, base_a, base_b
    finally:
        a.stop()
        b.stop()


def test_a_wrong_token_is_refused_and_nothing_is_captured_or_handed_out(replicas):
    a, _, base_a, _ = replicas
    manual = ManualRequest(RUN, 1, 0).to_json()
    for token in ("wrong", None):
        assert call(base_a, "POST", CAPTURES_PATH, manual, token=token)[0] == 401
        assert call(base_a, "GET", f"{CONTROL_PATH}?run_id={RUN}&rank=1", token=token)[0] == 401
        assert call(base_a, "GET", f"{CAPTURES_PATH}?run_id={RUN}", token=token)[0] == 401
    status, body = call(base_a, "GET", f"{CAPTURES_PATH}?run_id={RUN}")
    assert status == 200 and json.loads(body)["captures"] == []
    assert not (a.folder / "traceml.db.captures").exists()


def test_bad_requests_are_answered_400_naming_the_problem_and_an_unknown_run_404(replicas):
    _, _, base_a, _ = replicas
    status, body = call(base_a, "POST", CAPTURES_PATH, b'{"run_id": "x", "rank": -1}')
    assert status == 400 and "'rank' must be >= 0" in json.loads(body)["error"]
    status, body = call(base_a, "POST", CAPTURES_PATH, b"not json")
    assert status == 400 and "not JSON" in json.loads(body)["error"]
    status, body = call(base_a, "POST", CAPTURES_PATH, ManualRequest("no-such-run", 1).to_json())
    assert status == 404 and "not held by this processor" in json.loads(body)["error"]
    assert call(base_a, "GET", f"{CONTROL_PATH}?rank=1")[0] == 400
    assert call(base_a, "GET", f"{CAPTURES_PATH}/c1-nothere")[0] == 404


def test_traceml_capture_given_both_replicas_reaches_the_owner_and_a_rank_polling_both_gets_its_request_there(
        replicas, tmp_path):
    a, b, base_a, base_b = replicas
    handed: dict[str, list] = {base_a: [], base_b: []}
    answered = threading.Event()
    checks: dict[str, object] = {}

    def rank_like_poller():
        """Polls both replicas as a rank does; answers the one that handed the request out."""
        pending = {0: None, 1: None}
        for _ in range(400):
            for rank in (0, 1):
                for base in (base_b, base_a):
                    if pending[rank] is not None:
                        continue
                    status, body = call(base, "GET", f"{CONTROL_PATH}?run_id={RUN}&rank={rank}")
                    if status == 200:
                        pending[rank] = (base, CaptureRequest.from_json(body))
                        handed[base].append(rank)
                    else:
                        assert status == 204
            if all(pending.values()):
                break
            answered.wait(0.05)
        (base, culprit), (_, reference) = pending[1], pending[0]
        capture = f"{CAPTURES_PATH}/{culprit.capture_id}/ranks"
        # A bad summary: 400 naming the problem, nothing stored.
        checks["bad"] = call(base, "POST", f"{capture}/1/summary", b'{"capture_id": "x"}')
        checks["files_after_bad"] = sorted(p.name for p in (a.folder / "traceml.db.captures").rglob("*.json"))
        checks["too_large"] = call(base, "POST", f"{capture}/1/trace", b"\x1f\x8b" + os.urandom(TRACE_CAP),
                                   content_type="application/gzip")[0]
        checks["summary"] = call(base, "POST", f"{capture}/1/summary", summary_of(culprit, 45.0, 20.0))[0]
        checks["trace"] = call(base, "POST", f"{capture}/1/trace", gzip.compress(b'{"traceEvents": []}'),
                               content_type="application/gzip")[0]
        checks["again"] = call(base_a, "POST", CAPTURES_PATH, ManualRequest(RUN, 1, 0).to_json())[0]
        checks["reference"] = call(base, "POST", f"{capture}/0/summary", summary_of(reference, 25.0, 0.0))[0]
        answered.set()

    poller = threading.Thread(target=rank_like_poller, daemon=True)
    poller.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACEML_"))}
    env["TRACEML_OTLP_HEADERS"] = f"authorization=Bearer {TOKEN}"
    cli = subprocess.run([sys.executable, "-m", "traceml.launcher.cli", "capture", "--run", RUN, "--rank", "1",
                          "--reference", "0", "--steps", "5", "--processor", base_b, "--processor", base_a,
                          "--wait", "60"], capture_output=True, text=True, env=env, timeout=120)
    poller.join(30)
    assert answered.is_set(), (checks, cli.stderr, cli.stdout)
    assert cli.returncode == 0, cli.stderr
    assert f"accepted by {base_a}" in cli.stderr
    assert sorted(handed[base_a]) == [0, 1] and handed[base_b] == []  # the owner hands it out, only it
    status, body = checks["bad"]
    assert status == 400 and "capture summary" in json.loads(body)["error"]
    assert checks["files_after_bad"] == ["capture.json"]
    assert checks["too_large"] == 413
    assert (checks["summary"], checks["trace"], checks["reference"]) == (200, 200, 200)
    assert checks["again"] == 409  # one capture of the run at a time
    # The digest, printed: the culprit's extra sort on top, its share of the gap.
    assert "rank 1 vs rank 0 over 5 steps (manual): done" in cli.stdout
    first_row = next(line for line in cli.stdout.splitlines() if "aten::" in line)
    assert "aten::sort" in first_row and "+20.000" in first_row and "100%" in first_row
    # Kept with the run on the owner, nothing on the other replica.
    assert [p.name for p in (a.folder / "traceml.db.captures").rglob("*.pt.trace.json.gz")]
    assert not (b.folder / "traceml.db.captures").exists()
    status, body = call(base_b, "GET", f"{CAPTURES_PATH}?run_id={RUN}")
    assert status == 200 and json.loads(body)["captures"] == []


def test_the_capture_command_says_who_refused_when_no_replica_holds_the_run(replicas):
    _, _, base_a, base_b = replicas
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACEML_"))}
    env["TRACEML_OTLP_HEADERS"] = f"authorization=Bearer {TOKEN}"
    env["TRACEML_CONTROL_ENDPOINT"] = f"{base_a},{base_b}"
    cli = subprocess.run([sys.executable, "-m", "traceml.launcher.cli", "capture", "--run", "nobody\x1b[2J",
                          "--rank", "0"], capture_output=True, text=True, env=env, timeout=60)
    assert cli.returncode == 2
    assert f"{base_a}: 404" in cli.stderr and f"{base_b}: 404" in cli.stderr
    assert "\x1b" not in cli.stderr and "\\x1b" in cli.stderr


def test_a_runs_capture_files_are_removed_when_the_run_leaves_the_processor(tmp_path):
    from harness.processor_service import make_service
    from traceml.processor.capture.files import capture_trace_paths, run_captures_folder

    service = make_service(tmp_path, idle_timeout_s=0.3, capture="manual")
    try:
        service.monitor.retain_ended_s = 0.3  # forgotten this long after its end (600 s in service)
        base = f"http://127.0.0.1:{service.http_port}"
        for rank in (0, 1):
            body = steps_request("leaving", rank, range(1, 5)).SerializeToString()
            assert call(base, "POST", "/v1/traces", body, token=None, content_type="application/x-protobuf")[0] == 200
        assert wait_until(lambda: service.monitor.state("leaving") is not None, 10)
        record = service.captures.request_capture("leaving", 1, 0)
        service.captures.receive_trace(record.capture_id, 1, gzip.compress(b'{"traceEvents": []}'))
        assert capture_trace_paths(service.config.db, "leaving")
        assert wait_until(lambda: service.monitor.state("leaving") is None, 20)
        # The monitor drops the run's state first and then tells the book: wait for both, in either order.
        assert wait_until(lambda: not run_captures_folder(service.config.db, "leaving").exists(), 10)
        assert wait_until(lambda: service.captures.of_run("leaving") == [], 10)
    finally:
        service.stop()
