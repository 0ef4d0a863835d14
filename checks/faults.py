"""Faults, long version: repeated kill -9 during ingest, and training step time under endpoint faults.

    .venv/bin/python -m checks.faults                 # 10 kill cycles + 5 training scenarios (~4 min)
    .venv/bin/python -m checks.faults --cycles 3 --repeats 1

1. Crash durability: three sender processes (gRPC, gRPC, HTTP; six ranks) stream
   step batches; the processor is killed with SIGKILL `--cycles` times mid-stream
   and restarted on the same ports and database. After each kill every batch a
   sender saw acknowledged must already be in SQLite; at the end a replay of every
   batch adds no rows. Reported: steps acknowledged, stored, lost (must be 0),
   replay rows added (must be 0).
2. Training under faults: the tiny CPU training loop of tests/reliability
   (`harness/reliability/train_script.py`, real `traceml.init` + exporter) with no TraceML (baseline),
   a healthy processor, a dead endpoint, a stalling endpoint, and the processor
   killed and restarted mid-run. Reported: median step time and its ratio to the
   baseline measured in the same run, steps completed, and the exporter's
   delivered / lost counts (lost = queue drops + failed exports).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import ProcessorProcess, free_port, wait_until
from harness.stored_rows import count_rows, integrity_ok, stored_step_keys
from harness.reliability.crash_scenario import GROUPS, RUN, acknowledged, finish, start_senders
from harness.reliability.fault_training import finish as finish_training
from harness.reliability.fault_training import lost as lost_spans
from harness.reliability.fault_training import progress_steps
from harness.reliability.fault_training import train as run_training


def crash_cycles(cycles: int) -> bool:
    folder = Path(tempfile.mkdtemp(prefix="check-crash-"))
    proc = ProcessorProcess(folder / "processor", extra_args=["--refresh-interval", "1"]).start()
    stop = folder / "stop"
    logs = [folder / f"acks-{i}.log" for i in range(len(GROUPS))]
    senders = start_senders(proc, folder, stop)
    lost_after_kill = 0
    try:
        for cycle in range(cycles):
            target = len(acknowledged(logs)) + 500
            if not wait_until(lambda: len(acknowledged(logs)) >= target, 120):
                print(f"  cycle {cycle}: senders made no progress")
                return False
            proc.kill9()
            acked = acknowledged(logs)
            missing = acked - stored_step_keys(proc.db, RUN)
            lost_after_kill += len(missing)
            print(f"  kill {cycle + 1}: {len(acked)} steps acknowledged so far, {len(missing)} missing after kill -9")
            proc.start()
        target = len(acknowledged(logs)) + 500
        wait_until(lambda: len(acknowledged(logs)) >= target, 120)
    finally:
        stop.touch()
        last_steps = finish(senders)
    acked = acknowledged(logs)
    stored = stored_step_keys(proc.db, RUN)
    rows = count_rows(proc.db)
    finish(start_senders(proc, folder, stop, replay_to=last_steps))
    added = count_rows(proc.db) - rows
    code = proc.stop()
    lost = len(acked - stored)
    print(f"crash durability: {cycles} x kill -9 during ingest from {len(GROUPS)} sender processes; "
          f"{len(acked)} steps acknowledged, {len(stored)} stored, lost {lost} (after each kill: {lost_after_kill}); "
          f"replay of every batch added {added} rows; exit code after SIGTERM {code}; "
          f"integrity {integrity_ok(proc.db)}")
    return lost == 0 and lost_after_kill == 0 and added == 0 and code == 0


def train(env_extra: dict, steps: int, progress: Path | None = None, wait: bool = True):
    return run_training(env_extra, steps=steps, queue_size=256, progress=progress, wait=wait, timeout_s=600)


def training_faults(steps: int, repeats: int) -> bool:
    from harness.otlp_receiver import OtlpTestReceiver

    folder = Path(tempfile.mkdtemp(prefix="check-train-faults-"))
    results: dict[str, list[dict]] = {}

    def record(name, result):
        results.setdefault(name, []).append(result)

    ok = True
    for r in range(repeats):
        record("no TraceML (baseline)", train({"FAULT_TRACED": "0"}, steps))
        proc = ProcessorProcess(folder / f"healthy-{r}").start()
        record("healthy processor", train({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{proc.grpc}",
                                           "TRACEML_RUN_ID": f"healthy-{r}"}, steps))
        proc.stop()
        record("dead endpoint", train({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
                                       "TRACEML_RUN_ID": f"dead-{r}"}, steps))
        with OtlpTestReceiver(mode="stall", stall_s=120.0) as receiver:
            record("stalling endpoint", train({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
                                               "TRACEML_RUN_ID": f"stall-{r}"}, steps))
            receiver.release_stalls()
        proc = ProcessorProcess(folder / f"restart-{r}").start()
        progress = folder / f"progress-{r}"
        trainer = train({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{proc.grpc}",
                         "TRACEML_RUN_ID": f"restart-{r}"}, steps, progress, wait=False)

        wait_until(lambda: progress_steps(progress) >= steps // 4 or trainer.poll() is not None, 120)
        proc.kill9()
        wait_until(lambda: progress_steps(progress) >= steps // 2 or trainer.poll() is not None, 120)
        proc.start()
        result = finish_training(trainer, timeout_s=600, check=False)
        time.sleep(1.0)
        result["stored"] = len(stored_step_keys(proc.db, f"restart-{r}"))
        proc.stop()
        record("processor kill -9 + restart mid-run", result)

    base = statistics.median(x["median_step_s"] for x in results["no TraceML (baseline)"])
    print(f"\ntraining under faults ({steps} steps x {repeats} repeats each; tiny CPU model + 5 ms sleep per step; "
          "shared 2-core machine, contended: the ratios are indicative)")
    print(f"{'scenario':40s} {'median step':>12s} {'ratio':>6s} {'steps':>6s} {'delivered':>9s} {'lost':>5s}")
    for name, runs in results.items():
        median = statistics.median(x["median_step_s"] for x in runs)
        exp = runs[-1]["exporter"]
        steps_done = min(x["steps"] for x in runs)
        ok &= steps_done == steps
        delivered = exp["steps_exported"] if exp else "-"
        lost = lost_spans(exp) if exp else "-"
        if exp:
            ok &= exp["steps_exported"] + lost >= steps
        print(f"{name:40s} {median * 1e3:10.2f} ms {median / base:6.2f} {steps_done:6d} {delivered!s:>9s} {lost!s:>5s}")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    ok = crash_cycles(args.cycles)
    ok &= training_faults(args.steps, args.repeats)
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
