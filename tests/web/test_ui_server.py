"""`--ui`: the web view served by a real processor on loopback, fed over real OTLP/HTTP.

The processor runs in the test's process (`make_service`); requests go over real
sockets with `http.client`, with TLS and a bearer token where the test says so.
"""
from __future__ import annotations

import http.client
import json
import ssl

import pytest

from harness.certificates import self_signed
from harness.processor_service import make_service
from harness.waiting import wait_until
from harness.otlp_payloads import steps_request
from traceml.processor.cli import config_from_args
from traceml.processor.security import BearerAuth, TlsConfig
from traceml.schema import vocabulary as v


def post_steps(svc, run_id: str, rank: int, steps, headers=None, events=None) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", svc.http_port, timeout=10)
    conn.request("POST", "/v1/traces", body=steps_request(run_id, rank, steps, events).SerializeToString(),
                 headers={"Content-Type": "application/x-protobuf", **(headers or {})})
    assert conn.getresponse().status == 200
    conn.close()


def fetch(port: int, path: str, *, context: ssl.SSLContext | None = None, host: str = "127.0.0.1", **headers):
    conn = (http.client.HTTPSConnection(host, port, context=context, timeout=10) if context
            else http.client.HTTPConnection(host, port, timeout=10))
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, dict(response.getheaders()), body


def slow_events(rank: int) -> dict[str, float]:
    events = {v.RAW_DATALOADER_NEXT: 5.0, v.RAW_H2D: 5.0, v.RAW_FORWARD: 30.0, v.RAW_BACKWARD: 45.0,
              v.RAW_OPTIMIZER_STEP: 10.0, v.RAW_STEP_TIME: 95.0}
    if rank == 1:
        events[v.RAW_DATALOADER_NEXT] = 60.0
    else:
        events[v.RAW_BACKWARD] += 55.0
        events[v.RAW_STEP_TIME] += 55.0
    return events


def test_the_processor_serves_the_view_of_a_run_it_receives(tmp_path):
    svc = make_service(tmp_path, prometheus=None, ui=("127.0.0.1", 0))
    try:
        for rank in (0, 1):
            post_steps(svc, "live-run", rank, range(25), events=slow_events(rank))
        assert wait_until(lambda: (svc.monitor.state("live-run") or None) is not None
                          and svc.monitor.state("live-run").session is not None, 10)
        status, headers, body = fetch(svc.ui_port, "/ui/")
        assert status == 200 and b"live-run" in body and b"active" in body
        status, _, body = fetch(svc.ui_port, "/ui/api/run?id=live-run")
        view = json.loads(body)["view"]
        assert view["hero"]["kind"] == "INPUT_STRAGGLER" and view["hero"]["culprit_rank"] == 1
        # The page's refresh is the run monitor's own session: the web view added no analysis.
        session = svc.monitor.state("live-run").session
        before = session.analyses
        fetch(svc.ui_port, "/ui/run?id=live-run")
        assert session.analyses == before
        assert fetch(svc.ui_port, "/ui/assets/app.js")[0] == 200
        assert fetch(svc.ui_port, "/ui/assets/../../etc/passwd")[0] == 404
    finally:
        svc.stop()


def test_the_otlp_http_port_serves_the_same_view_under_ui(tmp_path):
    """No --ui needed: the view rides on the OTLP/HTTP port, through the same bounded front."""
    svc = make_service(tmp_path, prometheus=None, capture="manual")
    try:
        assert svc.ui_port is None
        for rank in (0, 1):
            post_steps(svc, "port-run", rank, range(25), events=slow_events(rank))
        assert wait_until(lambda: svc.monitor.state("port-run") is not None
                          and svc.monitor.state("port-run").session is not None, 10)
        status, _, body = fetch(svc.http_port, "/ui/")
        assert status == 200 and b"port-run" in body
        status, _, body = fetch(svc.http_port, "/ui/api/run?id=port-run")
        assert status == 200 and json.loads(body)["view"]["hero"]["culprit_rank"] == 1
        assert fetch(svc.http_port, "/ui/assets/style.css")[0] == 200
        assert fetch(svc.http_port, "/uix")[0] == 404  # a prefix is a path segment, not a string prefix
        assert fetch(svc.http_port, "/healthz")[0] == 200  # the receiver's own routes are untouched
        # The page's "Capture" button: a POST through the same front into the service's capture book
        # (--capture manual: no automatic capture of this straggler takes the run's one slot first).
        assert post_capture(svc.http_port, "/ui/api/capture?id=port-run&rank=1")[0] == 403  # no header
        status, body = post_capture(svc.http_port, "/ui/api/capture?id=port-run&rank=1", **{"X-TraceML-Capture": "1"})
        assert status == 202, body
        assert [r.capture_id for r in svc.captures.of_run("port-run")] == [json.loads(body)["capture_id"]]
    finally:
        svc.stop()


def post_capture(port: int, path: str, **headers):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, body=b"", headers=headers)
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, body


def test_the_ui_on_the_otlp_port_honours_the_token(tmp_path):
    svc = make_service(tmp_path, prometheus=None, auth=BearerAuth("tok-2"))
    try:
        assert fetch(svc.http_port, "/ui/")[0] == 401
        assert fetch(svc.http_port, "/ui/", Authorization="Bearer tok-2")[0] == 200
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("tls"))


def test_the_view_honours_the_token_and_tls(tmp_path, certificate):
    cert, key = certificate
    svc = make_service(tmp_path, prometheus=None, ui=("127.0.0.1", 0), auth=BearerAuth("tok-1"),
                       tls=TlsConfig(str(cert), str(key)))
    try:
        context = ssl.create_default_context(cafile=str(cert))
        auth = {"Authorization": "Bearer tok-1"}
        post_steps_tls(svc, context, auth)
        assert fetch(svc.ui_port, "/ui/", context=context, host="localhost")[0] == 401
        status, _, body = fetch(svc.ui_port, "/ui/", context=context, host="localhost", **auth)
        assert status == 200 and b"tls-run" in body
        status, headers, _ = fetch(svc.ui_port, "/ui/?token=tok-1", context=context, host="localhost")
        assert status == 303 and "Secure" in headers["Set-Cookie"]
        cookie = headers["Set-Cookie"].split(";")[0]
        assert fetch(svc.ui_port, "/ui/api/runs", context=context, host="localhost", Cookie=cookie)[0] == 200
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException, OSError)):
            fetch(svc.ui_port, "/ui/", **auth)  # plaintext to a TLS port gets no page
    finally:
        svc.stop()


def post_steps_tls(svc, context, auth) -> None:
    conn = http.client.HTTPSConnection("localhost", svc.http_port, context=context, timeout=10)
    conn.request("POST", "/v1/traces", body=steps_request("tls-run", 0, range(5)).SerializeToString(),
                 headers={"Content-Type": "application/x-protobuf", **auth})
    assert conn.getresponse().status == 200
    conn.close()


def test_cli_reads_the_ui_address_from_the_flag_then_the_environment(monkeypatch, tmp_path):
    config, _ = config_from_args(["--db", str(tmp_path / "x.db"), "--ui", "127.0.0.1:9999"])
    assert config.ui == ("127.0.0.1", 9999)
    monkeypatch.setenv("TRACEML_PROCESSOR_UI", ":8081")
    assert config_from_args(["--db", str(tmp_path / "x.db")])[0].ui == ("127.0.0.1", 8081)
    monkeypatch.delenv("TRACEML_PROCESSOR_UI")
    assert config_from_args(["--db", str(tmp_path / "x.db")])[0].ui is None
