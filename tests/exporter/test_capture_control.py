"""The rank side of a deep capture (issue 33 items 2 and 3), against a control server of the test's own.

Real single-process training loops (torch, TraceML's instrumentation, its exporter sending to a
real OTLP receiver) whose exporter polls a small HTTP server on loopback playing the processor's
control and capture paths (`schema.capture`). One module-scoped fixture runs every loop once, in
this one torch process, and the tests read what each run left: what the server received, what
the receiver received, the exporter's counters.
"""
from __future__ import annotations

import gzip
import json
import os
import socket
import ssl
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from harness import free_port
from harness.certificates import self_signed
from harness.exporter_records import identity, step_record
from harness.otlp_receiver import OtlpTestReceiver
from traceml.exporter import OtlpStepExporter, resolve_settings
from traceml.exporter.transport import ExportOutcome
from traceml.schema import environment as env_names
from traceml.schema.capture import (
    ANNOTATION_INPUT,
    CAPTURES_PATH,
    CONTROL_PATH,
    HOST_NAME,
    KIND_HOST,
    KIND_INPUT,
    MAX_NAME_CHARS,
    MAX_OPS,
    ROLE_CULPRIT,
    ROLE_REFERENCE,
    CaptureRequest,
    RankCaptureSummary,
)

RUN = "capture-rank-side"
TOKEN = "Bearer s3cret"
AWAY_STEPS = 20


class ControlServer:
    """The processor's control and capture paths, played: GETs answered from `answers` in order (then
    204), every POST kept by its last path segment."""

    def __init__(self, answers: list[bytes] = (), tls: tuple | None = None,
                 statuses: dict | None = None, keepalive_s: float | None = None) -> None:
        self.answers = list(answers)
        self.statuses = {part: list(codes) for part, codes in (statuses or {}).items()}  # part -> POST codes
        self.gets: list[str] = []
        self.posts: dict[str, list[tuple[str, bytes, str]]] = {}
        self.headers: list[dict] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            if keepalive_s is not None:  # HTTP/1.1: the connection stays open until idle this long
                protocol_version = "HTTP/1.1"
                timeout = keepalive_s

            def log_message(self, *args):
                pass

            def _reply(self, status: int, body: bytes = b"") -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                with server.lock:
                    server.gets.append(self.path)
                    server.headers.append(dict(self.headers))
                    answer = server.answers.pop(0) if server.answers else None
                self._reply(204) if answer is None else self._reply(200, answer)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                part = self.path.rsplit("/", 1)[-1]
                with server.lock:
                    server.headers.append(dict(self.headers))
                    codes = server.statuses.get(part)
                    status = codes.pop(0) if codes else 200
                    if status == 200:
                        server.posts.setdefault(part, []).append((self.path, body, self.headers.get("Content-Type", "")))
                self._reply(status, b"{}" if status == 200 else b"no")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        scheme = "http"
        if tls is not None:  # (certificate, key)
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*map(str, tls))
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True).start()

    def part(self, name: str):
        with self.lock:
            return list(self.posts.get(name, []))

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class SilentServer:
    """Accepts connections and never answers (a hung processor)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


def _request(capture_id: str, steps: int, *, rank: int = 0, run_id: str = RUN, max_bytes: int = 16 << 20,
             role: str = ROLE_CULPRIT) -> CaptureRequest:
    return CaptureRequest(capture_id=capture_id, run_id=run_id, rank=rank, role=role, steps=steps,
                          max_trace_bytes=max_bytes)


def _env(receiver: OtlpTestReceiver, control: str | None, run_id: str = RUN) -> dict:
    env = {"TRACEML_OTLP_ENDPOINT": receiver.grpc_endpoint, "TRACEML_RUN_ID": run_id,
           "TRACEML_RESOURCES": "0", "OTEL_BSP_SCHEDULE_DELAY": "50",
           env_names.TRACEML_CONTROL_POLL_INTERVAL: "0.1"}
    if control is not None:
        env[env_names.TRACEML_CONTROL_ENDPOINT] = control
    return env


def _train(env: dict, mode: str, step, until, max_steps: int = 600, after: int = 0) -> dict:
    """Run `step(i)` in a real TraceML session until `until()` holds (then `after` more steps), at most
    `max_steps`; returns the exporter's stats, the steps run and the training-side state seen."""
    import traceml
    from traceml._testing import reset_for_tests
    from traceml.process_state import recording

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    reset_for_tests()
    try:
        traceml.init(mode=mode)
        exporter = traceml._exporter_sink
        steps, extra, fast_seen_off = 0, None, False
        while steps < max_steps:
            step(steps)
            steps += 1
            if mode == "manual" and not recording.fast:
                fast_seen_off = True
            if extra is None and until():
                extra = after
            if extra is not None:
                if extra == 0:
                    break
                extra -= 1
        fast_after = recording.fast
        traceml.shutdown(timeout_s=20.0)
        return {"stats": exporter.stats(), "steps": steps, "done": extra is not None,
                "fast_seen_off": fast_seen_off, "fast_after": fast_after}
    finally:
        reset_for_tests()
        for k, value in saved.items():
            if value is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = value


@pytest.fixture(scope="module")
def runs():
    import torch

    import traceml
    from traceml import deep_capture

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    big = torch.randn(20_000)
    out = {}

    def endless():
        while True:
            yield torch.randn(8, 16)

    loader = iter(traceml.wrap_dataloader(endless()))  # the DataLoader patch's timing path

    def manual_step(_, extra=True):
        x = next(loader)
        with traceml.trace_step(model):
            with traceml.timed_input():
                x = x + torch.randn(8, 16)
            with traceml.timed_forward():
                loss = model(x).sum()
                if extra:
                    torch.sort(big)  # the extra operator the capture must put on top
            with traceml.timed_backward():
                loss.backward()
            with traceml.timed_optimizer_step():
                opt.step()
            opt.zero_grad()

    def batches():
        while True:
            time.sleep(0.003)  # a reader's host time: no operator covers it
            yield torch.randn(8, 16)

    feed = batches()

    def light_step(i):
        manual_step(i, extra=False)

    def inferred_step(_):  # auto mode, no trace_step, no DataLoader: steps end at optimizer updates
        x = next(feed)
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()

    with OtlpTestReceiver() as receiver:
        # 1. A capture: one body that is not JSON, one request for another rank, then a real request.
        capture = _request("cap-1", 4)
        server = ControlServer([b"{not json", _request("cap-other", 4, rank=7).to_json(), capture.to_json()])
        env = {**_env(receiver, server.url), "TRACEML_OTLP_HEADERS": f"authorization={TOKEN}"}
        out["capture"] = SimpleNamespace(
            server=server, request=capture,
            **_train(env, "manual", manual_step, lambda: bool(server.part("trace"))))
        server.close()
        # 2. A processor that is away (a closed port) and one that never answers.
        silent = SilentServer()
        closed = f"http://127.0.0.1:{free_port()}"
        out["away"] = SimpleNamespace(silent=silent, **_train(
            _env(receiver, f"{closed},{silent.url}", run_id=RUN + "-away"), "manual", light_step,
            lambda: False, max_steps=AWAY_STEPS))
        silent.close()
        # 3. No control endpoint configured: nothing polls.
        idle = ControlServer([_request("cap-unset", 2).to_json()])
        out["unset"] = SimpleNamespace(server=idle, **_train(
            _env(receiver, None, run_id=RUN + "-unset"), "manual", light_step, lambda: False, max_steps=10))
        idle.close()
        # 4. Inferred steps of a generator loop, and a run that ends in the middle of its capture.
        ended = _request("cap-end", 50, run_id=RUN + "-end", role=ROLE_REFERENCE, max_bytes=0)
        server = ControlServer([ended.to_json()])
        out["ended"] = SimpleNamespace(server=server, request=ended, **_train(
            _env(receiver, server.url, run_id=RUN + "-end"), "auto", inferred_step,
            deep_capture.busy, after=6))
        server.close()
        receiver.wait_for(lambda: len([k for k in receiver.step_spans() if k[0] == RUN + "-away"]) >= AWAY_STEPS, 10)
        out["spans"] = receiver.step_spans()
    return out


def _summary(run) -> RankCaptureSummary:
    posts = run.server.part("summary")
    assert len(posts) == 1, run.server.posts.keys()
    return RankCaptureSummary.from_json(posts[0][1])


@pytest.mark.slow  # the module\'s real runs: about 5 s on 2 idle cores, torch included
def test_a_requested_capture_uploads_a_summary_whose_top_operator_is_the_extra_one(runs):
    run = runs["capture"]
    summary = _summary(run)
    request = run.request
    assert (summary.capture_id, summary.run_id, summary.rank, summary.role) == (request.capture_id, RUN, 0,
                                                                               ROLE_CULPRIT)
    assert summary.activities == ("cpu",) and "no CUDA activities: the rank runs on CPU" in summary.notes
    top = [op for op in summary.ops if op.kind != KIND_HOST][0]  # the host time depends on the machine's load
    assert (top.name, top.count) == ("aten::sort", request.steps), summary.ops[:5]
    host = [op for op in summary.ops if op.kind == KIND_HOST]
    assert [op.name for op in host] == [HOST_NAME] and host[0].self_ms >= 0
    covered = sum(op.self_ms for op in summary.ops if op.kind != KIND_HOST)
    assert covered + host[0].self_ms == pytest.approx(sum(summary.step_ms), abs=0.01)
    path = run.server.part("summary")[0][0]
    assert path == f"{CAPTURES_PATH}/{request.capture_id}/ranks/0/summary"


@pytest.mark.slow  # the module\'s real runs: about 5 s on 2 idle cores, torch included
def test_the_captured_steps_are_whole_steps_the_rank_exported(runs):
    run = runs["capture"]
    summary = _summary(run)
    assert len(summary.step_ms) == run.request.steps
    captured = range(summary.first_step, summary.first_step + run.request.steps)
    spans = runs["spans"]
    assert all((RUN, 0, step) in spans for step in captured)
    assert summary.first_step + run.request.steps <= run.steps
    for step, ms in zip(captured, summary.step_ms):
        row = spans[(RUN, 0, step)]
        # A captured step runs from the previous step's end to its own: it holds the exported step.
        assert ms >= (row["end"] - row["start"]) / 1e6 - 0.05


@pytest.mark.slow  # the module\'s real runs: about 5 s on 2 idle cores, torch included
def test_the_trace_is_gzip_chrome_json_with_the_input_annotated(runs):
    run = runs["capture"]
    (path, body, kind), = run.server.part("trace")
    assert path.endswith("/ranks/0/trace") and kind == "application/gzip"
    summary = _summary(run)
    assert summary.trace_bytes == len(body) and summary.trace_note is None
    events = json.loads(gzip.decompress(body))["traceEvents"]
    names = {e.get("name") for e in events}
    assert "aten::sort" in names and ANNOTATION_INPUT in names
    inputs = [op for op in summary.ops if op.name == ANNOTATION_INPUT]
    # Each captured step's two input regions: the wrapped loader's next() and timed_input.
    assert len(inputs) == 1 and inputs[0].kind == KIND_INPUT and inputs[0].count == 2 * run.request.steps


@pytest.mark.slow  # the module\'s real runs: about 5 s on 2 idle cores, torch included
def test_the_fast_paths_are_off_only_while_the_capture_records(runs):
    run = runs["capture"]
    assert run.fast_seen_off and run.fast_after


@pytest.mark.slow  # the module\'s real runs: about 5 s on 2 idle cores, torch included
def test_bad_requests_are_ignored_and_counted_and_the_token_header_is_sent(runs):
    run = runs["capture"]
    control = run.stats.control
    assert control.bad_requests == 2 and control.requests == 1 and control.refused == 0
    assert control.uploads == 2 and control.upload_failures == 0 and control.poll_failures == 0
    assert all(g.startswith(f"{CONTROL_PATH}?run_id={RUN}&rank=0") for g in run.server.gets)
    assert not run.server.part("failure")
    # Polls and uploads carry the headers the OTLP exports carry, the token among them.
    assert len(run.server.headers) == len(run.server.gets) + 2
    assert {h.get("authorization") for h in run.server.headers} == {TOKEN}


@pytest.mark.slow  # the module\'s real runs: about 5 s on 2 idle cores, torch included
def test_a_processor_that_is_away_costs_the_training_nothing(runs):
    run = runs["away"]
    assert run.steps == AWAY_STEPS
    exported = [k for k in runs["spans"] if k[0] == RUN + "-away"]
    assert sorted(k[2] for k in exported) == list(range(AWAY_STEPS))
    control = run.stats.control
    assert control.polls == 0 and control.poll_failures >= 2 and control.requests == 0
    assert run.silent.accepted  # the silent one was reached, and its poll timed out


@pytest.mark.slow  # the module\'s real runs: about 5 s on 2 idle cores, torch included
def test_no_poll_without_a_control_endpoint(runs):
    run = runs["unset"]
    assert run.stats.control is None
    assert run.server.gets == [] and run.steps == 10


@pytest.mark.slow  # the module\'s real runs: about 5 s on 2 idle cores, torch included
def test_a_run_that_ends_mid_capture_uploads_the_steps_it_has_with_the_input_before_forward(runs):
    run = runs["ended"]
    summary = _summary(run)
    n = len(summary.step_ms)
    assert 1 <= n < run.request.steps
    assert f"the run ended after {n} of {run.request.steps} captured steps" in summary.notes
    assert summary.role == ROLE_REFERENCE and summary.trace_bytes is None
    assert summary.trace_note == "no raw trace was asked for (max_trace_bytes is 0)"
    assert not run.server.part("trace")
    inputs = [op for op in summary.ops if op.name == ANNOTATION_INPUT]
    # Each captured step's time before its forward (the generator's fetch) is named as input.
    assert len(inputs) == 1 and inputs[0].kind == KIND_INPUT and inputs[0].count == n
    assert inputs[0].self_ms >= 2.5 * n


# --- without torch: the settings, the parked worker, the summary's bounds -------------------


def test_the_control_settings_are_read_and_checked_by_the_exporter_settings(caplog):
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
               env_names.TRACEML_CONTROL_ENDPOINT: " http://a:4318/, ftp://b, https://c:1 ,http://a:4318",
               env_names.TRACEML_CONTROL_POLL_INTERVAL: "0.01"}
    settings = resolve_settings(environ=environ)
    assert settings.control_endpoints == ("http://a:4318", "https://c:1")
    assert settings.control_poll_interval_s == 0.1
    assert "ftp://b" in caplog.text
    settings = resolve_settings(environ={**environ, env_names.TRACEML_CONTROL_POLL_INTERVAL: "soon",
                                         env_names.TRACEML_CONTROL_ENDPOINT: ""})
    assert settings.control_endpoints == () and settings.control_poll_interval_s == 2.0


class _Transport:
    def export(self, signal, request, deadline):
        return ExportOutcome(True)

    def close(self):
        pass


def test_a_parked_exporter_does_not_poll():
    server = ControlServer()
    settings = replace(resolve_settings("http://127.0.0.1:4317", "grpc", environ={}), export_interval_s=0.02,
                       control_endpoints=(server.url,), control_poll_interval_s=0.01)
    exporter = OtlpStepExporter(identity("parked"), settings, instrumentation_drops=lambda: {},
                                transport=_Transport())
    try:
        exporter.on_step_time(step_record(0))
        deadline = time.monotonic() + 10
        while not (server.gets and exporter._parked) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.gets and exporter._parked
        polled = len(server.gets)
        time.sleep(0.3)  # thirty poll intervals with no step: no round, so no poll
        assert len(server.gets) == polled and exporter._parked
        exporter.on_step_time(step_record(1))
        deadline = time.monotonic() + 10
        while len(server.gets) == polled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(server.gets) == polled + 1  # a step flows again: the round polls
    finally:
        exporter.shutdown(2.0)
        server.close()


class _Avg:
    def __init__(self, key, self_us, count=1, device=False, device_us=0.0):
        self.key, self.self_cpu_time_total, self.count = key, self_us, count
        self.device_type = "DeviceType.CUDA" if device else "DeviceType.CPU"
        self.self_device_time_total = device_us
        self.is_user_annotation = False


def test_the_summary_keeps_the_largest_entries_and_always_the_uncovered_host_time():
    from traceml.deep_capture import summary_ops

    averages = [_Avg(f"aten::op{i}", 1000.0 + i) for i in range(MAX_OPS + 20)]
    averages += [_Avg("ProfilerStep#0", 9e9), _Avg("x" * (MAX_NAME_CHARS + 50), 5e6),
                 _Avg("void gemm_kernel<...>", 0.0, count=3, device=True, device_us=4000.0)]
    covered_ms = sum(a.self_cpu_time_total for a in averages[:-1] if not a.key.startswith("Profiler")) / 1000
    ops, left_out = summary_ops(averages, [covered_ms / 2 + 10.0, covered_ms / 2])
    assert len(ops) == MAX_OPS and left_out == MAX_OPS + 20 + 3 - MAX_OPS
    assert ops[0].name == "x" * MAX_NAME_CHARS and all(not op.name.startswith("ProfilerStep") for op in ops)
    host = [op for op in ops if op.kind == KIND_HOST]
    assert len(host) == 1 and host[0].self_ms == pytest.approx(10.0)
    kernel = [op for op in ops if op.name.startswith("void gemm")]
    assert kernel and (kernel[0].kind, kernel[0].self_ms, kernel[0].device_ms) == ("kernel", 0.0, 4.0)
    # Never below zero: more self time than wall time (threads) leaves no host time.
    ops, _ = summary_ops([_Avg("aten::mm", 5000.0)], [1.0])
    assert [op.self_ms for op in ops if op.kind == KIND_HOST] == [0.0]


def test_a_request_the_rank_cannot_take_is_answered_with_a_failure_saying_why(tmp_path):
    """Over TLS, trusting the CA file the exporter's own settings name."""
    from traceml.exporter.control import ControlClient

    request = _request("cap-busy", 3)
    cert, key = self_signed(tmp_path)
    server = ControlServer([request.to_json()], tls=(cert, key))
    settings = replace(resolve_settings("https://127.0.0.1:4317", "grpc",
                                        environ={"OTEL_EXPORTER_OTLP_CERTIFICATE": str(cert)}),
                       control_endpoints=(server.url,), control_poll_interval_s=0.0)
    client = ControlClient(identity(RUN), settings, lambda: None,
                           arm=lambda req, deliver: "another capture is in progress on this rank")
    try:
        client.on_round(1)  # steps arrived: poll, get the request, arm refuses
        client.on_round(2)  # the next round uploads the answer (and polls: a step arrived)
        (path, body, kind), = server.part("failure")
        assert path == f"{CAPTURES_PATH}/cap-busy/ranks/0/failure" and kind == "application/json"
        assert json.loads(body) == {"reason": "another capture is in progress on this rank"}
        stats = client.stats()
        assert (stats.requests, stats.refused, stats.uploads) == (1, 1, 1)
        assert len(server.gets) == 2
        client.on_round(2)  # no new step since the last round: no poll, however due
        assert len(server.gets) == 2
    finally:
        client.close()
        server.close()


@pytest.mark.slow  # imports torch.profiler when run alone
def test_one_capture_at_a_time_and_an_armed_one_the_run_ends_before_fails():
    from traceml import deep_capture, step_events

    answers = []
    step_events.set_recording(True)
    try:
        assert deep_capture.arm(_request("cap-a", 2), answers.append) is None
        assert deep_capture.busy() and step_events.step_end_hook is not None
        assert deep_capture.arm(_request("cap-b", 2), answers.append) == \
            "another capture is in progress on this rank"
        deep_capture.end_of_run()
        assert [(a.request.capture_id, a.failure) for a in answers] == \
            [("cap-a", "the run ended before the capture began")]
        assert not deep_capture.busy() and step_events.step_end_hook is None
    finally:
        deep_capture.reset()
        step_events.set_recording(False)


def _answering_client(server: ControlServer, trace: bytes | None):
    """A control client whose captures answer at once with a small summary (and `trace`)."""
    from traceml.deep_capture import CaptureResult
    from traceml.exporter.control import ControlClient
    from traceml.schema.capture import KIND_OP, OpTime

    def arm(request, deliver):
        summary = RankCaptureSummary(
            capture_id=request.capture_id, run_id=request.run_id, rank=request.rank, role=request.role,
            first_step=3, step_ms=(1.0,), activities=("cpu",),
            ops=(OpTime("aten::sort", KIND_OP, 1, 0.5), OpTime(HOST_NAME, KIND_HOST, 1, 0.5)),
            trace_bytes=None if trace is None else len(trace))
        deliver(CaptureResult(request, summary=summary, trace=trace))
        return None

    settings = replace(resolve_settings("http://127.0.0.1:4317", "grpc", environ={}),
                       control_endpoints=(server.url,), control_poll_interval_s=0.0)
    return ControlClient(identity(RUN), settings, lambda: None, arm=arm)


def test_uploads_are_tried_again_after_a_server_error_and_a_refused_trace_is_counted():
    server = ControlServer([_request("cap-up", 1).to_json()], statuses={"summary": [503], "trace": [413]})
    client = _answering_client(server, b"\x1f\x8b not really a trace")
    try:
        client.on_round(1)  # the request, and the answer queued at once
        client.on_round(1)  # summary: 503, kept for a later round
        assert not server.part("summary") and client.stats().upload_failures == 0
        client.on_round(1)  # summary delivered; the trace refused (413): final, counted
        assert len(server.part("summary")) == 1 and not server.part("trace") and not server.part("failure")
        stats = client.stats()
        assert (stats.uploads, stats.upload_failures) == (1, 1)
        client.on_round(1)
        assert client.stats().uploads == 1  # nothing left to send
    finally:
        client.close()
        server.close()


def test_a_refused_summary_is_followed_by_a_failure_naming_the_refusal():
    server = ControlServer([_request("cap-no", 1).to_json()], statuses={"summary": [400]})
    client = _answering_client(server, b"trace")
    try:
        client.on_round(1)
        client.on_round(1)
        (path, body, _), = server.part("failure")
        assert path.endswith("/cap-no/ranks/0/failure")
        assert json.loads(body)["reason"].startswith("the processor refused the summary: HTTP 400")
        assert not server.part("trace")  # the trace is not sent after a refused summary
        assert (client.stats().uploads, client.stats().upload_failures) == (1, 1)
    finally:
        client.close()
        server.close()


def test_a_kept_alive_poll_connection_the_processor_closed_is_replaced_without_a_failure():
    from traceml.exporter.control import ControlClient

    server = ControlServer(keepalive_s=0.1)
    settings = replace(resolve_settings("http://127.0.0.1:4317", "grpc", environ={}),
                       control_endpoints=(server.url,), control_poll_interval_s=0.0)
    client = ControlClient(identity(RUN), settings, lambda: None)
    try:
        client.on_round(1)
        assert client._polls[server.url]._conn is not None  # kept alive
        time.sleep(0.4)  # the server closes it after 0.1 s idle
        client.on_round(2)
        stats = client.stats()
        assert (stats.polls, stats.poll_failures) == (2, 0) and len(server.gets) == 2
    finally:
        client.close()
        server.close()
