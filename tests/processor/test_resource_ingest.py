"""Resource samples in the store: a rank's own kept, foreign ones joined to the hosts of stored ranks.

The store and ingest queue on real records from the real decoder, then a real
`traceml-processor` fed by the official OpenTelemetry SDK: step spans for a run on
host `host-a`, and `hostmetrics`-named metrics from two other SDK senders, one on
`host-a` and one on a host no run uses.
"""
from __future__ import annotations

import dataclasses
import sqlite3
import time

import pytest

from harness.resource_payloads import (
    dcgm_request,
    gauge,
    hostmetrics_request,
    metrics_request,
    point,
    rank_resource,
    updown,
)
from harness.otlp_payloads import steps_request

from traceml.processor import sqlite_writer
from traceml.processor.decode import Decoder
from traceml.processor.store_records import IGNORED_UNKNOWN_HOST
from traceml.processor.ingest import IngestQueue
from traceml.processor.summary_section import build_final_summary
from traceml.processor.self_telemetry import SelfTelemetry
from traceml.processor.sqlite_guard import check_database
from traceml.processor.sqlite_layout import DDL, RESOURCE_COLUMNS, SCHEMA_USER_VERSION
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.schema import resources as sr
from traceml.schema import vocabulary as v

GIB = 1 << 30
CPU = [{"user": 0.6, "system": 0.1, "idle": 0.3}, {"user": 0.2, "idle": 0.8}]
MEMORY = {"used": 10 * GIB, "free": 5 * GIB, "cached": GIB}


def _rows(db, where: str = "1", args: tuple = ()) -> list[dict]:
    conn = sqlite3.connect(db)
    try:
        return [dict(zip(RESOURCE_COLUMNS, row)) for row in conn.execute(
            f"SELECT {', '.join(RESOURCE_COLUMNS)} FROM resource_samples WHERE {where} ORDER BY id", args)]
    finally:
        conn.close()


def _steps(store: StepTimeStore, run_id: str = "run-1", rank: int = 0, *, receive_time: float | None = None):
    batch = Decoder().decode_traces(steps_request(run_id, rank, range(3)))  # host.name = host-a
    store.write(batch.step_records, receive_time=receive_time)


def _foreign(host: str, **kw):
    return Decoder().decode_metrics(hostmetrics_request(host, cpu_modes=CPU, memory_states=MEMORY, **kw))


@pytest.fixture
def store(tmp_path):
    with StepTimeStore(tmp_path / "traceml.db") as s:
        yield s


def test_a_ranks_own_samples_are_stored_with_its_run_and_rank_even_before_its_steps(store):
    batch = Decoder().decode_metrics(metrics_request(rank_resource("run-1", 2, host="host-z"), [
        updown(sr.PROCESS_MEMORY_USAGE, [point(3 * GIB)]), gauge(sr.PROCESS_CPU_UTILIZATION, [point(0.5)])]))
    result = store.write((), (), batch.resource_records)
    assert (result.accepted, result.duplicates, result.unjoined_resources) == (2, 0, ())
    rows = _rows(store.path)
    assert {(r["metric"], r["value"]) for r in rows} == {(sr.PROCESS_MEMORY_USAGE, 3 * GIB),
                                                         (sr.PROCESS_CPU_UTILIZATION, 0.5)}
    assert {(r["run_id"], r["global_rank"], r["host"], r["device"], r["source"], r["pid"]) for r in rows} == {
        ("run-1", 2, "host-z", "", sr.SOURCE_TRACEML, 4242)}


def test_foreign_samples_are_kept_only_on_a_host_where_a_stored_rank_runs(store):
    _steps(store)
    known, unknown = _foreign("host-a"), _foreign("elsewhere")
    result = store.write((), (), [*known.resource_records, *unknown.resource_records])
    n = len(known.resource_records)
    assert n == 3  # busy fraction, used memory, the limit summed from the states
    assert result.accepted == n and result.unjoined_resources == tuple(range(n, 2 * n))
    rows = _rows(store.path)
    assert {r["host"] for r in rows} == {"host-a"}
    got = {r["metric"]: r["value"] for r in rows}
    assert got == {sr.SYSTEM_CPU_UTILIZATION: pytest.approx(0.45), sr.SYSTEM_MEMORY_USAGE: 10 * GIB,
                   sr.SYSTEM_MEMORY_LIMIT: 16 * GIB}
    assert all(r["run_id"] is None and r["global_rank"] is None and r["source"] == sr.SOURCE_HOSTMETRICS
               for r in rows)


def test_a_host_becomes_known_in_the_same_write_as_its_first_step(store):
    batch = Decoder().decode_traces(steps_request("run-1", 0, range(2)))
    result = store.write(batch.step_records, (), _foreign("host-a").resource_records)
    assert result.unjoined_resources == () and len(_rows(store.path)) == 3


def test_a_host_whose_ranks_fell_silent_long_ago_takes_no_more_foreign_samples(store):
    _steps(store, receive_time=time.time() - sqlite_writer.HOST_ACTIVE_S - 60)
    reopened = StepTimeStore(store.path)  # a fresh writer: nothing remembered, the store is asked
    try:
        result = reopened.write((), (), _foreign("host-a").resource_records)
    finally:
        reopened.close()
    assert len(result.unjoined_resources) == 3 and _rows(store.path) == []


def test_a_host_known_to_another_writer_is_found_in_the_store(store, tmp_path):
    other = StepTimeStore(tmp_path / "traceml.db")  # as an ingest worker's writer would be
    try:
        assert len(other.write((), (), _foreign("host-a").resource_records).unjoined_resources) == 3
        _steps(store)
        # The miss is remembered briefly (HOST_RECHECK_S), then the store is asked again.
        assert len(other.write((), (), _foreign("host-a").resource_records).unjoined_resources) == 3
        other._host_misses.clear()
        assert other.write((), (), _foreign("host-a").resource_records).unjoined_resources == ()
    finally:
        other.close()


def test_a_foreign_process_figure_is_kept_only_for_a_pid_a_rank_on_that_host_named(store):
    _steps(store)
    own = Decoder().decode_metrics(metrics_request(rank_resource("run-1", 0, host="host-a", pid=101), [
        updown(sr.CUDA_MEMORY_ALLOCATED, [point(GIB, {v.ATTR_DEVICE: "cuda:0"})])]))
    store.write((), (), own.resource_records)

    def scraped(pid: int):
        attrs = {v.RES_HOST_NAME: "host-a", sr.RES_PROCESS_PID: pid}
        return Decoder().decode_metrics(metrics_request(attrs, [updown(sr.PROCESS_MEMORY_USAGE, [point(7 * GIB)])]))

    kept, other = scraped(101), scraped(999)
    result = store.write((), (), [*kept.resource_records, *other.resource_records])
    assert result.unjoined_resources == (1,)
    rows = _rows(store.path, "source = ?", (sr.SOURCE_HOSTMETRICS,))
    assert [(r["metric"], r["pid"], r["value"]) for r in rows] == [(sr.PROCESS_MEMORY_USAGE, 101, 7 * GIB)]


def test_dcgm_samples_join_by_host_too(store):
    _steps(store)
    fields = {"DCGM_FI_DEV_GPU_UTIL": 40.0, "DCGM_FI_DEV_GPU_TEMP": 55.0}
    here = Decoder().decode_metrics(dcgm_request("host-a", fields)).resource_records
    there = Decoder().decode_metrics(dcgm_request("node-x", fields)).resource_records
    result = store.write((), (), [*here, *there])
    assert result.unjoined_resources == (2, 3)
    assert {(r["host"], r["device"], r["source"]) for r in _rows(store.path)} == {("host-a", "GPU-1234",
                                                                                  sr.SOURCE_DCGM)}


def test_a_resent_sample_adds_nothing(store):
    _steps(store)
    records = _foreign("host-a", time_ns=1_790_000_000_000_000_000).resource_records
    first, again = store.write((), (), records), store.write((), (), records)
    assert (first.accepted, first.duplicates) == (3, 0)
    assert (again.accepted, again.duplicates) == (0, 3)
    assert len(_rows(store.path)) == 3


def test_resource_rows_stay_when_the_run_restarts_as_a_new_attempt(store):
    def rank_records(attempt: int):
        attrs = {**rank_resource("run-1", 0), v.ATTR_RUN_ATTEMPT: attempt}
        return Decoder().decode_metrics(metrics_request(attrs, [updown(sr.PROCESS_MEMORY_USAGE,
                                                                       [point(GIB + attempt)])])).resource_records

    store.write((), (), rank_records(0))
    batch = Decoder().decode_traces(steps_request("run-1", 0, range(2)))
    store.write([dataclasses.replace(r, attempt=1) for r in batch.step_records])
    store.write((), (), rank_records(1))
    assert sorted(r["value"] for r in _rows(store.path)) == [GIB, GIB + 1]


def test_a_version_3_database_is_brought_up_to_date(tmp_path):
    db = tmp_path / "old.db"
    conn = sqlite3.connect(db)
    conn.executescript(DDL)
    conn.executescript("DROP TABLE resource_samples; DROP TABLE step_time_sources; DROP TABLE fleet_culprits;"
                       + "".join(f"ALTER TABLE {table} DROP COLUMN {column};"  # version 7's span ids
                                 for table in ("step_time_samples", "step_time_attempt_samples")
                                 for column in ("trace_id", "span_id"))
                       + "PRAGMA user_version = 3;")
    conn.close()
    assert SCHEMA_USER_VERSION > 3
    assert check_database(db).new is False  # ours, older: accepted
    with StepTimeStore(db) as s:
        _steps(s)
        assert s.write((), (), _foreign("host-a").resource_records).accepted == 3
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_USER_VERSION
    finally:
        conn.close()


def test_the_ingest_queue_counts_stored_samples_accepted_and_unjoined_ones_ignored(store):
    _steps(store)
    stats = SelfTelemetry()
    queue = IngestQueue(store, stats=stats)
    queue.start()
    try:
        own = Decoder().decode_metrics(metrics_request(rank_resource("run-1", 0), [
            updown(sr.PROCESS_MEMORY_USAGE, [point(GIB)])]))
        known, unknown = _foreign("host-a"), _foreign("elsewhere")
        outcomes = [queue.submit(b) for b in (own, known, unknown)]
    finally:
        queue.stop()
    assert [(o.accepted, o.duplicates) for o in outcomes] == [(1, 0), (3, 0), (0, 0)]
    assert unknown.ignored == {IGNORED_UNKNOWN_HOST: 3} and not known.ignored
    assert "unknown_host=3" in unknown.message()
    assert stats.snapshot()[(v.RECORD_ACCEPTED, v.SIGNAL_METRICS)] == 4


# --- a real processor, fed by the official OpenTelemetry SDK ------------------------------------


def _sdk_host_metrics(endpoint: str, host: str) -> None:
    """`hostmetrics`-named instruments from the SDK: per-CPU mode fractions, memory by state."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.metrics import Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint, insecure=True, timeout=30),
                                           export_interval_millis=3_600_000)
    provider = MeterProvider(resource=Resource({v.RES_HOST_NAME: host}), metric_readers=[reader])
    meter = provider.get_meter("hostmetricsreceiver-lookalike")

    def cpu(_options):
        for number, modes in enumerate(CPU):
            for mode, value in modes.items():
                yield Observation(value, {sr.ATTR_CPU_MODE: mode, sr.ATTR_CPU_LOGICAL_NUMBER: number})

    def memory(_options):
        for state, value in MEMORY.items():
            yield Observation(value, {sr.ATTR_MEMORY_STATE: state})

    meter.create_observable_gauge(sr.SYSTEM_CPU_UTILIZATION, [cpu], unit="1")
    meter.create_observable_up_down_counter(sr.SYSTEM_MEMORY_USAGE, [memory], unit="By")
    provider.shutdown()  # one collection, exported before it returns


@pytest.mark.slow
def test_a_real_processor_joins_sdk_sent_host_metrics_to_the_run_on_that_host(tmp_path):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult
    from harness import ProcessorProcess
    from harness.sdk_senders import step_spans

    with ProcessorProcess(tmp_path) as proc:
        endpoint = f"127.0.0.1:{proc.grpc}"
        spans = OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=30)
        try:
            # host-a's steps end over the next 3 s: the host metrics below fall inside the run's window
            assert spans.export(step_spans("run-sdk", 0, 30, 1)) == SpanExportResult.SUCCESS
        finally:
            spans.shutdown()
        _sdk_host_metrics(endpoint, "host-a")  # acknowledged after commit: stored once this returns
        _sdk_host_metrics(endpoint, "host-nobody-uses")
        rows = _rows(proc.db)
        counted = proc.metrics_text()
        summary = build_final_summary(proc.db, "run-sdk")
    assert {(r["host"], r["source"], r["run_id"], r["global_rank"]) for r in rows} == {
        ("host-a", sr.SOURCE_HOSTMETRICS, None, None)}
    assert len(rows) == 3
    for outcome in (v.RECORD_ACCEPTED, v.RECORD_IGNORED):  # host-a's three, and the other host's three
        assert f'traceml_outcome="{outcome}",traceml_signal="metrics"}} 3.0' in counted
    got = {r["metric"]: r["value"] for r in rows}
    assert got == {sr.SYSTEM_CPU_UTILIZATION: pytest.approx((0.7 + 0.2) / 2),
                   sr.SYSTEM_MEMORY_USAGE: 10 * GIB, sr.SYSTEM_MEMORY_LIMIT: 16 * GIB}
    # ... and the run's summary reads them as its host's figures, from hostmetrics.
    [node] = summary["resources"]["nodes"]
    assert node["host"] == "host-a" and node["sources"] == [sr.SOURCE_HOSTMETRICS], node
    assert node["cpu_utilization"] == pytest.approx(0.45) and node["memory_used_bytes"] == 10 * GIB
    assert node["memory_utilization"] == pytest.approx(10 / 16)
