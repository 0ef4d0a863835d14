"""A real 2-rank gloo DDP training run instrumented by traceml (launched by torchrun in tests).

Besides exporting over OTLP (endpoint from OTEL_EXPORTER_OTLP_ENDPOINT), every rank
records exactly what its samplers published through a second TelemetrySink into
`$TRACEML_TEST_OUT/rank<N>.jsonl`, so the test compares the wire with the source.
"""
from __future__ import annotations

import json
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import traceml


class RecordingSink:
    def __init__(self, path: str):
        self._lock = threading.Lock()
        self._file = open(path, "w", encoding="utf-8")

    def _write(self, obj) -> None:
        with self._lock:
            self._file.write(json.dumps(obj) + "\n")
            self._file.flush()

    def on_step_time(self, record) -> None:
        self._write({"kind": "step", "step": record.step, "start": record.start_time_ns, "end": record.end_time_ns,
                     "events": {k: [t.cpu_ms, t.gpu_ms, t.count] for k, t in record.events.items()},
                     "phases": [[p.raw_event, p.start_time_ns, p.end_time_ns] for p in record.phases]})

    def on_step_memory(self, record) -> None:
        self._write({"kind": "memory", "step": record.step, "device": record.device,
                     "allocated": record.peak_allocated_bytes, "reserved": record.peak_reserved_bytes,
                     "time": record.time_ns})


def main() -> int:
    steps = int(os.environ.get("TRACEML_TEST_STEPS", "20"))
    out_dir = os.environ["TRACEML_TEST_OUT"]
    traceml.init("manual")
    exporter = traceml._exporter_sink
    rank = int(os.environ["RANK"])
    meta = {"rank": rank, "exporter": type(exporter).__name__}
    if exporter is not None:
        meta.update(run_id=exporter.identity.run_id, run_id_source=exporter.identity.run_id_source)
    traceml.register_sink(RecordingSink(os.path.join(out_dir, f"rank{rank}.jsonl")))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = traceml.wrap_forward(DDP(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                                         torch.nn.Linear(32, 1))))
    opt = traceml.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    data = [(torch.randn(8, 32), torch.randn(8, 1)) for _ in range(steps)]
    loader = traceml.wrap_dataloader(data)
    for x, y in loader:
        with traceml.trace_step(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            with traceml.timed_backward():
                loss.backward()
            opt.step()
            opt.zero_grad()
    dist.barrier()
    traceml.shutdown(timeout_s=10.0)
    if exporter is not None:
        meta.update(run_end_sent=exporter.run_end_sent, stats=repr(exporter.stats()))
    with open(os.path.join(out_dir, f"meta{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # torch 2.13 DDP on gloo can abort ("terminate called without an active exception") in interpreter
    # teardown on a loaded CPU, with or without TraceML; everything is flushed, so leave without it.
    sys.stdout.flush()
    os._exit(code)
