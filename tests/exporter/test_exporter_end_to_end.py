"""Real 2-rank gloo training under plain torchrun, exporting to a real receiver over gRPC, over
HTTP, and through `rotel-agent` as a relay: every step of every rank arrives exactly as the
samplers published it, with one run id shared by both ranks and different between jobs."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import pytest

from harness import free_port

from traceml.schema import vocabulary as v
from traceml.schema.resources import RESOURCE_METRICS

pytestmark = pytest.mark.slow

SCRIPT = pathlib.Path(__file__).with_name("ddp_train_script.py")
STEPS = 12
WORLD = 2


def _torchrun(tmp: pathlib.Path, endpoint: str, protocol: str) -> dict:
    env = {k: val for k, val in os.environ.items()
           if not k.startswith(("OTEL_", "TRACEML_", "TORCHELASTIC_", "SLURM_"))}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
               TRACEML_TEST_OUT=str(tmp), TRACEML_TEST_STEPS=str(STEPS))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
                           "--master-port", str(free_port()), str(SCRIPT)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    published = {}
    metas = []
    for rank in range(WORLD):
        lines = (tmp / f"rank{rank}.jsonl").read_text().splitlines()
        published[rank] = [json.loads(line) for line in lines]
        metas.append(json.loads((tmp / f"meta{rank}.json").read_text()))
    assert {m["run_id_source"] for m in metas} == {"rendezvous_store"}  # plain torchrun: TORCHELASTIC_RUN_ID=none
    assert metas[0]["run_id"] == metas[1]["run_id"]
    assert all(m["run_end_sent"] for m in metas), metas
    return {"run_id": metas[0]["run_id"], "published": published}


def _assert_arrived_exactly(receiver, run: dict) -> None:
    run_id = run["run_id"]
    # A relay forwards asynchronously: wait (bounded) for both ranks' run-end markers.
    assert receiver.wait_for(lambda: sum(1 for k in receiver.step_spans(v.SPAN_RUN_END) if k[0] == run_id) == WORLD,
                             60.0)
    rows = {k: r for k, r in receiver.step_spans().items() if k[0] == run_id}
    spans = [(res, s) for res, s in receiver.spans() if res.get(v.ATTR_RUN_ID) == run_id]
    expected_keys = set()
    for rank, records in run["published"].items():
        steps = [r for r in records if r["kind"] == "step"]
        assert [r["step"] for r in steps] == list(range(STEPS))
        for record in steps:
            key = (run_id, rank, record["step"])
            expected_keys.add(key)
            row = rows[key]
            assert (row["start"], row["end"]) == (record["start"], record["end"])
            attrs = row["attributes"]
            wanted = {v.ATTR_RUN_ID: run_id, v.ATTR_RANK: rank, v.ATTR_STEP: record["step"]}
            for raw_event, (cpu, gpu, count) in record["events"].items():
                wanted[v.event_attribute(raw_event, v.EVENT_FIELD_CPU)] = cpu / 1000.0  # seconds
                wanted[v.event_attribute(raw_event, v.EVENT_FIELD_COUNT)] = count
                if gpu is not None:
                    wanted[v.event_attribute(raw_event, v.EVENT_FIELD_GPU)] = gpu / 1000.0
            assert attrs == wanted  # values, counts, and absent (never zero) GPU times
            assert {v.RAW_FORWARD, v.RAW_BACKWARD, v.RAW_OPTIMIZER_STEP, v.RAW_STEP_TIME,
                    v.RAW_DATALOADER_NEXT} <= set(record["events"])
            res = row["resource"]
            assert (res[v.ATTR_RANK], res[v.ATTR_WORLD_SIZE], res[v.ATTR_LOCAL_RANK],
                    res[v.RES_SERVICE_INSTANCE_ID], res[v.ATTR_TRAINING_STRATEGY]) == \
                (rank, WORLD, rank, f"{run_id}-rank{rank}", v.STRATEGY_DDP)
            children = sorted((s.start_time_unix_nano, s.name, s.end_time_unix_nano) for _, s in spans
                              if s.parent_span_id == row["span_id"] and s.trace_id == row["trace_id"])
            assert children == sorted((p[1], v.SPAN_PHASE_PREFIX + v.phase_name(p[0]), p[2])
                                      for p in record["phases"] if p[0] != v.RAW_STEP_TIME)
        memory = [r for r in records if r["kind"] == "memory"]
        assert [m["step"] for m in memory] == list(range(STEPS))
        assert all(m["allocated"] is None and m["reserved"] is None for m in memory)  # CPU run
    assert set(rows) == expected_keys
    # CPU devices publish None: no memory point reached the receiver for this run.
    assert not [p for res, m, p in receiver.metric_points()
                if res.get(v.ATTR_RUN_ID) == run_id and m.name.startswith("traceml.memory.")]
    ends = {k[1]: r["attributes"] for k, r in receiver.step_spans(v.SPAN_RUN_END).items() if k[0] == run_id}
    assert {rank: a[v.ATTR_STEPS_COMPLETED] for rank, a in ends.items()} == {r: STEPS for r in range(WORLD)}
    assert {rank: a[v.run_end_dropped_attribute("spans")] for rank, a in ends.items()} == {0: 0, 1: 0}
    allowed = {v.SPAN_STEP, v.SPAN_RUN_END} | {v.SPAN_PHASE_PREFIX + v.phase_name(e) for e in v.RAW_EVENTS
                                               if e != v.RAW_STEP_TIME}
    assert {s.name for _, s in spans} <= allowed
    metric_names = {m.name for res, m, p in receiver.metric_points() if res.get(v.ATTR_RUN_ID) == run_id}
    assert metric_names and metric_names <= {spec.name for spec in (*v.TRAINING_METRICS, *RESOURCE_METRICS)}


def test_two_rank_gloo_training_over_grpc_and_http(receiver, tmp_path):
    (tmp_path / "grpc").mkdir()
    (tmp_path / "http").mkdir()
    grpc_run = _torchrun(tmp_path / "grpc", receiver.grpc_endpoint, "grpc")
    _assert_arrived_exactly(receiver, grpc_run)
    http_run = _torchrun(tmp_path / "http", receiver.http_endpoint, "http/protobuf")
    _assert_arrived_exactly(receiver, http_run)
    assert grpc_run["run_id"] != http_run["run_id"]  # two consecutive jobs never share a run id


def _rotel_binary() -> str:
    import rotel
    path = pathlib.Path(rotel.__file__).with_name("rotel-agent")
    return str(path) if path.exists() else (shutil.which("rotel-agent") or "")


def test_two_rank_gloo_training_through_the_rotel_relay(receiver, tmp_path):
    binary = _rotel_binary()
    assert binary, "rotel-agent is a dev dependency (pip install rotel)"
    grpc_port, http_port = free_port(), free_port()
    relay = subprocess.Popen(
        [binary, "start", "--otlp-grpc-endpoint", f"127.0.0.1:{grpc_port}",
         "--otlp-http-endpoint", f"127.0.0.1:{http_port}", "--exporter", "otlp",
         "--otlp-exporter-endpoint", receiver.grpc_endpoint, "--otlp-exporter-protocol", "grpc",
         "--pid-file", str(tmp_path / "rotel.pid"), "--log-file", str(tmp_path / "rotel.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", grpc_port), timeout=1).close()
                break
            except OSError:
                assert relay.poll() is None and time.monotonic() < deadline, "rotel-agent did not start"
                time.sleep(0.2)
        (tmp_path / "relay").mkdir()
        run = _torchrun(tmp_path / "relay", f"http://127.0.0.1:{grpc_port}", "grpc")
        _assert_arrived_exactly(receiver, run)
    finally:
        relay.terminate()
        try:
            relay.wait(10)
        except subprocess.TimeoutExpired:
            relay.kill()
            relay.wait(5)
