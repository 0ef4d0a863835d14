"""A tiny CPU training loop with the real instrumentation and exporter (a subprocess of the tests).

Environment: FAULT_STEPS, FAULT_SLEEP_S (a pause after each step, so the run lasts),
FAULT_PROGRESS (file that gets the number of finished steps), plus the standard
OTEL_EXPORTER_OTLP_* and TRACEML_* settings. Prints one JSON line: steps done,
step-time median, and the exporter's counters after shutdown.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time


def main() -> None:
    import torch

    import traceml
    from harness.tiny_training import plain_step, traced_step

    steps = int(os.environ.get("FAULT_STEPS", "200"))
    pause = float(os.environ.get("FAULT_SLEEP_S", "0.01"))
    progress = os.environ.get("FAULT_PROGRESS")
    traced = os.environ.get("FAULT_TRACED", "1") == "1"
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(8, 32), torch.randn(8, 1)) for _ in range(8)]
    if traced:
        traceml.init("manual")
    sink = traceml._exporter_sink if traced else None
    step = traced_step if traced else plain_step
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        x, y = data[i % len(data)]
        step(model, opt, x, y)
        time.sleep(pause)
        times.append(time.perf_counter() - t0)
        if progress and i % 10 == 9:
            with open(progress, "w") as f:
                f.write(str(i + 1))
    t0 = time.perf_counter()
    if traced:
        traceml.shutdown(timeout_s=float(os.environ.get("FAULT_SHUTDOWN_S", "5")))
    shutdown_s = time.perf_counter() - t0
    stats = dataclasses.asdict(sink.stats()) if sink is not None else None
    print(json.dumps({"steps": len(times), "median_step_s": statistics.median(times), "shutdown_s": shutdown_s,
                      "exporter": stats}), flush=True)


if __name__ == "__main__":
    main()
