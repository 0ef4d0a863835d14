"""Both transports of TraceML's exporter name TraceML and its version in User-Agent (issue 31 item 5),
as a real receiver sees it: gRPC metadata (`grpc.primary_user_agent`, before grpc-python's own) and
the HTTP header. A User-Agent the user configured in the OTLP headers wins over HTTP's."""
from __future__ import annotations

import threading
import time

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from harness.otlp_receiver import OtlpTestReceiver
from traceml.exporter.settings import SignalSettings
from traceml.exporter.transport import GrpcTransport, HttpTransport, user_agent
from traceml.schema.distribution import package_version


@pytest.fixture
def receiver():
    with OtlpTestReceiver() as r:
        yield r


def _send(transport) -> None:
    try:
        outcome = transport.export("traces", trace_service_pb2.ExportTraceServiceRequest(), time.monotonic() + 10)
    finally:
        transport.close()
    assert outcome.delivered, outcome


def test_grpc_and_http_send_traceml_and_its_version(receiver):
    expected = f"TraceML-OTLP-Exporter-Python/{package_version()}"
    assert user_agent() == expected and package_version() != "0+unknown"
    _send(GrpcTransport(SignalSettings(endpoint=receiver.grpc_endpoint, protocol="grpc"), threading.Event()))
    assert receiver.last_headers["user-agent"].startswith(expected + " grpc-python/"), receiver.last_headers
    _send(HttpTransport(SignalSettings(endpoint=receiver.http_endpoint + "/v1/traces", protocol="http/protobuf"),
                        threading.Event()))
    assert receiver.last_headers["user-agent"] == expected


def test_a_configured_user_agent_wins_over_http(receiver):
    settings = SignalSettings(endpoint=receiver.http_endpoint + "/v1/traces", protocol="http/protobuf",
                              headers=(("user-agent", "my-gateway-client/2"),))
    _send(HttpTransport(settings, threading.Event()))
    assert receiver.last_headers["user-agent"] == "my-gateway-client/2"
