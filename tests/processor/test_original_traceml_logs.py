"""The original TraceML's OTLP log records, received over both transports and diagnosed (issue 34).

One module-scoped run feeds every assertion: four real rank processes
(`harness/original_traceml_logs.py`: the official OpenTelemetry SDK's logs API, one
Resource per rank and run) send, at once, to one in-process processor:

- `orig-straggler`: rank 1's data wait 40 ms longer per step, every other rank waiting
  that long in backward, in windows of 5 steps (one record per window, #231);
- `orig-balanced`: the same job with nothing slowed, one record per step;
- both again through `rotel-agent` as a relay (`-rotel`), so a Collector in between
  changes nothing.

Ranks 0 and 1 send over OTLP/gRPC, ranks 2 and 3 over OTLP/HTTP (protobuf). OTLP/JSON,
the records no row is built from, shapes that cannot be placed and bad payloads are sent
beside them by hand, each answer checked, and every valid record must still be stored.
"""
from __future__ import annotations

import gzip
import http.client
import json
import subprocess

import grpc
import pytest
from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as logs_pb2
from opentelemetry.proto.common.v1 import common_pb2

from harness.child_python import child_env, module_command
from harness.otlp_payloads import steps_request
from harness.processor_service import make_service
from harness.rotel_relay import RotelRelay
from harness.stored_rows import count_rows, stored_step_keys
from harness.waiting import wait_until
from traceml.processor.security import BearerAuth
from traceml.processor.self_telemetry import KEYS
from traceml.processor.summary_section import build_final_summary
from traceml.schema import vocabulary as v

pytestmark = pytest.mark.slow

WORLD = 4
WINDOWS = 24  # records per rank and run
STRAGGLER_WINDOW = 5  # steps per record in the straggler run
STRAGGLERS = {"INPUT_STRAGGLER", "H2D_STRAGGLER", "COMPUTE_STRAGGLER", "STRAGGLER"}
LOGS_EXPORT = "/opentelemetry.proto.collector.logs.v1.LogsService/Export"
JSON = "application/json"
PROTOBUF = "application/x-protobuf"


def _send_all(service, relay) -> list[str]:
    direct = {"grpc": f"127.0.0.1:{service.grpc_port}", "http": f"http://127.0.0.1:{service.http_port}"}
    relayed = {"grpc": f"127.0.0.1:{relay.grpc_port}", "http": f"http://127.0.0.1:{relay.http_port}"}
    procs = []
    for rank in range(WORLD):
        protocol = "grpc" if rank < 2 else "http"
        runs = []
        for suffix, endpoints in (("", direct), ("-rotel", relayed)):
            runs += ["--run", f"orig-straggler{suffix}", protocol, endpoints[protocol], str(STRAGGLER_WINDOW), "1",
                     "--run", f"orig-balanced{suffix}", protocol, endpoints[protocol], "1", "-"]
        procs.append(subprocess.Popen(
            module_command("harness.original_traceml_logs", "--rank", str(rank), "--world-size", str(WORLD),
                           "--windows", str(WINDOWS), *runs),
            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        outputs.append(out)
    return outputs


@pytest.fixture(scope="module")
def sent(tmp_path_factory):
    folder = tmp_path_factory.mktemp("original-traceml")
    service = make_service(folder)
    try:
        with RotelRelay(folder / "rotel", f"http://127.0.0.1:{service.grpc_port}", "grpc",
                        ["--batch-timeout", "200ms"]) as relay:
            outputs = _send_all(service, relay)
            runs = ("orig-straggler", "orig-balanced", "orig-straggler-rotel", "orig-balanced-rotel")
            assert wait_until(lambda: all(count_rows(service.config.db, run_id=run) == WORLD * WINDOWS
                                          for run in runs), 60), relay.log_text()[-2000:]
        yield service, outputs
    finally:
        service.stop()


def _summary(service, run_id: str) -> dict:
    return build_final_summary(service.config.db, run_id)


def _counter(service, metric: str, outcome: str, reason: str | None = None) -> int:
    return sum(value for key, value in zip(KEYS, service.stats._values)
               if key.metric == metric and key.outcome == outcome and key.signal == v.SIGNAL_LOGS
               and key.reason == reason)


def _post(service, body: bytes, content_type: str = PROTOBUF, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", service.http_port, timeout=30)
    try:
        conn.request("POST", "/v1/logs", body=body, headers={"Content-Type": content_type, **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _post_traces(service, body: bytes):
    conn = http.client.HTTPConnection("127.0.0.1", service.http_port, timeout=30)
    try:
        conn.request("POST", "/v1/traces", body=body, headers={"Content-Type": PROTOBUF})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _grpc(service, body: bytes, metadata=()):
    with grpc.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
        call = channel.unary_unary(LOGS_EXPORT, request_serializer=None, response_deserializer=None)
        try:
            return grpc.StatusCode.OK, logs_pb2.ExportLogsServiceResponse.FromString(call(body, timeout=30,
                                                                                           metadata=metadata))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()


def _kv(key: str, value) -> common_pb2.KeyValue:
    kv = common_pb2.KeyValue(key=key)
    if isinstance(value, bool):
        kv.value.bool_value = value
    elif isinstance(value, int):
        kv.value.int_value = value
    elif isinstance(value, float):
        kv.value.double_value = value
    elif isinstance(value, str):
        kv.value.string_value = value
    elif isinstance(value, dict):
        kv.value.kvlist_value.values.extend(_kv(k, val) for k, val in value.items())
    return kv


def _record(request, session: str, rank: int, step: int, *, kind="step_timing", version=1, body=None,
            backward_ms=45.0):
    """One record in the documented shape (docs/wire-format.md), built by hand."""
    rl = request.resource_logs.add()
    rl.resource.attributes.extend([_kv("traceml.session_id", session), _kv("traceml.global_rank", rank),
                                   _kv("traceml.world_size", 2), _kv("host.name", "h")])
    record = rl.scope_logs.add().log_records.add(time_unix_nano=1_700_000_000_000_000_000 + step * 10**8)
    record.attributes.extend([_kv("traceml.record_kind", kind), _kv("traceml.schema_version", version)])
    if body is None:
        body = {"step": step, "timestamp": 1_700_000_000.0 + step * 0.1, "data_wait_ms": 4.0,
                "forward_ms": 30.0, "backward_ms": backward_ms, "optimizer_ms": 10.0, "step_wall_ms": 90.0}
    if isinstance(body, dict):
        record.body.kvlist_value.values.extend(_kv(k, val) for k, val in body.items())
    else:
        record.body.string_value = body
    return record


def _to_json(request) -> bytes:
    return json.dumps(json_format.MessageToDict(request, use_integers_for_enums=True)).encode()


# --- the real multi-rank run ---------------------------------------------------------------------


def test_every_record_arrives_over_both_transports(sent):
    service, outputs = sent
    assert all(f"{WINDOWS * 4} step_timing records sent" in out for out in outputs), outputs
    for run in ("orig-straggler", "orig-balanced"):
        assert {rank for _, rank, _ in stored_step_keys(service.config.db, run)} == set(range(WORLD))
    # A windowed record is one row keyed by its window's first step: no step of the window is invented.
    assert {step for _, _, step in stored_step_keys(service.config.db, "orig-straggler")} == \
        {w * STRAGGLER_WINDOW for w in range(WINDOWS)}
    assert {step for _, _, step in stored_step_keys(service.config.db, "orig-balanced")} == set(range(WINDOWS))
    # runtime_context and step_memory (2 per rank and run, 4 runs) build no row and are counted.
    assert _counter(service, v.METRIC_PROCESSOR_RECORDS, v.RECORD_IGNORED) >= 2 * WORLD * 4


def test_the_slowed_rank_is_named_the_straggler(sent):
    service, _ = sent
    summary = _summary(service, "orig-straggler")
    assert summary["diagnosis"]["kind"] == "INPUT_STRAGGLER", summary["card"]
    assert summary["diagnosis"]["culprit_rank"] == 1
    assert summary["diagnosis"]["evidence"]["grown_phase"] == "input_wait"
    assert summary["telemetry"]["started_part_way"] is False  # the first window (steps 0-4) is step 0
    # Which mapping the run came through, and the training steps its rows stand for (24 windows of 5).
    [source] = summary["telemetry"]["sources"]
    assert (source["mapping"], source["ranks"], source["steps"], source["unmeasured_phases"]) == \
        ("traceml-logs", list(range(WORLD)), WORLD * WINDOWS * STRAGGLER_WINDOW, ["collective_wait"])


def test_a_balanced_run_names_no_straggler(sent):
    service, _ = sent
    summary = _summary(service, "orig-balanced")
    assert not {issue["kind"] for issue in summary["issues"]} & STRAGGLERS, summary["card"]
    assert summary["diagnosis"]["culprit_rank"] is None


def test_a_rotel_relay_in_between_changes_nothing(sent):
    service, _ = sent
    for run in ("orig-straggler", "orig-balanced"):
        direct, relayed = _summary(service, run), _summary(service, f"{run}-rotel")
        assert stored_step_keys(service.config.db, f"{run}-rotel") == \
            {(f"{run}-rotel", rank, step) for _, rank, step in stored_step_keys(service.config.db, run)}
        assert [(i["kind"], i["culprit_rank"]) for i in relayed["issues"]] == \
            [(i["kind"], i["culprit_rank"]) for i in direct["issues"]]
        assert [g["metrics"] for g in relayed["groups"]] == [g["metrics"] for g in direct["groups"]]


# --- by hand: JSON, what cannot be placed, bad payloads -------------------------------------------


def test_otlp_json_is_read_like_protobuf(sent):
    service, _ = sent
    request = logs_pb2.ExportLogsServiceRequest()
    for step in range(3):
        _record(request, "orig-json", 0, step)
    status, body = _post(service, _to_json(request), JSON)
    assert status == 200 and json.loads(body) == {}, body
    assert stored_step_keys(service.config.db, "orig-json") == {("orig-json", 0, s) for s in range(3)}


@pytest.mark.parametrize("transport", ["grpc", "http-protobuf", "http-json"])
def test_shapes_that_cannot_be_placed_are_counted_not_guessed(sent, transport):
    service, _ = sent
    run = f"orig-unplaced-{transport}"
    request = logs_pb2.ExportLogsServiceRequest()
    _record(request, run, 0, 0)  # valid: kept
    _record(request, run, 0, 1, version=2)  # a schema version we do not know
    _record(request, run, 0, 2, body="step 2: 90 ms")  # preformatted text, not the structured record
    _record(request, run, 0, 3, body={"forward_ms": 30.0})  # no step number
    _record(request, run, 0, 4, kind="step_memory")  # builds no row
    foreign = request.resource_logs.add().scope_logs.add().log_records.add()
    foreign.body.string_value = "GET /health 200"  # someone else's log line
    _record(request, run, 0, 5, backward_ms=-1.0)  # a value that breaks a rule: rejected
    if transport == "grpc":
        code, response = _grpc(service, request.SerializeToString())
        assert code == grpc.StatusCode.OK
        rejected, message = response.partial_success.rejected_log_records, response.partial_success.error_message
    else:
        json_body = transport == "http-json"
        status, body = _post(service, _to_json(request) if json_body else request.SerializeToString(),
                             JSON if json_body else PROTOBUF)
        assert status == 200, body
        if json_body:
            partial = json.loads(body)["partialSuccess"]
            rejected, message = int(partial["rejectedLogRecords"]), partial["errorMessage"]
        else:
            response = logs_pb2.ExportLogsServiceResponse.FromString(body)
            rejected, message = response.partial_success.rejected_log_records, response.partial_success.error_message
    assert rejected == 1 and "negative_value=1" in message, message
    assert "unplaced_foreign=3" in message and "unused_record=1" in message and "not_traceml=1" in message, message
    assert stored_step_keys(service.config.db, run) == {(run, 0, 0)}


def test_a_rank_that_sends_our_own_step_spans_keeps_them_over_its_log_records(sent):
    service, _ = sent
    run = "orig-mixed"
    status, body = _post_traces(service, steps_request(run, 0, [0], world_size=2).SerializeToString())
    assert status == 200, body
    before = _summary(service, run)["groups"][0]["metrics"]
    request = logs_pb2.ExportLogsServiceRequest()
    _record(request, run, 0, 0, backward_ms=500.0)  # the same step, read another way
    _record(request, run, 1, 0)  # rank 1 sends only log records: kept
    code, response = _grpc(service, request.SerializeToString())
    assert code == grpc.StatusCode.OK and "traceml_spans_win=1" in response.partial_success.error_message
    assert stored_step_keys(service.config.db, run) == {(run, 0, 0), (run, 1, 0)}
    assert _summary(service, run)["groups"][0]["metrics"]["backward_ms"] == before["backward_ms"]


def test_bad_payloads_are_refused_clearly_and_lose_nothing_valid(sent):
    service, _ = sent
    run = "orig-bad-payloads"
    refused_before = _counter(service, v.METRIC_PROCESSOR_REQUESTS, v.REQUEST_REFUSED, v.REFUSED_UNDECODABLE)
    valid = logs_pb2.ExportLogsServiceRequest()
    step = iter(range(100))

    def send_valid() -> None:
        request = logs_pb2.ExportLogsServiceRequest()
        _record(request, run, 0, next(step))
        status, body = _post(service, request.SerializeToString())
        assert status == 200 and body == b"", body

    for body, content_type, expected in (
            (b"\xff\xff\xff garbage", PROTOBUF, 400),
            (b"{not json", JSON, 400),
            (b'{"resourceLogs": 7}', JSON, 400),
            (b"[]", JSON, 400),
            (b"x", "text/plain", 415)):
        status, answer = _post(service, body, content_type)
        assert status == expected, (body, status, answer)
        message = (json.loads(answer)["message"] if content_type == JSON
                   else status_pb2.Status.FromString(answer).message)
        assert message, answer  # a clear reason, in the request's encoding
        send_valid()
    code, details = _grpc(service, b"\xff\xff\xff\xff")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "undecodable logs request" in details
    send_valid()
    # Past the size cap after decompression: 413, nothing read.
    bomb = gzip.compress(b"\0" * (21 * 1024 * 1024))
    status, _ = _post(service, bomb, headers={"Content-Encoding": "gzip"})
    assert status == 413
    send_valid()
    # One resource nested past protobuf's limit beside a readable one: that one is kept.
    _record(valid, run, 0, next(step))
    deep = common_pb2.AnyValue()
    node = deep
    for _ in range(60):
        node = node.kvlist_value.values.add(key="k").value
    bad = valid.resource_logs.add()
    bad.resource.attributes.add(key="service.name").value.string_value = "web-shop"
    bad.resource.attributes.add(key="deep").value.CopyFrom(deep)
    bad.scope_logs.add().log_records.add().body.string_value = "x"
    code, response = _grpc(service, valid.SerializeToString())
    assert code == grpc.StatusCode.OK
    assert response.partial_success.rejected_log_records == 1
    assert "web-shop" in response.partial_success.error_message
    sent_steps = next(step)
    assert stored_step_keys(service.config.db, run) == {(run, 0, s) for s in range(sent_steps)}
    assert _counter(service, v.METRIC_PROCESSOR_REQUESTS, v.REQUEST_REFUSED, v.REFUSED_UNDECODABLE) \
        >= refused_before + 5


def test_logs_get_the_token_check_and_admission_of_every_signal(tmp_path):
    service = make_service(tmp_path, auth=BearerAuth("s3cret"), max_concurrent_requests=1)
    try:
        request = logs_pb2.ExportLogsServiceRequest()
        _record(request, "orig-auth", 0, 0)
        status, _ = _post(service, request.SerializeToString())
        assert status == 401
        code, _ = _grpc(service, request.SerializeToString())
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert count_rows(service.config.db, run_id="orig-auth") == 0
        status, _ = _post(service, request.SerializeToString(), headers={"Authorization": "Bearer s3cret"})
        assert status == 200
        code, _ = _grpc(service, request.SerializeToString(), metadata=(("authorization", "Bearer s3cret"),))
        assert code == grpc.StatusCode.OK  # a resent record adds no row
        assert stored_step_keys(service.config.db, "orig-auth") == {("orig-auth", 0, 0)}
        assert _counter(service, v.METRIC_PROCESSOR_REQUESTS, v.REQUEST_REFUSED, v.REFUSED_UNAUTHENTICATED) == 2
        # Over the concurrent-request limit: 429 with Retry-After before the body is read, which
        # every OTLP client (and the Collector) retries. One request holds the only slot.
        body = request.SerializeToString()
        holder = http.client.HTTPConnection("127.0.0.1", service.http_port, timeout=30)
        holder.putrequest("POST", "/v1/logs")
        for key, value in (("Content-Type", PROTOBUF), ("Content-Length", str(len(body))),
                           ("Authorization", "Bearer s3cret")):
            holder.putheader(key, value)
        holder.endheaders()
        try:
            assert wait_until(lambda: service.http.app.in_flight == 1, 10)
            conn = http.client.HTTPConnection("127.0.0.1", service.http_port, timeout=30)
            conn.request("POST", "/v1/logs", body=body, headers={"Content-Type": PROTOBUF,
                                                                 "Authorization": "Bearer s3cret"})
            refused = conn.getresponse()
            assert refused.status == 429 and refused.getheader("Retry-After"), refused.status
            refused.read()
            conn.close()
            holder.send(body)
            assert holder.getresponse().status == 200
        finally:
            holder.close()
        assert _counter(service, v.METRIC_PROCESSOR_REQUESTS, v.REQUEST_REFUSED, v.REFUSED_OVER_LIMIT) == 1
    finally:
        service.stop()
