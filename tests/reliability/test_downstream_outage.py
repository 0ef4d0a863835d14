"""The summary-metrics destination is down for a while, then up.

The processor keeps acknowledging and storing ingest during the outage, counts
and logs the failed pushes (the gap), and once a real OTLP receiver listens on
the configured address it receives summary metrics again whose cumulative
record counters include everything ingested during the outage.
"""
from __future__ import annotations

import logging

import pytest

import grpc
from harness.reliability.fuzz_cases import TRACES, OtlpClient
from harness.otlp_receiver import OtlpTestReceiver, attributes

from harness import free_port, wait_until
from harness.stored_rows import count_rows, stored_step_keys
from harness.reliability import reliability_helpers as h
from traceml.processor.summary_export import SummaryExportConfig
from traceml.processor.service import ProcessorConfig, ProcessorService
from traceml.schema import vocabulary as v

RUN = "outage-run"


class Records(logging.Handler):
    """Keeps the processor's log records (what an operator would see)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def accepted_records(receiver: OtlpTestReceiver) -> float:
    """The latest pushed value of traceml.processor.records{outcome=accepted, signal=traces}."""
    latest = 0.0
    for _res, metric, point in receiver.metric_points():
        attrs = attributes(point.attributes)
        if metric.name == "traceml.processor.records" and attrs.get(v.ATTR_OUTCOME) == "accepted" \
                and attrs.get(v.ATTR_SIGNAL) == "traces":
            latest = point.as_double or float(point.as_int)
    return latest


@pytest.mark.slow
def test_destination_down_then_up_ingest_continues_and_the_gap_is_reported(tmp_path):
    port = free_port()  # nothing listens here yet
    config = ProcessorConfig(db=tmp_path / "traceml.db", otlp_grpc=("127.0.0.1", 0), otlp_http=("127.0.0.1", 0),
                             refresh_interval_s=0.3,
                             export=SummaryExportConfig(endpoint=f"http://127.0.0.1:{port}", protocol="grpc",
                                                     timeout_s=1.0, interval_s=0.5))
    service = ProcessorService(config).start()
    client = OtlpClient(service.grpc_port, service.http_port)
    receiver = OtlpTestReceiver(grpc_port=port)  # started once the outage has been seen
    logged = Records()
    logger = logging.getLogger("traceml.processor.summary_export")
    logger.addHandler(logged)
    step = 0
    try:
        def ingest(n: int = 4) -> None:
            nonlocal step
            for rank in (0, 1):
                answer = client.grpc(TRACES, h.steps_request(RUN, rank, range(step + 1, step + n + 1), world_size=2))
                assert answer.status == grpc.StatusCode.OK and answer.rejected == 0, answer
            step += n

        # Outage: ingest goes on, every batch acknowledged and stored, pushes fail and are counted.
        def outage_seen() -> bool:
            ingest()
            return service.pusher.failed >= 2

        assert wait_until(outage_seen, 60, 0.2)
        during = step
        assert stored_step_keys(config.db, RUN) == {(RUN, r, s) for r in (0, 1) for s in range(1, during + 1)}
        assert service.pusher.sent == 0 and service.pusher.last_error
        # The lost pushes are a self-metric (on /metrics and in the next successful push).
        assert {p.name: p.value for p in service.points()}["traceml.processor.export.failures"] >= 2
        assert any("summary metrics export" in r.getMessage() and "failed" in r.getMessage()
                   for r in logged.records)
        failed_during_outage = service.pusher.failed

        # Recovery: the destination comes up on the same address; pushes resume by themselves.
        receiver.start()
        assert wait_until(lambda: service.pusher.sent >= 1 and accepted_records(receiver) >= 2 * during, 90, 0.2), \
            (service.pusher.sent, service.pusher.failed, service.pusher.last_error)
        ingest()
        assert wait_until(lambda: accepted_records(receiver) >= 2 * step, 30, 0.2)
        names = {metric.name for _r, metric, _p in receiver.metric_points()}
        assert {"traceml.window.steps", "traceml.processor.run.lag"} <= names, names
        pushed_failures = [p.as_double or p.as_int for _r, metric, p in receiver.metric_points()
                           if metric.name == "traceml.processor.export.failures"]
        assert pushed_failures and max(pushed_failures) >= failed_during_outage, pushed_failures
        print(f"\npushes failed during the outage: {failed_during_outage}; sent after: {service.pusher.sent}; "
              f"steps ingested during the outage: {2 * during}")
    finally:
        logger.removeHandler(logged)
        client.close()
        service.stop()
        receiver.stop()
    assert count_rows(config.db) == 2 * step


@pytest.mark.slow
def test_http_destination_down_then_up(tmp_path):
    """The same over OTLP/HTTP: a test receiver started after the outage is found on its port."""
    port = free_port()
    receiver = OtlpTestReceiver(http_port=port)  # started once the outage has been seen
    config = ProcessorConfig(db=tmp_path / "traceml.db", otlp_grpc=("127.0.0.1", 0), otlp_http=None,
                             refresh_interval_s=0.3,
                             export=SummaryExportConfig(endpoint=f"http://127.0.0.1:{port}", protocol="http/protobuf",
                                                     timeout_s=1.0, interval_s=0.5))
    service = ProcessorService(config).start()
    client = OtlpClient(service.grpc_port, 0)
    try:
        assert client.grpc(TRACES, h.steps_request(RUN, 0, range(1, 6), world_size=1)).rejected == 0
        assert wait_until(lambda: service.pusher.failed >= 1, 60, 0.2)
        receiver.start()
        try:
            assert wait_until(lambda: service.pusher.sent >= 1 and accepted_records(receiver) >= 5, 60, 0.2)
        finally:
            receiver.stop()
    finally:
        client.close()
        service.stop()
