"""One bad neighbour does not sink a batch (issue 18 item 8), against a real processor.

Behind a Collector, TraceML's spans share a request with other services'. A
neighbour whose resource carries an attribute map nested 33+ levels deep is past
protobuf's (and json_format's) recursion limit; the request used to be refused
whole (gRPC INVALID_ARGUMENT, HTTP 400) and TraceML's spans in it lost. Now the
readable resources are stored and only the unreadable part is rejected, named in
the OTLP partial success. Sent over gRPC with the official generated stub, and
over HTTP as protobuf and as OTLP/JSON.
"""
from __future__ import annotations

import http.client
import json

import grpc
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from harness.stored_rows import stored_memory_keys, stored_step_keys
from harness.otlp_payloads import memory_request, step_span, steps_request

from traceml.schema import vocabulary as v

DEPTH = 40  # kvlist levels: past upb's and json_format's 100-message limit (~33 levels)
PB, JSON = "application/x-protobuf", "application/json"


def _deep(value, depth: int = DEPTH) -> None:
    """Nest `value` (an AnyValue) `depth` maps deep, in place (a constructor would re-parse it)."""
    for i in range(depth):
        value = value.kvlist_value.values.add(key=f"level{i}").value
    value.string_value = "bottom"


def _neighbour_spans(request, service: str = "web-shop", spans: int = 3) -> None:
    rs = request.resource_spans.add()
    rs.resource.attributes.add(key=v.RES_SERVICE_NAME).value.string_value = service
    _deep(rs.resource.attributes.add(key="config").value)
    scope = rs.scope_spans.add()
    scope.scope.name = "flask"
    for i in range(spans):
        scope.spans.add(trace_id=bytes([i + 1]) * 16, span_id=bytes([i + 1]) * 8, name=f"GET /items/{i}",
                        start_time_unix_nano=1, end_time_unix_nano=2)


def _mixed_request(run_id: str) -> trace_pb2.ExportTraceServiceRequest:
    """The neighbour first, then a TraceML rank's five steps, in one request."""
    request = trace_pb2.ExportTraceServiceRequest()
    _neighbour_spans(request)
    request.resource_spans.extend(steps_request(run_id, 0, range(5)).resource_spans)
    return request


def _post(port: int, path: str, body: bytes, content_type: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": content_type})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _to_json(request) -> dict:
    """OTLP/JSON as a Collector writes it (hex ids), built from the readable parts only:
    json_format itself refuses to convert the deep neighbour."""
    neighbour = request.resource_spans[0]
    rest = trace_pb2.ExportTraceServiceRequest(resource_spans=list(request.resource_spans)[1:])
    doc = json_format.MessageToDict(rest, use_integers_for_enums=True)
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for key in ("traceId", "spanId"):
                    span[key] = __import__("base64").b64decode(span[key]).hex()
    deep = {"stringValue": "bottom"}
    for i in reversed(range(DEPTH)):
        deep = {"kvlistValue": {"values": [{"key": f"level{i}", "value": deep}]}}
    spans = [{"traceId": f"{i + 1:02x}" * 16, "spanId": f"{i + 1:02x}" * 8, "name": s.name}
             for i, s in enumerate(neighbour.scope_spans[0].spans)]
    doc["resourceSpans"].insert(0, {
        "resource": {"attributes": [{"key": v.RES_SERVICE_NAME, "value": {"stringValue": "web-shop"}},
                                    {"key": "config", "value": deep}]},
        "scopeSpans": [{"scope": {"name": "flask"}, "spans": spans}]})
    return doc


def _assert_kept_and_named(service, run_id: str, partial) -> None:
    assert stored_step_keys(service.config.db, run_id) == {(run_id, 0, s) for s in range(5)}
    assert partial.rejected_spans == 3
    message = partial.error_message
    assert "nested_too_deeply=3" in message and "resource_spans[0]" in message and "'web-shop'" in message


def test_grpc_official_stub_keeps_the_traceml_resource_and_names_the_neighbour(service):
    run_id = "neighbour-grpc"
    with grpc.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
        response = trace_service_pb2_grpc.TraceServiceStub(channel).Export(_mixed_request(run_id), timeout=10)
    _assert_kept_and_named(service, run_id, response.partial_success)


def test_http_protobuf_keeps_the_traceml_resource_and_names_the_neighbour(service):
    run_id = "neighbour-http"
    status, body = _post(service.http_port, "/v1/traces", _mixed_request(run_id).SerializeToString(), PB)
    assert status == 200
    _assert_kept_and_named(service, run_id, trace_pb2.ExportTraceServiceResponse.FromString(body).partial_success)


@pytest.mark.parametrize("json_depth", ["parse_dict_limit", "json_loads_limit"])
def test_http_json_keeps_the_traceml_resource_and_names_the_neighbour(service, json_depth):
    run_id = f"neighbour-json-{json_depth}"
    doc = _to_json(_mixed_request(run_id))
    text = json.dumps(doc)
    if json_depth == "json_loads_limit":  # ~1,600 JSON levels: past Python's recursion limit too
        deep = '{"stringValue":"bottom"}'
        for i in range(400):
            deep = '{"kvlistValue":{"values":[{"key":"l%d","value":%s}]}}' % (i, deep)
        marker = json.dumps(doc["resourceSpans"][0]["resource"]["attributes"][1]["value"])
        assert marker in text
        text = text.replace(marker, deep, 1)
    status, body = _post(service.http_port, "/v1/traces", text.encode(), JSON)
    assert status == 200, body
    response = json_format.Parse(body, trace_pb2.ExportTraceServiceResponse())
    _assert_kept_and_named(service, run_id, response.partial_success)


def test_one_deep_span_is_rejected_alone_and_its_siblings_kept(service):
    run_id = "neighbour-span"
    request = steps_request(run_id, 0, range(4))
    spans = request.resource_spans[0].scope_spans[0].spans
    good = list(spans)
    del spans[:]
    for span in good[:2]:
        spans.add().CopyFrom(span)
    bad = spans.add()  # built in place: inserting a finished deep message would re-parse it
    bad.CopyFrom(step_span(9, 0))
    _deep(bad.attributes.add(key="user.config").value)
    for span in good[2:]:
        spans.add().CopyFrom(span)
    with grpc.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
        response = trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=10)
    assert stored_step_keys(service.config.db, run_id) == {(run_id, 0, s) for s in range(4)}
    assert response.partial_success.rejected_spans == 1
    assert "resource_spans[0].scope_spans[0].spans[2]" in response.partial_success.error_message


def test_metrics_beside_a_deep_neighbour_are_kept(service):
    run_id = "neighbour-metrics"
    request = metrics_pb2.ExportMetricsServiceRequest()
    rm = request.resource_metrics.add()
    rm.resource.attributes.add(key=v.RES_SERVICE_NAME).value.string_value = "db-pool"
    _deep(rm.resource.attributes.add(key="config").value)
    gauge = rm.scope_metrics.add().metrics.add(name="db.connections").gauge
    for i in range(2):
        gauge.data_points.add(as_int=i, time_unix_nano=1)
    request.resource_metrics.extend(memory_request(run_id, 0, [1, 2]).resource_metrics)
    with grpc.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
        response = metrics_service_pb2_grpc.MetricsServiceStub(channel).Export(request, timeout=10)
    assert {k for k in stored_memory_keys(service.config.db) if k[0] == run_id} == {
        (run_id, 0, 1, "cuda:0"), (run_id, 0, 2, "cuda:0")}
    assert response.partial_success.rejected_data_points == 2
    assert "'db-pool'" in response.partial_success.error_message


def test_a_request_with_nothing_readable_is_still_refused_whole(service):
    request = trace_pb2.ExportTraceServiceRequest()
    _neighbour_spans(request)
    with grpc.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _post(service.http_port, "/v1/traces", request.SerializeToString(), PB)[0] == 400
