"""OTLP/HTTP receiver over a real HTTP server on loopback: protobuf, JSON, gzip, limits, errors."""
from __future__ import annotations

import gzip
import http.client
import json
import sqlite3
import threading

from harness.processor_service import make_service
from harness.stored_rows import count_rows
from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb2
from harness.otlp_payloads import foreign_request, memory_request, step_span, steps_request, trace_request

from traceml.processor.security import BearerAuth
from traceml.schema import vocabulary as v

PB = "application/x-protobuf"


def post(port, path, body, content_type=PB, headers=None, method="POST"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": content_type, **(headers or {})})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type"), response.read(), response
    finally:
        conn.close()


def to_otlp_json(request) -> dict:
    """OTLP/JSON as collectors write it: camelCase, hex ids, integer enums."""
    doc = json_format.MessageToDict(request, use_integers_for_enums=True)
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = __import__("base64").b64decode(span[key]).hex()
    return doc


def test_protobuf_post_is_stored_and_answered_in_protobuf(service):
    status, ctype, body, _ = post(service.http_port, "/v1/traces", steps_request("h-pb", 0, range(4)).SerializeToString())
    assert status == 200 and ctype == PB
    response = trace_pb2.ExportTraceServiceResponse.FromString(body)
    assert not response.HasField("partial_success")
    assert count_rows(service.config.db, run_id="h-pb") == 4


def test_otlp_json_with_hex_ids_int_enums_and_unknown_fields(service):
    doc = to_otlp_json(steps_request("h-json", 1, range(3)))
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert len(span["traceId"]) == 32 and span["kind"] == 1
    doc["someFutureField"] = {"x": 1}
    span["futureSpanField"] = "ignored"
    status, ctype, body, _ = post(service.http_port, "/v1/traces", json.dumps(doc).encode(), "application/json")
    assert status == 200 and ctype == "application/json"
    assert json.loads(body) == {}
    assert count_rows(service.config.db, run_id="h-json") == 3


def test_json_partial_success_is_answered_in_json(service):
    request = trace_request("h-json-bad", 0, [step_span(0, 0), step_span(1, 0, drop=[v.ATTR_STEP])])
    status, _, body, _ = post(service.http_port, "/v1/traces", json.dumps(to_otlp_json(request)).encode(),
                              "application/json")
    assert status == 200
    answer = json.loads(body)
    assert answer["partialSuccess"]["rejectedSpans"] == "1"
    assert "missing_step" in answer["partialSuccess"]["errorMessage"]


def test_gzip_body_is_decompressed(service):
    body = gzip.compress(memory_request("h-gz", 0, range(5)).SerializeToString())
    status, _, raw, _ = post(service.http_port, "/v1/metrics", body, headers={"Content-Encoding": "gzip"})
    assert status == 200
    assert not metrics_pb2.ExportMetricsServiceResponse.FromString(raw).HasField("partial_success")
    assert count_rows(service.config.db, "step_memory_samples", run_id="h-gz") == 5


def test_body_over_20_mib_after_decompression_is_413(service):
    bomb = gzip.compress(b"\0" * (21 * 1024 * 1024))
    assert len(bomb) < 100_000
    status, _, body, _ = post(service.http_port, "/v1/traces", bomb, headers={"Content-Encoding": "gzip"})
    assert status == 413
    assert "after decompression" in status_pb2.Status.FromString(body).message
    status, _, _, _ = post(service.http_port, "/v1/traces", b"\0" * (20 * 1024 * 1024 + 1))
    assert status == 413


def test_empty_request_is_200(service):
    status, _, body, _ = post(service.http_port, "/v1/traces", b"")
    assert status == 200 and body == b""
    status, _, body, _ = post(service.http_port, "/v1/metrics", b"{}", "application/json")
    assert status == 200 and json.loads(body) == {}


def test_undecodable_bodies_are_400(service):
    assert post(service.http_port, "/v1/traces", b"\xff\xff\xff garbage")[0] == 400
    assert post(service.http_port, "/v1/traces", b"{not json", "application/json")[0] == 400
    assert post(service.http_port, "/v1/traces", b'{"resourceSpans": 7}', "application/json")[0] == 400
    status, _, body, _ = post(service.http_port, "/v1/traces", b"not gzip", headers={"Content-Encoding": "gzip"})
    assert status == 400
    assert "gzip" in status_pb2.Status.FromString(body).message
    assert post(service.http_port, "/v1/traces", b"x", "text/plain")[0] == 415
    assert post(service.http_port, "/v1/profiles", b"")[0] == 404  # no such OTLP route here
    assert count_rows(service.config.db) == 0


def test_foreign_telemetry_is_ignored_with_a_message(service):
    status, _, body, _ = post(service.http_port, "/v1/traces", foreign_request(2).SerializeToString())
    assert status == 200
    partial = trace_pb2.ExportTraceServiceResponse.FromString(body).partial_success
    assert partial.rejected_spans == 0 and "ignored 2" in partial.error_message


def test_duplicate_http_delivery_adds_no_rows(service):
    body = steps_request("h-dup", 0, range(5)).SerializeToString()
    for _ in range(3):
        assert post(service.http_port, "/v1/traces", body)[0] == 200
    assert count_rows(service.config.db, run_id="h-dup") == 5


def test_health_and_readiness(service):
    conn = http.client.HTTPConnection("127.0.0.1", service.http_port, timeout=10)
    conn.request("GET", "/healthz")
    assert conn.getresponse().status == 200
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", service.http_port, timeout=10)
    conn.request("GET", "/readyz")
    response = conn.getresponse()
    assert (response.status, response.read()) == (200, b"ready\n")
    conn.close()


def test_bearer_token_on_http(tmp_path):
    svc = make_service(tmp_path, auth=BearerAuth("tok"), prometheus=None)
    try:
        body = steps_request("h-auth", 0, range(2)).SerializeToString()
        assert post(svc.http_port, "/v1/traces", body)[0] == 401
        assert post(svc.http_port, "/v1/traces", body, headers={"Authorization": "Bearer nope"})[0] == 401
        assert post(svc.http_port, "/v1/traces", body, headers={"Authorization": "Bearer tok"})[0] == 200
        assert count_rows(svc.config.db, run_id="h-auth") == 2
    finally:
        svc.stop()


def test_back_pressure_is_429_with_retry_after(tmp_path):
    svc = make_service(tmp_path, max_pending_records=10, prometheus=None)
    try:
        blocker = sqlite3.connect(svc.config.db)
        blocker.execute("BEGIN EXCLUSIVE")
        codes = []
        threads = [threading.Thread(target=lambda r=r: codes.append(
            post(svc.http_port, "/v1/traces", steps_request("h-bp", r, range(6)).SerializeToString())[0]))
            for r in (0, 1)]
        threads[0].start()
        assert _wait(lambda: svc.ingest.in_flight_records == 6)
        threads[1].start()
        assert _wait(lambda: svc.ingest.pending_records() == 6)
        status, _, _, response = post(svc.http_port, "/v1/traces", steps_request("h-bp", 2, range(6)).SerializeToString())
        assert status == 429 and response.getheader("Retry-After") == "1"
        blocker.rollback()
        blocker.close()
        for t in threads:
            t.join(30)
        assert codes == [200, 200]
        assert count_rows(svc.config.db, run_id="h-bp") == 12
    finally:
        svc.stop()


def test_run_and_rank_caps_reject_with_a_clear_reason(tmp_path):
    from traceml.processor.decode import DecodeLimits

    svc = make_service(tmp_path, limits=DecodeLimits(max_runs=2, max_ranks_per_run=2), prometheus=None)
    try:
        for run in ("c1", "c2"):
            assert post(svc.http_port, "/v1/traces", steps_request(run, 0, range(1)).SerializeToString())[0] == 200
        _, _, body, _ = post(svc.http_port, "/v1/traces", steps_request("c3", 0, range(2)).SerializeToString())
        partial = trace_pb2.ExportTraceServiceResponse.FromString(body).partial_success
        assert partial.rejected_spans == 2 and "too_many_runs" in partial.error_message
        assert post(svc.http_port, "/v1/traces", steps_request("c1", 1, range(1)).SerializeToString())[0] == 200
        _, _, body, _ = post(svc.http_port, "/v1/traces", steps_request("c1", 2, range(1)).SerializeToString())
        partial = trace_pb2.ExportTraceServiceResponse.FromString(body).partial_success
        assert partial.rejected_spans == 1 and "too_many_ranks" in partial.error_message
        long_run = "r" * 300
        _, _, body, _ = post(svc.http_port, "/v1/traces", steps_request(long_run, 0, range(1)).SerializeToString())
        assert "attribute_too_large" in trace_pb2.ExportTraceServiceResponse.FromString(body).partial_success.error_message
        assert count_rows(svc.config.db) == 3
    finally:
        svc.stop()


def _wait(predicate, timeout_s=10.0):
    from harness import wait_until

    return wait_until(predicate, timeout_s)


def test_requests_over_the_concurrent_limit_answer_429_with_retry_after(tmp_path):
    svc = make_service(tmp_path, max_concurrent_requests=1, prometheus=None)
    blocker = sqlite3.connect(svc.config.db)
    try:
        blocker.execute("BEGIN EXCLUSIVE")  # the writer stalls: the first request stays admitted
        answers = {}
        first = threading.Thread(target=lambda: answers.setdefault("first", post(
            svc.http_port, "/v1/traces", steps_request("h-limit", 0, range(3)).SerializeToString())))
        first.start()
        from harness import wait_until

        assert wait_until(lambda: svc.ingest.in_flight_records == 3, 10)
        status, ctype, body, response = post(svc.http_port, "/v1/traces",
                                             steps_request("h-limit", 1, range(3)).SerializeToString())
        assert status == 429 and response.getheader("Retry-After") == "1"
        assert "over the limit of 1 concurrent requests" in status_pb2.Status.FromString(body).message
        blocker.rollback()
        first.join(30)
        assert answers["first"][0] == 200
        status, *_ = post(svc.http_port, "/v1/traces", steps_request("h-limit", 1, range(3)).SerializeToString())
        assert status == 200  # the retry, once there is room
        assert count_rows(svc.config.db, run_id="h-limit") == 6
    finally:
        blocker.close()
        svc.stop()


# --- the HTTP/1.1 front (processor/http_front.py): keep-alive, pipelining, 100-continue, HEAD, IPv6, TLS ---


def _raw_exchange(port, payload: bytes, until: bytes, timeout_s: float = 10.0, host="127.0.0.1") -> bytes:
    """Send `payload`, read until `until` has been seen (or the peer closes / the time is up)."""
    import socket
    import time

    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(payload)
        data, deadline = b"", time.monotonic() + timeout_s
        while until not in data and time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def _post_bytes(run_id: str, rank: int, extra: bytes = b"") -> bytes:
    body = steps_request(run_id, rank, range(2)).SerializeToString()
    return (b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n" + extra
            + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def test_pipelined_requests_on_one_connection_are_answered_in_order(service):
    answer = _raw_exchange(service.http_port, _post_bytes("h-pipe", 0) + _post_bytes("h-pipe", 1)
                           + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", until=b"ok\n")
    assert answer.count(b"HTTP/1.1 200") == 3 and answer.endswith(b"ok\n")
    assert count_rows(service.config.db, run_id="h-pipe") == 4


def test_expect_100_continue_is_answered_before_the_body_is_sent(service):
    import socket

    body = steps_request("h-100", 0, range(3)).SerializeToString()
    with socket.create_connection(("127.0.0.1", service.http_port), timeout=10) as sock:
        sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                     b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert sock.recv(4096).startswith(b"HTTP/1.1 100")
        sock.sendall(body)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    assert count_rows(service.config.db, run_id="h-100") == 3


def test_head_has_the_length_and_no_body_and_other_methods_are_405(service):
    head = _raw_exchange(service.http_port, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                         until=b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: 3" in head and head.endswith(b"\r\n\r\n")
    status, _, _, response = post(service.http_port, "/v1/traces", b"", method="PUT")
    assert status == 405 and response.getheader("Allow") == "GET, HEAD, POST"


def test_ipv6_listener(tmp_path):
    import socket

    if not socket.has_ipv6:
        import pytest

        pytest.skip("no IPv6 on this machine")
    try:
        svc = make_service(tmp_path, otlp_http=("::1", 0), otlp_grpc=None, prometheus=None)
    except OSError as exc:
        import pytest

        pytest.skip(f"cannot bind ::1: {exc}")
    try:
        answer = _raw_exchange(svc.http_port, _post_bytes("h-v6", 0), until=b"\r\n\r\n", host="::1")
        assert answer.startswith(b"HTTP/1.1 200")
        assert count_rows(svc.config.db, run_id="h-v6") == 2
    finally:
        svc.stop()


def test_a_tls_handshake_that_never_comes_is_closed_within_the_header_timeout(tmp_path, certificate):
    import socket
    import ssl

    from traceml.processor.security import TlsConfig
    from traceml.processor.http_front import HttpLimits

    cert, key = certificate
    svc = make_service(tmp_path, otlp_grpc=None, prometheus=None, tls=TlsConfig(str(cert), str(key)),
                       http_limits=HttpLimits(header_timeout_s=0.3))
    try:
        with socket.create_connection(("127.0.0.1", svc.http_port), timeout=10) as silent:
            assert silent.recv(1) == b""  # closed by the server, not by this 10 s timeout
        context = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("localhost", svc.http_port, context=context, timeout=10)
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200  # a client that does the handshake is served
        conn.close()
        assert svc.http.front.events()["tls_failed"] == 1
    finally:
        svc.stop()


from tests.processor.test_summary_export_security_cli import certificate  # noqa: E402,F401  (the fixture)
