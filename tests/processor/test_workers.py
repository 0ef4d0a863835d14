"""`--workers 2`: two processes share the receiver ports; rows, duplicates, counts and run end stay right."""
from __future__ import annotations

import grpc
import pytest
from harness.processor_service import make_service
from harness.stored_rows import count_rows
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from harness.otlp_payloads import run_end_span, steps_request, trace_request

from harness import wait_until


def _own_connection(port: int):
    # A private subchannel pool gives each channel its own TCP connection, so the
    # kernel can hand connections to either process.
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])


@pytest.mark.slow
def test_two_ingest_processes_share_the_ports(tmp_path):
    svc = make_service(tmp_path, workers=2, prometheus=None)
    try:
        assert svc.pool is not None and svc.pool.alive()
        requests = [steps_request("wk", rank, range(10)) for rank in range(8)]
        for request in requests:
            with _own_connection(svc.grpc_port) as channel:
                trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=30)
        for request in requests[:4]:  # retries of the same batches, again on fresh connections
            with _own_connection(svc.grpc_port) as channel:
                trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=30)
        assert count_rows(svc.config.db, run_id="wk") == 80
        counts = svc.stats.snapshot()  # shared memory: both processes' work
        assert counts[("accepted", "traces")] == 80
        assert counts[("duplicate", "traces")] == 40
        for rank in range(8):
            with _own_connection(svc.grpc_port) as channel:
                trace_service_pb2_grpc.TraceServiceStub(channel).Export(
                    trace_request("wk", rank, [run_end_span(rank, 10)], world_size=8), timeout=30)
        # The main process learns of the other process's commits from the store.
        assert wait_until(lambda: (svc.monitor.state("wk") or None) is not None
                          and len(svc.monitor.state("wk").summary_files) == 2, 60)
        assert svc.monitor.state("wk").ended == "markers"
    finally:
        svc.stop()


@pytest.mark.slow
def test_with_workers_one_process_serves_metrics_covering_every_process(tmp_path):
    """The main process aggregates: workers bind only the OTLP ports, their record counts are in shared
    memory, so every scrape (whichever connection) shows all processes' work and the main process's own
    `process_*` metrics."""
    import os
    import urllib.request

    import psutil
    from prometheus_client.parser import text_string_to_metric_families

    svc = make_service(tmp_path, workers=2)
    try:
        for rank in range(8):  # fresh connections: the kernel spreads them over both processes
            with _own_connection(svc.grpc_port) as channel:
                trace_service_pb2_grpc.TraceServiceStub(channel).Export(steps_request("wm", rank, range(5)),
                                                                         timeout=30)
        assert count_rows(svc.config.db, run_id="wm") == 40
        for _ in range(5):
            with urllib.request.urlopen(f"http://127.0.0.1:{svc.prometheus_port}/metrics", timeout=10) as r:
                families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
            accepted = {tuple(sorted(s.labels.items())): s.value for s in families["traceml_processor_records"].samples}
            assert accepted[(("traceml_outcome", "accepted"), ("traceml_signal", "traces"))] == 40
            [start] = families["process_start_time_seconds"].samples  # the main process (this one)
            assert abs(start.value - psutil.Process(os.getpid()).create_time()) < 1.0
    finally:
        svc.stop()
