"""The processor's summary push names TraceML's processor and its version in User-Agent (issue 31
item 5), as a real receiver sees it over both protocols: the official SDK exporter it pushes with
gets the header (HTTP) or the channel's primary user agent (gRPC), so a collector tells the push
from the ranks' traffic (`TraceML-OTLP-Exporter-Python`, tests/exporter/test_user_agent.py)."""
from __future__ import annotations

import time

import pytest

from harness.otlp_receiver import OtlpTestReceiver
from traceml.processor.metric_point import MetricPoint
from traceml.processor.summary_export import (SummaryExportConfig, build_metrics_data, make_metric_exporter,
                                              processor_resource)
from traceml.schema import vocabulary as v
from traceml.schema.distribution import package_version, user_agent


@pytest.fixture
def receiver():
    with OtlpTestReceiver() as r:
        yield r


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_the_summary_push_names_the_processor(receiver, protocol):
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    exporter = make_metric_exporter(SummaryExportConfig(endpoint=endpoint, protocol=protocol, headers={}))
    try:
        point = MetricPoint("traceml.window.steps", {v.ATTR_RUN_ID: "ua"}, 10.0)
        data = build_metrics_data([point], resource=processor_resource("ua-test"), start_time_ns=time.time_ns())
        exporter.export(data, timeout_millis=10_000)
    finally:
        exporter.shutdown()
    assert len(receiver.metric_requests) == 1
    assert user_agent("Processor") == f"TraceML-Processor-Python/{package_version()}"
    assert receiver.last_headers["user-agent"].startswith(user_agent("Processor")), receiver.last_headers
