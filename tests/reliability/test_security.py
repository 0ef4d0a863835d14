"""Security: token and TLS enforced when configured, loopback by default, caps, hostile run ids.

Every case runs against the real `traceml-processor` CLI on loopback; what
reaches SQLite and the summary directory is read back from disk.
"""
from __future__ import annotations

import http.client
import json
import ssl
from pathlib import Path

import grpc
import pytest
from harness.reliability.fuzz_cases import TRACES, OtlpClient, reasons_in
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from harness import ProcessorProcess, wait_until
from harness.certificates import self_signed
from harness.stored_rows import count_rows, stored_step_keys
from harness.reliability import reliability_helpers as h
from traceml.processor.cli import config_from_args
from traceml.processor.service import ProcessorConfig
from traceml.schema import vocabulary as v

TOKEN = "s3cret-token-for-tests"


def _http_post(port: int, body: bytes, headers: dict, context: ssl.SSLContext | None = None) -> object:
    conn = (http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context) if context
            else http.client.HTTPConnection("127.0.0.1", port, timeout=10))
    try:
        conn.request("POST", "/v1/traces", body=body, headers={"Content-Type": "application/x-protobuf", **headers})
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException) as exc:
        return f"failed: {type(exc).__name__}"
    finally:
        conn.close()


def _grpc_export(channel, request, metadata=()) -> object:
    try:
        trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=10, metadata=metadata)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def test_loopback_is_the_default():
    config, _ = config_from_args(["--db", "x.db"])
    assert config.otlp_grpc[0] == "127.0.0.1" and config.otlp_http[0] == "127.0.0.1"
    assert config.prometheus is None and config.export is None
    assert not config.auth.enabled and not config.tls.enabled
    defaults = ProcessorConfig(db=Path("x.db"))
    assert defaults.otlp_grpc[0] == "127.0.0.1" and defaults.otlp_http[0] == "127.0.0.1"
    config, _ = config_from_args(["--db", "x.db", "--otlp-grpc", ":5317", "--otlp-http", ":5318"])
    assert config.otlp_grpc == ("127.0.0.1", 5317) and config.otlp_http == ("127.0.0.1", 5318)


@pytest.mark.slow
def test_bearer_token_and_tls_are_enforced_on_both_receivers(tmp_path):
    cert, key = self_signed(tmp_path)
    (tmp_path / "token").write_text(TOKEN + "\n")
    proc = ProcessorProcess(tmp_path / "p", extra_args=[
        "--auth-token-file", str(tmp_path / "token"), "--tls-cert", str(cert), "--tls-key", str(key)]).start()
    try:
        client_ctx = ssl.create_default_context(cafile=str(cert))
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        tls_channel = grpc.secure_channel(f"127.0.0.1:{proc.grpc}", creds)
        plain_channel = grpc.insecure_channel(f"127.0.0.1:{proc.grpc}")
        bad = h.steps_request("sec-denied", 0, [1, 2])
        good = h.steps_request("sec-allowed", 0, [1, 2])
        body = bad.SerializeToString()

        # gRPC: no TLS at all, TLS without a token, with a wrong one, wrong scheme: all refused.
        assert _grpc_export(plain_channel, bad, [("authorization", f"Bearer {TOKEN}")]) == grpc.StatusCode.UNAVAILABLE
        assert _grpc_export(tls_channel, bad) == grpc.StatusCode.UNAUTHENTICATED
        assert _grpc_export(tls_channel, bad, [("authorization", "Bearer wrong")]) == grpc.StatusCode.UNAUTHENTICATED
        assert _grpc_export(tls_channel, bad, [("authorization", f"Basic {TOKEN}")]) == grpc.StatusCode.UNAUTHENTICATED
        assert _grpc_export(tls_channel, bad, [("authorization", f"Bearer {TOKEN}x")]) == grpc.StatusCode.UNAUTHENTICATED
        # HTTP: plain text to a TLS port, HTTPS without / with a wrong token: refused.
        plain = _http_post(proc.http, body, {"Authorization": f"Bearer {TOKEN}"})
        assert str(plain).startswith("failed"), plain
        assert _http_post(proc.http, body, {}, client_ctx) == 401
        assert _http_post(proc.http, body, {"Authorization": "Bearer nope"}, client_ctx) == 401
        # An unverified server certificate is refused by a verifying client (no silent downgrade).
        assert str(_http_post(proc.http, body, {"Authorization": f"Bearer {TOKEN}"},
                              ssl.create_default_context())).startswith("failed")
        # The right token over TLS on both.
        assert _grpc_export(tls_channel, good, [("authorization", f"Bearer {TOKEN}")]) == grpc.StatusCode.OK
        good_http = h.steps_request("sec-allowed", 1, [1, 2]).SerializeToString()
        assert _http_post(proc.http, good_http, {"Authorization": f"Bearer {TOKEN}"}, client_ctx) == 200
        tls_channel.close()
        plain_channel.close()
        stored = stored_step_keys(proc.db)
        assert stored == {("sec-allowed", r, s) for r in (0, 1) for s in (1, 2)}  # nothing refused got in
    finally:
        assert proc.stop() == 0


@pytest.mark.slow  # among the fast loop's slowest (see the marker in pyproject.toml)
def test_bearer_token_alone_is_enforced_and_probes_stay_open(tmp_path):
    proc = ProcessorProcess(tmp_path, env={"TRACEML_PROCESSOR_AUTH_TOKEN": TOKEN}).start()  # from the environment
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{proc.grpc}")
        bad = h.steps_request("tok-denied", 0, [1])
        assert _grpc_export(channel, bad) == grpc.StatusCode.UNAUTHENTICATED
        assert _grpc_export(channel, bad, [("authorization", "Bearer " + TOKEN[:-1])]) == grpc.StatusCode.UNAUTHENTICATED
        assert _http_post(proc.http, bad.SerializeToString(), {}) == 401
        assert _http_post(proc.http, bad.SerializeToString(), {"Authorization": TOKEN}) == 401  # no scheme
        good = h.steps_request("tok-allowed", 0, [1])
        assert _grpc_export(channel, good, [("authorization", f"Bearer {TOKEN}")]) == grpc.StatusCode.OK
        assert _http_post(proc.http, h.steps_request("tok-allowed", 1, [1]).SerializeToString(),
                          {"Authorization": f"bearer {TOKEN}"}) == 200  # the scheme is case-insensitive
        channel.close()
        for probe in ("/healthz", "/readyz"):
            conn = http.client.HTTPConnection("127.0.0.1", proc.http, timeout=10)
            conn.request("GET", probe)
            assert conn.getresponse().status == 200
            conn.close()
        assert stored_step_keys(proc.db) == {("tok-allowed", 0, 1), ("tok-allowed", 1, 1)}
    finally:
        assert proc.stop() == 0


@pytest.mark.parametrize("content", ["", "  \n\t\n"], ids=["empty", "whitespace"])
@pytest.mark.slow
def test_an_empty_token_file_refuses_to_start(tmp_path, content):
    """An empty --auth-token-file once turned authentication off without a word."""
    token_file = tmp_path / "token"
    token_file.write_text(content)
    proc = ProcessorProcess(tmp_path / "p", extra_args=["--auth-token-file", str(token_file)])
    with pytest.raises(RuntimeError):
        proc.start(timeout_s=30)  # no ready line: it never served
    assert proc.proc.returncode == 1
    lines = proc.log_text().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("traceml-processor: cannot start:") and str(token_file) in lines[0]
    assert "empty" in lines[0] and "Traceback" not in proc.log_text()


@pytest.mark.slow
def test_a_missing_token_file_refuses_to_start(tmp_path):
    proc = ProcessorProcess(tmp_path / "p", extra_args=["--auth-token-file", str(tmp_path / "absent")])
    with pytest.raises(RuntimeError):
        proc.start(timeout_s=30)
    assert proc.proc.returncode == 1
    lines = proc.log_text().strip().splitlines()
    assert len(lines) == 1 and "cannot read --auth-token-file" in lines[0], lines


@pytest.mark.slow  # among the fast loop's slowest (see the marker in pyproject.toml)
def test_caps_on_runs_ranks_and_attribute_sizes(tmp_path):
    proc = ProcessorProcess(tmp_path, extra_args=["--max-runs", "2", "--max-ranks-per-run", "3"]).start()
    client = OtlpClient(proc.grpc, proc.http)
    try:
        for run in ("cap-a", "cap-b"):
            assert client.grpc(TRACES, h.steps_request(run, 0, [1])).rejected == 0
        answer = client.grpc(TRACES, h.steps_request("cap-c", 0, [1, 2]))
        assert answer.rejected == 2 and reasons_in(answer.message) == {"too_many_runs": 2}, answer
        for rank in (1, 2):
            assert client.http(TRACES, h.steps_request("cap-a", rank, [1])).rejected == 0
        answer = client.http(TRACES, h.steps_request("cap-a", 3, [1]))
        assert answer.rejected == 1 and reasons_in(answer.message) == {"too_many_ranks": 1}, answer
        # Known ranks of a full run still get in.
        assert client.grpc(TRACES, h.steps_request("cap-a", 2, [2])).rejected == 0
        long_run = h.steps_request("r" * 257, 0, [1])
        answer = client.grpc(TRACES, long_run)
        assert reasons_in(answer.message) == {"attribute_too_large": 1}, answer
        span = h.step_span("cap-a", 0, 3, attrs={**h.step_attrs(3, 0), "note": "x" * 4097})
        answer = client.grpc(TRACES, h.trace_request([h.resource_spans(h.resource_attrs("cap-a", 0), [span])]))
        assert reasons_in(answer.message) == {"attribute_too_large": 1}, answer
        assert {k[0] for k in stored_step_keys(proc.db)} == {"cap-a", "cap-b"}
        assert ("cap-a", 3, 1) not in stored_step_keys(proc.db)
    finally:
        client.close()
        assert proc.stop() == 0


HOSTILE_RUN_IDS = (
    "x'; DROP TABLE step_time_samples; --",
    "\" OR 1=1 --",
    "../../../../tmp/escaped",
    "../escaped-sibling",
    "/etc/passwd",
    "..",
    ".",
    "a/../../b",
    "C:\\Windows\\System32",
    "run\x00with-nul",
    "~root/.ssh",
    "%2e%2e%2f%2e%2e%2fescaped",
    "-rf --no-preserve-root",
    "名前/../../逃げる",
    "x" * 256,
)


@pytest.mark.slow
def test_hostile_run_ids_are_stored_verbatim_and_summaries_stay_inside_the_summary_dir(tmp_path):
    folder = tmp_path / "deep" / "processor"
    proc = ProcessorProcess(folder, extra_args=["--refresh-interval", "0.3"]).start()
    client = OtlpClient(proc.grpc, proc.http)
    try:
        for i, run in enumerate(HOSTILE_RUN_IDS):
            # Hostile attribute values too: SQL in a host name, a strategy, an unknown attribute.
            resource = h.resource_attrs(run, 0, world_size=1)
            resource[v.RES_HOST_NAME] = "h'); DELETE FROM step_time_runs; --"
            steps = [h.step_span(run, 0, s, attrs={**h.step_attrs(s, 0), "note": "'; DROP TABLE x; --"})
                     for s in range(1, 6)]
            request = h.trace_request([h.resource_spans(resource, [*steps, h.run_end_span(0, 5)])])
            answer = client.grpc(TRACES, request) if i % 2 else client.http(TRACES, request)
            assert answer.status in (grpc.StatusCode.OK, 200) and answer.rejected == 0, (run, answer)
        summaries = proc.summary_dir
        assert wait_until(lambda: len(list(summaries.glob("*/final_summary.json"))) == len(HOSTILE_RUN_IDS), 120), \
            sorted(p.name for p in summaries.iterdir()) if summaries.exists() else "no summary dir"
    finally:
        client.close()
        assert proc.stop() == 0
    stored_runs = {k[0] for k in stored_step_keys(proc.db)}
    assert stored_runs == {run.strip() for run in HOSTILE_RUN_IDS}  # verbatim, every table intact
    assert count_rows(proc.db) == 5 * len(HOSTILE_RUN_IDS) and count_rows(proc.db, "step_time_runs") == \
        len(HOSTILE_RUN_IDS)
    root = summaries.resolve()
    folders = [p for p in root.iterdir()]
    assert len(folders) == len(HOSTILE_RUN_IDS)  # one folder per id, never shared
    for p in folders:
        assert p.is_dir() and p.resolve().parent == root
        summary = json.loads((p / "final_summary.json").read_text())
        assert summary  # a real summary, written inside
    # Nothing was written anywhere else: the processor's folder holds only what it owns.
    outside = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")
               if not p.resolve().is_relative_to(root)}
    assert {o for o in outside if "escaped" in o or "passwd" in o or "System32" in o or "逃げる" in o} == set()
    assert not Path("/tmp/escaped").exists()
