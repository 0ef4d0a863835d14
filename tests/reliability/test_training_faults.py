"""Training-side faults: the endpoint is dead, stalls, or the processor restarts mid-run.

A real training loop (tiny CPU model, `traceml.init` + `trace_step`, real OTLP
exporter) runs in a subprocess. In every case it must finish every step and
exit cleanly, and whatever telemetry did not arrive must be counted: by the
exporter's counters and, when a processor is there to receive the end marker, in
the run's final summary. No timing is asserted (only "did not hang" bounds);
step-time medians are printed, and compared in checks/faults.py.
"""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from harness.reliability.fault_training import HANG_BOUND_S, finish, lost, progress_steps
from harness.reliability.fault_training import train as run_training
from harness.otlp_receiver import OtlpTestReceiver

from harness import ProcessorProcess, free_port, wait_until
from harness.stored_rows import stored_step_keys


def train(run_id: str, endpoint: str, protocol: str, *, steps: int, progress: Path | None = None,
          sleep_s: float = 0.005, wait: bool = True, extra_env: dict | None = None):
    return run_training({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
                         "TRACEML_RUN_ID": run_id, **(extra_env or {})},
                        steps=steps, sleep_s=sleep_s, progress=progress, wait=wait)


@pytest.mark.parametrize("protocol", ["grpc"])
@pytest.mark.slow
def test_dead_endpoint_training_completes_and_every_step_is_counted_lost(protocol):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens
    result = train("dead-endpoint", endpoint, protocol, steps=150)
    print(f"\n[dead/{protocol}] {result}")
    exporter = result["exporter"]
    assert result["steps"] == 150 and exporter["steps_exported"] == 0
    assert exporter["steps_received"] + exporter["dropped"].get("spans", 0) == 150
    assert lost(exporter) >= 150  # nothing silently vanished


@pytest.mark.slow
def test_stalling_endpoint_training_completes_and_losses_are_counted():
    with OtlpTestReceiver(mode="stall", stall_s=60.0) as receiver:
        result = train("stall-endpoint", receiver.http_endpoint, "http/protobuf", steps=150)
        receiver.release_stalls()
    print(f"\n[stall/http] {result}")
    exporter = result["exporter"]
    assert result["steps"] == 150
    assert exporter["steps_exported"] + lost(exporter) + exporter["queued_steps"] >= 150


@pytest.mark.slow
def test_processor_restarted_mid_run_training_completes_and_the_summary_accounts_for_every_step(tmp_path):
    proc = ProcessorProcess(tmp_path / "processor", extra_args=["--refresh-interval", "0.5"]).start()
    progress = tmp_path / "progress"
    steps = 600
    trainer = train("restart-run", f"http://127.0.0.1:{proc.grpc}", "grpc", steps=steps, progress=progress,
                    sleep_s=0.01, wait=False)
    try:
        assert wait_until(lambda: progress_steps(progress) >= 100 or trainer.poll() is not None, HANG_BOUND_S)
        proc.kill9()
        killed_at = progress_steps(progress)
        assert wait_until(lambda: progress_steps(progress) >= killed_at + 50 or trainer.poll() is not None,
                            HANG_BOUND_S)
        proc.start()  # same ports and database
        result = finish(trainer)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    exporter = result["exporter"]
    print(f"\n[restart] killed at step ~{killed_at}; {result}")
    assert result["steps"] == steps
    # The end marker reached the restarted processor, which ended the run and wrote its summary.
    summary_file = proc.summary_dir / "restart-run" / "final_summary.json"
    assert wait_until(summary_file.exists, 60), sorted(proc.summary_dir.rglob("*"))
    assert proc.stop() == 0
    summary = json.loads(summary_file.read_text())
    telemetry = summary["telemetry"]
    assert telemetry["ranks_finished"] == [0]
    stored = len(stored_step_keys(proc.db, "restart-run"))
    # Every step is either stored or counted lost by the exporter: nothing vanished silently.
    assert stored + lost(exporter) >= steps, (stored, exporter)
    assert stored < steps or lost(exporter) == 0
    # What the rank reported at its end is kept with the run (its final counts).
    conn = sqlite3.connect(proc.db)
    try:
        (final_counts,) = conn.execute(
            "SELECT final_counts FROM step_time_ranks WHERE run_id = ? AND global_rank = 0", ("restart-run",)).fetchone()
    finally:
        conn.close()
    counts = json.loads(final_counts)
    print(f"stored {stored} of {steps}; summary telemetry {telemetry}; rank final counts {counts}")
    assert counts["traceml.telemetry.export.failures"] == sum(exporter["failures"].values())
    assert telemetry["dropped"]["spans"] == exporter["dropped"]["spans"]
    # The summary itself explains every missing step: it says how many steps the rank completed
    # but the store lacks, and how many step records its exporter dropped or lost to failed exports.
    assert telemetry["steps_missing"] == {"0": steps - stored}, telemetry
    assert telemetry["export_failures"] == {"0": counts["traceml.telemetry.export.failures"]}, telemetry
    explained = stored + telemetry["dropped"]["spans"] + telemetry["export_failures"]["0"]
    assert explained >= steps, telemetry
