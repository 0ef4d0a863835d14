"""End to end with real components only.

Two gloo DDP ranks train with `traceml.init(mode="auto")`; rank 0 exports over
OTLP/gRPC and rank 1 over OTLP/HTTP to a `traceml-processor` process (the real
CLI); the processor stores, analyses and diagnoses; a real Prometheus scrapes its
`/metrics` every second and is asked with PromQL for the diagnosis and per-rank
series. The second test sends both ranks through `rotel-agent` as a relay.
Rank 0's data loader is slow, so the expected finding is an input straggler
with culprit rank 0.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness import ProcessorProcess, free_port, wait_until
from harness.prometheus_server import PrometheusServer, prometheus_available

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not prometheus_available(), reason="needs the prometheus binary")]

ROOT = Path(__file__).resolve().parents[2]
_ROTEL_SPEC = importlib.util.find_spec("rotel")
ROTEL = Path(_ROTEL_SPEC.origin).parent / "rotel-agent" if _ROTEL_SPEC and _ROTEL_SPEC.origin else Path("/nonexistent")

RANK_SCRIPT = textwrap.dedent('''
    import os, time
    import torch
    import torch.distributed as dist
    import traceml

    rank = int(os.environ["RANK"])
    STEPS, BATCH = int(os.environ["E2E_STEPS"]), 4

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return STEPS * BATCH * 2
        def __getitem__(self, i):
            if rank == 0 and i % BATCH == 0:
                time.sleep(0.04)          # rank 0's input pipeline is slow
            return torch.full((8,), float(i))

    dist.init_process_group("gloo")
    traceml.init(mode="auto")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(Data(), batch_size=BATCH,
                                         sampler=torch.utils.data.distributed.DistributedSampler(Data()))
    for x in loader:
        with traceml.trace_step(model):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    traceml.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    # torch 2.13 DDP on gloo can abort ("terminate called without an active exception") in interpreter
    # teardown on a loaded CPU, with or without TraceML; everything is flushed, so leave without it.
    os._exit(0)
''')


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("e2e")
    processor = ProcessorProcess(folder, extra_args=["--refresh-interval", "0.5", "--idle-timeout", "600"])
    processor.start(wait_readyz=True)
    prometheus = PrometheusServer(folder / "prometheus", [f"127.0.0.1:{processor.prom}"]).start()
    yield processor, prometheus
    prometheus.stop()
    assert processor.stop() == 0, processor.log_text()
    # SIGTERM left a consistent database behind.
    assert "traceml-processor stopped" in processor.log_text()


def train_two_ranks(folder: Path, run_id: str, endpoints: dict[int, tuple[str, str]], steps: int = 30):
    script = folder / "rank.py"
    script.write_text(RANK_SCRIPT)
    master = free_port()
    procs = []
    for rank in (0, 1):
        endpoint, protocol = endpoints[rank]
        env = {k: val for k, val in os.environ.items() if not k.startswith(("OTEL_", "TRACEML_"))}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master), OMP_NUM_THREADS="1",
                   TRACEML_RUN_ID=run_id, E2E_STEPS=str(steps),
                   OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL=protocol)
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=folder,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out


def assert_diagnosed_in_prometheus(prometheus: PrometheusServer, run_id: str):
    sel = f'traceml_run_id="{run_id}"'
    # The ranks have exited and flushed; the processor's re-export and Prometheus'
    # scrape follow on their own intervals, and a relay (rotel) may deliver one rank's
    # data later than the other's. Wait (bounded) until a scrape holds both ranks,
    # then the full common window: every figure below describes the whole run.
    prometheus.wait_for(f'traceml_window_ranks{{{sel}}}',
                        lambda r: len(r) == 1 and float(r[0]["value"][1]) == 2)
    prometheus.wait_for(f'traceml_window_steps{{{sel}}}',
                        lambda r: len(r) == 1 and float(r[0]["value"][1]) >= 20)
    assert prometheus.query_value(f'traceml_window_ranks{{{sel}}}') == 2
    straggler = prometheus.wait_for(
        f'traceml_diagnosis_active_ratio{{{sel},traceml_diagnosis_kind="INPUT_STRAGGLER"}}')
    assert straggler[0]["metric"]["traceml_diagnosis_culprit_rank"] == "0"
    assert float(straggler[0]["value"][1]) >= 0.10
    # Per-rank series: both ranks present, rank 0 waits on input far longer than rank 1.
    per_rank = prometheus.wait_for(f'traceml_rank_metric_seconds{{{sel},traceml_metric="input_wait"}}',
                                   lambda r: len(r) == 2)
    waits = {item["metric"]["traceml_rank"]: float(item["value"][1]) for item in per_rank}
    assert waits["0"] > 0.03 and waits["0"] > 3 * waits["1"]
    slower = prometheus.query(
        f'traceml_rank_metric_seconds{{{sel},traceml_metric="input_wait",traceml_rank="0"}}'
        f' > ignoring(traceml_rank) traceml_rank_metric_seconds{{{sel},traceml_metric="input_wait",traceml_rank="1"}}')
    assert len(slower) == 1
    # Low cardinality: no re-exported series carries a step label.
    assert prometheus.query(f'{{{sel},traceml_step!=""}}') == []


def wait_for_summary(processor: ProcessorProcess, run_id: str) -> dict:
    path = processor.summary_dir / run_id / "final_summary.json"
    assert wait_until(lambda: path.exists() and (path.parent / "summary_card.txt").exists(), 60, 0.2), \
        processor.log_text()
    return json.loads(path.read_text())


def test_two_rank_gloo_training_over_grpc_and_http_is_diagnosed_in_prometheus(stack, tmp_path):
    processor, prometheus = stack
    run_id = "e2e-direct"
    train_two_ranks(tmp_path, run_id, {0: (f"http://127.0.0.1:{processor.grpc}", "grpc"),
                                       1: (f"http://127.0.0.1:{processor.http}", "http/protobuf")})
    assert_diagnosed_in_prometheus(prometheus, run_id)
    # Both ranks sent their end marker: the run ended and its summary was written.
    summary = wait_for_summary(processor, run_id)
    kinds = [issue["kind"] for issue in summary["issues"]]
    assert "INPUT_STRAGGLER" in kinds
    assert summary["metadata"]["world_size"] == 2
    accepted = prometheus.wait_for('traceml_processor_records_total{traceml_outcome="accepted"}')
    assert {item["metric"]["traceml_signal"] for item in accepted} >= {"traces"}


@pytest.mark.skipif(not ROTEL.exists(), reason="needs rotel-agent (pip install rotel)")
def test_the_same_through_a_rotel_relay(stack, tmp_path):
    processor, prometheus = stack
    grpc_in, http_in = free_port(), free_port()
    log = open(tmp_path / "rotel.log", "wb")
    relay = subprocess.Popen(
        [str(ROTEL), "start", "--otlp-grpc-endpoint", f"127.0.0.1:{grpc_in}",
         "--otlp-http-endpoint", f"127.0.0.1:{http_in}", "--exporter", "otlp",
         "--otlp-exporter-endpoint", f"http://127.0.0.1:{processor.grpc}",
         "--otlp-exporter-protocol", "grpc", "--batch-timeout", "200ms",
         "--pid-file", str(tmp_path / "rotel.pid"), "--log-file", str(tmp_path / "rotel-agent.log")],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: _listening(grpc_in) and _listening(http_in), 30, 0.1)
        run_id = "e2e-rotel"
        train_two_ranks(tmp_path, run_id, {0: (f"http://127.0.0.1:{grpc_in}", "grpc"),
                                           1: (f"http://127.0.0.1:{http_in}", "http/protobuf")})
        assert_diagnosed_in_prometheus(prometheus, run_id)
        summary = wait_for_summary(processor, run_id)
        assert "INPUT_STRAGGLER" in [issue["kind"] for issue in summary["issues"]]
    finally:
        relay.send_signal(signal.SIGTERM)
        try:
            relay.wait(20)
        except subprocess.TimeoutExpired:
            relay.kill()
            relay.wait(5)
        log.close()


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
