"""Bad input, generated: over 10,000 OTLP requests against one real processor on loopback.

Every request goes over real gRPC or HTTP (one channel and one keep-alive
connection, reused). Each answer must be the documented one (status, partial
success count and reasons), the processor must keep serving, and at the end
SQLite must hold exactly the valid records that were sent beside the bad ones:
all of them, and nothing else.
"""
from __future__ import annotations

import gzip
import json

import grpc
import pytest
from harness.reliability.fuzz_cases import (
    HTTP_VARIANTS,
    METRICS,
    RESOURCE_MUTATIONS,
    RUN_POOL,
    SPAN_MUTATIONS,
    TRACES,
    TOO_MANY,
    GroupSpec,
    MemorySpec,
    MEMORY_MUTATIONS,
    OtlpClient,
    build_metrics_request,
    build_trace_request,
    check_answer,
    decodes,
    gunzips,
    gzip_bomb,
    reasons_in,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import ProcessorProcess, wait_until
from harness.stored_rows import count_rows, integrity_ok, stored_memory_keys, stored_step_keys
from harness.reliability import reliability_helpers as h
from traceml.schema import vocabulary as v

# Requests per property (each example sends over gRPC and over HTTP).
MIXED_TRACE_EXAMPLES = 2_400  # x2 = 4,800 requests
MIXED_METRIC_EXAMPLES = 700  # x2 = 1,400
UNDECODABLE_EXAMPLES = 1_300  # x2 = 2,600
ENVELOPE_EXAMPLES = 1_300  # HTTP only
MINIMUM_REQUESTS = 10_000

FUZZ_SETTINGS = dict(deadline=None, database=None, derandomize=False,
                     suppress_health_check=list(HealthCheck))

group_specs = st.builds(
    GroupSpec,
    run=st.integers(0, len(RUN_POOL) - 1),
    rank=st.integers(0, 31),
    resource_defect=st.one_of(st.none(), st.none(), st.none(), st.sampled_from(sorted(RESOURCE_MUTATIONS))),
    alias=st.booleans(),
    valid=st.integers(0, 3),
    huge_valid_step=st.booleans(),
    defects=st.lists(st.sampled_from(sorted(SPAN_MUTATIONS)), max_size=3).map(tuple),
    foreign=st.integers(0, 2),
    phase=st.integers(0, 1),
    duplicate=st.booleans(),
)
memory_specs = st.builds(
    MemorySpec,
    run=st.integers(0, len(RUN_POOL) - 1),
    rank=st.integers(0, 31),
    valid=st.integers(0, 3),
    defects=st.lists(st.sampled_from(MEMORY_MUTATIONS), max_size=3).map(tuple),
    histogram_points=st.integers(0, 2),
    foreign_metric=st.booleans(),
    drop_queue=st.one_of(st.none(), st.sampled_from(v.QUEUE_NAMES), st.just("bogus-queue")),
)


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    """The real `traceml-processor` CLI in its own process (so a crash would show as an exit)."""
    # Bit-flipped bodies can invent run ids: lift the run cap so they never crowd out the rest.
    proc = ProcessorProcess(tmp_path_factory.mktemp("fuzz"),
                              extra_args=["--refresh-interval", "2", "--max-runs", "1000000"]).start()
    yield proc
    assert proc.stop() == 0, proc.log_text()[-3000:]


@pytest.fixture(scope="module")
def client(processor):
    c = OtlpClient(processor.grpc, processor.http)
    yield c
    c.close()


def assert_serving(processor, client):
    """Still alive: the process runs, /readyz is green, a fresh valid step is acknowledged and stored."""
    assert processor.proc.poll() is None, processor.log_text()[-3000:]
    assert client.http_raw("/readyz", b"", method="GET").status == 200
    step = client.ledger.step("alive-check", 0)
    answer = client.grpc(TRACES, h.steps_request("alive-check", 0, [step]))
    assert (answer.status, answer.rejected) == (grpc.StatusCode.OK, 0), answer
    assert ("alive-check", 0, step) in stored_step_keys(processor.db, "alive-check")


@pytest.mark.slow
def test_ten_thousand_generated_requests_keep_every_valid_record(processor, client):
    ledger = client.ledger

    @settings(max_examples=MIXED_TRACE_EXAMPLES, **FUZZ_SETTINGS)
    @given(groups=st.lists(group_specs, min_size=1, max_size=3), variant=st.sampled_from(HTTP_VARIANTS),
           grpc_gzip=st.booleans())
    def mixed_traces(groups, variant, grpc_gzip):
        request, expected = build_trace_request(groups, ledger)
        compression = grpc.Compression.Gzip if grpc_gzip else None
        check_answer(client.grpc(TRACES, request, compression=compression), expected, grpc.StatusCode.OK)
        ledger.expect(expected)
        request, expected = build_trace_request(groups, ledger)  # fresh steps, same shape
        check_answer(client.http(TRACES, request, variant), expected, 200)
        ledger.expect(expected)

    @settings(max_examples=MIXED_METRIC_EXAMPLES, **FUZZ_SETTINGS)
    @given(spec=memory_specs, variant=st.sampled_from(HTTP_VARIANTS))
    def mixed_metrics(spec, variant):
        request, expected = build_metrics_request(spec, ledger)
        check_answer(client.grpc(METRICS, request), expected, grpc.StatusCode.OK)
        ledger.expect(expected)
        request, expected = build_metrics_request(spec, ledger)
        check_answer(client.http(METRICS, request, variant), expected, 200)
        ledger.expect(expected)

    truncated_sent: set = set()

    @settings(max_examples=UNDECODABLE_EXAMPLES, **FUZZ_SETTINGS)
    @given(kind=st.sampled_from(["random", "truncated", "flipped"]), junk=st.binary(max_size=300),
           cut=st.integers(0, 2**31), path=st.sampled_from([TRACES, METRICS]))
    def undecodable(kind, junk, cut, path):
        if kind == "random":
            body = junk
        else:
            run_id = "fuzz-truncated" if kind == "truncated" else "fuzz-flipped"
            steps = [ledger.step(run_id, 0) for _ in range(3)]
            if kind == "truncated":
                truncated_sent.update((run_id, 0, s) for s in steps)
            body = h.steps_request(run_id, 0, steps).SerializeToString()
            if kind == "truncated":
                body = body[:cut % len(body)]
            else:
                at = cut % len(body)
                body = body[:at] + bytes([body[at] ^ (junk[:1] or b"\x01")[0] or 1]) + body[at + 1:]
        parses = decodes(path, body)
        answer = client.grpc_bytes(path, body)
        if parses:
            assert answer.status == grpc.StatusCode.OK, answer
        else:
            # grpcio answers a body it cannot deserialize itself (see test_grpc_undecodable_is_counted).
            assert answer.status in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL), answer
        answer = client.http_raw(path, body)
        assert answer.status == (200 if parses else 400), answer

    @settings(max_examples=ENVELOPE_EXAMPLES, **FUZZ_SETTINGS)
    @given(fault=st.sampled_from(["bad_gzip", "truncated_gzip", "content_type", "encoding", "path",
                                  "json_text", "json_shape", "json_bad_hex"]),
           junk=st.binary(max_size=200), text=st.text(max_size=200),
           content_type=st.sampled_from(["text/plain", "application/xml", "", "application/grpc",
                                         "multipart/form-data"]),
           encoding=st.sampled_from(["br", "deflate", "zstd", "compress", "gzip, gzip"]),
           path=st.sampled_from(["/v1/profiles", "/", "/v1/traces/../metrics", "/v1/trace", "/metrics"]),
           shape=st.sampled_from([
               {"resourceSpans": 5}, {"resourceSpans": [1, 2]}, {"resourceSpans": [{"resource": {"attributes": 5}}]},
               {"resourceSpans": [{"resource": {"attributes": [{"key": "a", "value": {"intValue": "x"}}]}}]},
               {"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": "-1"}]}]}]},
               {"resourceSpans": [{"scopeSpans": [{"spans": [{"name": 7}]}]}]}]))
    def envelope(fault, junk, text, content_type, encoding, path, shape):
        valid = h.steps_request("fuzz-envelope", 0, [1]).SerializeToString()
        if fault == "bad_gzip":
            body = b"\x1f\x8b\x08\x00" + junk
            answer = client.http_raw(TRACES, body, headers={"Content-Encoding": "gzip"})
            assert answer.status in ((200, 400) if gunzips(body) else (400,)), answer
        elif fault == "truncated_gzip":
            body = gzip.compress(valid)
            body = body[:len(body) - 1 - len(junk) % (len(body) - 1)]
            answer = client.http_raw(TRACES, body, headers={"Content-Encoding": "gzip"})
            assert answer.status == 400, answer
        elif fault == "content_type":
            # Refused before the body is read, so sent without one: an unread body breaks the
            # connection (see test_refusal_before_reading_the_body_keeps_the_connection_in_step).
            answer = client.http_raw(TRACES, b"", content_type)
            assert answer.status == 415, answer
        elif fault == "encoding":
            answer = client.http_raw(TRACES, valid, headers={"Content-Encoding": encoding})
            assert answer.status == 415, answer
        elif fault == "path":
            answer = client.http_raw(path, b"")
            assert answer.status == 404, answer
        elif fault == "json_text":
            body = text.encode()
            try:
                document = json.loads(body)
            except ValueError:
                document = None
            answer = client.http_raw(TRACES, body, "application/json")
            if not body:
                assert answer.status == 200, answer  # an empty request
            else:
                assert answer.status in ((200, 400) if isinstance(document, dict) else (400,)), answer
        elif fault == "json_shape":
            answer = client.http_raw(TRACES, json.dumps(shape).encode(), "application/json")
            assert answer.status == (200 if json_parses(shape) else 400), answer
        else:
            doc = {"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz" + junk.hex()}]}]}]}
            answer = client.http_raw(TRACES, json.dumps(doc).encode(), "application/json")
            assert answer.status == 400, answer

    mixed_traces()
    mixed_metrics()
    undecodable()
    envelope()

    print(f"\nrequests sent: {dict(ledger.requests)} (total {ledger.total}); valid steps "
          f"{len(ledger.steps)}, valid memory rows {len(ledger.memory)}, "
          f"bad records refused {ledger.rejected_expected}")
    assert ledger.total >= MINIMUM_REQUESTS
    db = processor.db
    pool = {r.strip() for r in RUN_POOL}
    stored = {key for key in stored_step_keys(db) if key[0] in pool}
    assert ledger.steps and stored == ledger.steps  # every valid record, and nothing invalid
    stored_memory = {key for key in stored_memory_keys(db) if key[0] in pool}
    assert ledger.memory and stored_memory == ledger.memory
    assert stored_step_keys(db, "fuzz-truncated") <= truncated_sent
    assert integrity_ok(db)
    assert_serving(processor, client)


def json_parses(document) -> bool:
    """Whether protobuf's own JSON mapping accepts `document` (it is lenient in places)."""
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    try:
        json_format.ParseDict(document, trace_service_pb2.ExportTraceServiceRequest(), ignore_unknown_fields=True)
        return True
    except json_format.ParseError:
        return False


def _span_with_many_attributes(step: int, n: int):
    """A step span with `n` attributes, built from bytes (10**6 Python objects would take seconds)."""
    from opentelemetry.proto.trace.v1 import trace_pb2

    span = h.step_span("fuzz-big", 0, step)
    entry = b"\x4a\x07" + b"\x0a\x01a\x12\x02\x18\x01"  # Span.attributes += KeyValue("a", int 1)
    return trace_pb2.Span.FromString(span.SerializeToString() + entry * (n - len(span.attributes)))


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_a_million_attributes_are_refused_and_the_valid_spans_beside_them_kept(processor, client, transport):
    base = 1_000 if transport == "grpc" else 2_000
    big = _span_with_many_attributes(base, 10**6)
    assert len(big.attributes) == 10**6
    valid = [h.step_span("fuzz-big", 0, base + i) for i in (1, 2)]
    request = h.trace_request([h.resource_spans(h.resource_attrs("fuzz-big", 0), [valid[0], big, valid[1]])])
    answer = client.grpc(TRACES, request) if transport == "grpc" else client.http(TRACES, request)
    assert answer.status == (grpc.StatusCode.OK if transport == "grpc" else 200), answer
    assert answer.rejected == 1 and reasons_in(answer.message) == {TOO_MANY: 1}, answer
    stored = stored_step_keys(processor.db, "fuzz-big")
    assert {("fuzz-big", 0, base + 1), ("fuzz-big", 0, base + 2)} <= stored
    assert ("fuzz-big", 0, base) not in stored
    assert_serving(processor, client)


@pytest.mark.slow
def test_gzip_bombs_and_oversized_bodies_are_refused_without_harm(processor, client):
    bomb = gzip_bomb(256 << 20)  # 256 MiB of zeros in a few hundred KiB
    assert len(bomb) < 1 << 20
    answer = client.http_raw(TRACES, bomb, headers={"Content-Encoding": "gzip"})
    assert answer.status == 413, answer
    # Just over the cap after decompression, from a body far below it.
    answer = client.http_raw(TRACES, gzip.compress(bytes((20 << 20) + 1), 1), headers={"Content-Encoding": "gzip"})
    assert answer.status == 413, answer
    answer = client.http_raw(TRACES, bytes((20 << 20) + 1))  # raw, over the cap
    assert answer.status == 413, answer
    # Chunked transfer with no declared length, over the cap.
    # (the receiver answers 413 and closes at once, so the client may only see the reset)
    answer = client.http_raw(TRACES, iter([bytes(1 << 20)] * 21), chunked=True)
    assert answer.status == 413 or str(answer.status).startswith("disconnected"), answer
    # The receiver says `Connection: close` with that 413, so the client drops the connection itself.
    assert client.conn is None
    # gRPC: a 65 MiB message, and the same compressed on the wire (the limit is after inflating).
    huge = h.step_span("fuzz-big", 0, 5)
    huge.attributes.extend(h.kvs({"blob": "z" * (65 << 20)}))
    request = h.trace_request([h.resource_spans(h.resource_attrs("fuzz-big", 0), [huge])])
    assert client.grpc(TRACES, request).status == grpc.StatusCode.RESOURCE_EXHAUSTED
    answer = client.grpc(TRACES, request, compression=grpc.Compression.Gzip)
    assert answer.status == grpc.StatusCode.RESOURCE_EXHAUSTED, answer
    del huge, request
    assert "fuzz-big" not in {k[0] for k in stored_step_keys(processor.db) if k[2] == 5}
    assert_serving(processor, client)


@pytest.mark.slow
def test_resent_requests_add_no_rows(processor, client):
    """Client retries (the same bytes again, many times) are acknowledged and add nothing."""
    requests = [h.steps_request("fuzz-resend", rank, range(1, 6)) for rank in range(4)]
    for request in requests:
        assert client.grpc(TRACES, request).status == grpc.StatusCode.OK
    before = count_rows(processor.db)
    for _ in range(25):
        for i, request in enumerate(requests):
            answer = client.grpc(TRACES, request) if i % 2 else client.http(TRACES, request, "protobuf+gzip")
            assert answer.status in (grpc.StatusCode.OK, 200) and answer.rejected == 0, answer
    assert count_rows(processor.db) == before
    assert len(stored_step_keys(processor.db, "fuzz-resend")) == 20


def test_deeply_nested_json_is_answered_400(processor, client):
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"resourceSpans":' + b"[" * 5_000 + b"]" * 5_000 + b"}"):
        answer = client.http_raw(TRACES, body, "application/json")
        assert answer.status == 400, answer


@pytest.mark.slow
def test_grpc_undecodable_is_counted_and_answered_invalid_argument(processor, client):
    def undecodable() -> float:
        samples = h.prometheus_samples(processor.metrics_text(), "traceml_processor_requests_total")
        reason, signal = v.prometheus_label(v.ATTR_REASON), v.prometheus_label(v.ATTR_SIGNAL)
        return sum(val for labels, val in samples if labels.get(reason) == v.REFUSED_UNDECODABLE
                   and labels.get(signal) == "traces")

    before = undecodable()
    answer = client.grpc_bytes(TRACES, b"\xff\xff\xff\xff")
    assert answer.status == grpc.StatusCode.INVALID_ARGUMENT, answer
    assert wait_until(lambda: undecodable() == before + 1, 10)


def test_refusal_before_reading_the_body_keeps_the_connection_in_step(processor):
    from harness.reliability.fuzz_cases import Ledger

    c = OtlpClient(processor.grpc, processor.http, Ledger())
    try:
        body = h.steps_request("fuzz-keepalive", 0, [1]).SerializeToString()
        assert c.http_raw("/v1/profiles", body).status == 404
        answer = c.http_raw(TRACES, body)  # the same keep-alive connection
        assert (answer.status, answer.rejected) == (200, 0), answer
    finally:
        c.close()


def test_the_processor_logged_no_unexpected_error(processor):
    """No bad input above left a traceback in the processor's log (each one is answered and counted)."""
    log = processor.log_text()
    assert "Traceback (most recent call last)" not in log, log[-5000:]
    assert "CRITICAL" not in log
