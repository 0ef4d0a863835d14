"""From a confirmed finding to its capture's digest (issue 33 item 4), on real `traceml run` jobs.

Method. Each run is `traceml run --nproc-per-node 2 -m harness.sort_straggler_job --max-steps 1500`
(the deep-capture job the tests and checks/gpu.py run too): two gloo ranks, the embedded processor with its defaults (`--capture auto`), rank 1's forward sorting a
tensor rank 0 never sorts (a COMPUTE_STRAGGLER), the job ending once the automatic capture
finished. Everything is then read from what the product recorded, in the run folder:

- the store's step rows (`step_time_samples`): each step's end on its rank (`sample_time`) and
  when the processor stored it (`receive_time`); a step is aligned once every rank's row of it is
  stored. **confirmable**: the moment the processor held 20 aligned steps (the diagnosis policy's
  `crit_min_steps`, below which a finding is provisional), so the first moment an analysis could
  return the confirmed finding;
- the capture record (`<db>.captures/<run>/<capture>/capture.json`): `requested_at`, taken at the
  refresh whose analysis held the confirmed finding (`capture.policy.after_refresh`), and
  `finished_at`, when the second rank's summary arrived (the digest is computed then);
- each rank's summary: `first_step` and its recorded steps; the profiler starts at the end of the
  step before `first_step` and stops at the end of the last recorded one (both from the rows).

Parts: **analysis** confirmable -> requested (waiting for a refresh of the run); **delivery**
requested -> both ranks recording (each rank's poll every `TRACEML_CONTROL_POLL_INTERVAL` s, then
its next step end); **recording** -> both ranks' last recorded step ended; **upload** -> digest
(the summary and gzip'd trace built off the training thread, uploaded, `finished_at`). The wait
before confirmable (the 20th aligned step's end -> stored: the exporter's interval) is given too.

Two modes. "watch": `traceml run` as it comes, nobody reading the run's figures (its `--live`
view reads the store through its own session and does not drive the processor's analysis), so
the processor analyses a run with new rows every `settings.CAPTURE_WATCH_INTERVAL_S` (5 s).
"scrape": the embedded processor also serves /metrics (`TRACEML_PROCESSOR_PROMETHEUS`, inherited)
and this process scrapes it every `--scrape-interval` s, as Prometheus would: each scrape has the
runs with new rows analysed first. Runs alternate between modes; figures are medians and ranges.

    .venv/bin/python -m benchmarks.bench_capture_latency [--runs 3] [--modes watch scrape] [--quick] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.lib.json_output import add_json_flag, print_json, table_output
from harness.child_python import child_env

JOB = ["-m", "harness.sort_straggler_job", "--max-steps", "1500"]  # from the root (child_env's PYTHONPATH)
CONFIRM_STEPS = 20  # processor.diagnosis.policy.DiagnosisPolicy.crit_min_steps (read below when importable)
PARTS = ("export", "analysis", "delivery", "recording", "upload", "confirmable_to_digest", "requested_to_digest")


def _confirm_steps() -> int:
    try:
        from traceml.processor.diagnosis.policy import DiagnosisPolicy
        return DiagnosisPolicy().crit_min_steps
    except Exception:  # noqa: BLE001  (the figure's definition, not the benchmark's work)
        return CONFIRM_STEPS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACEML_"))}
    env.update(OMP_NUM_THREADS="1", TRACEML_EXIT_AFTER_FLUSH="1", **extra)  # gloo's teardown can abort when loaded
    return child_env(env)  # the repository root first on PYTHONPATH: the ranks import the job from it


def _scrape(url: str, interval_s: float, stop: threading.Event, count: list) -> None:
    while not stop.wait(interval_s):
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                answer.read()
            count[0] += 1
        except OSError:  # not up yet, or gone
            pass


def _one_run(mode: str, scrape_interval_s: float, workdir: Path) -> dict:
    extra, stop, scrapes = {}, threading.Event(), [0]
    if mode == "scrape":
        port = _free_port()
        extra["TRACEML_PROCESSOR_PROMETHEUS"] = f"127.0.0.1:{port}"
        threading.Thread(target=_scrape, args=(f"http://127.0.0.1:{port}/metrics", scrape_interval_s, stop, scrapes),
                         daemon=True).start()
    cpu0 = os.times()
    started = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "traceml.launcher.cli", "run", "--nproc-per-node", "2", *JOB],
                              cwd=workdir, env=_env(extra), capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)
    finally:
        stop.set()
    wall = time.perf_counter() - started
    cpu1 = os.times()
    if proc.returncode != 0:
        raise SystemExit(f"traceml run failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    (run_dir,) = [p for p in (workdir / "traceml_runs").iterdir() if p.is_dir()]
    out = _parts(run_dir)
    out.update(mode=mode, wall_s=wall, child_cpu_s=(cpu1.children_user + cpu1.children_system)
               - (cpu0.children_user + cpu0.children_system), scrapes=scrapes[0])
    return out


def _parts(run_dir: Path) -> dict:
    """One run's timeline, from the store's rows and the capture's files (module docstring)."""
    records = [json.loads(p.read_text()) for p in sorted(run_dir.glob("*.captures/*/*/capture.json"))]
    auto = [r for r in records if r["trigger"] != "manual"]
    if len(auto) != 1 or auto[0]["status"] != "done":
        raise SystemExit(f"{run_dir}: expected one automatic capture, done: {records}")
    record = auto[0]
    folder = next(run_dir.glob(f"*.captures/*/{record['capture_id']}"))
    summaries = {s["rank"]: s for s in (json.loads(p.read_text()) for p in folder.glob("rank*.summary.json"))}
    conn = sqlite3.connect(f"file:{run_dir / 'traceml.sqlite'}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT global_rank, step, sample_time, receive_time FROM step_time_samples "
                            "WHERE run_id = ?", (record["run_id"],)).fetchall()
    finally:
        conn.close()
    ends: dict[tuple[int, int], float] = {}
    by_step: dict[int, list[tuple[float, float]]] = {}
    for rank, step, end, received in rows:
        ends[(rank, step)] = end
        by_step.setdefault(step, []).append((end, received))
    ranks = {rank for rank, _ in ends}
    aligned = sorted((max(r for _, r in seen), max(e for e, _ in seen))
                     for step, seen in by_step.items() if len(seen) == len(ranks))
    n = _confirm_steps()
    confirmable, nth_end = aligned[n - 1]
    started, recorded = [], []
    for rank, summary in summaries.items():
        first, count = summary["first_step"], len(summary["step_ms"])
        started.append(ends[(rank, first - 1)])
        recorded.append(ends[(rank, first + count - 1)])
    requested, finished = record["requested_at"], record["finished_at"]
    top = None
    digest_rows = None
    final = run_dir / "final_summary.json"
    if final.exists():
        for capture in json.loads(final.read_text()).get("captures", []):
            if capture["capture_id"] == record["capture_id"] and capture.get("digest"):
                digest_rows = capture["digest"]["rows"]
        top = digest_rows[0]["name"] if digest_rows else None
    return {"trigger": record["trigger"], "culprit_rank": record["culprit_rank"],
            "reference_rank": record["reference_rank"], "capture_steps": record["steps"], "top_row": top,
            "steps_stored": len(aligned), "export_s": confirmable - nth_end,
            "analysis_s": requested - confirmable, "delivery_s": max(started) - requested,
            "recording_s": max(recorded) - max(started), "upload_s": finished - max(recorded),
            "confirmable_to_digest_s": finished - confirmable, "requested_to_digest_s": finished - requested}


def _summarise(runs: list[dict]) -> dict:
    out = {"runs": len(runs)}
    for part in PARTS:
        values = [r[f"{part}_s"] for r in runs]
        out[f"{part}_median_s"] = statistics.median(values)
        out[f"{part}_min_s"], out[f"{part}_max_s"] = min(values), max(values)
    return out


def measure(runs: int, modes: list[str], scrape_interval_s: float) -> dict:
    figures: dict = {"cpu_count": os.cpu_count(), "load_avg_start": round(os.getloadavg()[0], 2),
                     "confirm_steps": _confirm_steps(), "scrape_interval_s": scrape_interval_s, "modes": {}}
    per_mode: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="bench-capture-latency-") as tmp:
        for i in range(runs):
            for mode in modes:
                workdir = Path(tmp) / f"{mode}{i}"
                workdir.mkdir()
                run = _one_run(mode, scrape_interval_s, workdir)
                per_mode[mode].append(run)
                print(f"{mode:6s} run {i + 1}: " + ", ".join(f"{p} {run[f'{p}_s']:.2f}" for p in PARTS)
                      + f" s; {run['trigger']} rank {run['culprit_rank']} vs {run['reference_rank']}, "
                      f"top {run['top_row']}; wall {run['wall_s']:.1f} s, {run['child_cpu_s']:.1f} CPU-s", flush=True)
    for mode, done in per_mode.items():
        figures["modes"][mode] = {**_summarise(done), "per_run": done}
    figures["load_avg_end"] = round(os.getloadavg()[0], 2)
    print(f"\nmedian [min, max] over {runs} run(s) per mode, seconds; load {figures['load_avg_start']}"
          f" -> {figures['load_avg_end']}")
    print(f"{'part':24s}" + "".join(f"{m:>24s}" for m in modes))
    for part in PARTS:
        cells = []
        for mode in modes:
            s = figures["modes"][mode]
            cells.append(f"{s[f'{part}_median_s']:.2f} [{s[f'{part}_min_s']:.2f}, {s[f'{part}_max_s']:.2f}]")
        print(f"{part:24s}" + "".join(f"{c:>24s}" for c in cells))
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, help="runs per mode (default 3, 1 with --quick)")
    parser.add_argument("--modes", nargs="+", choices=("watch", "scrape"), default=["watch", "scrape"])
    parser.add_argument("--scrape-interval", type=float, default=1.0,
                        help="seconds between two /metrics scrapes in the scrape mode (default 1)")
    parser.add_argument("--quick", action="store_true", help="one run per mode (a smoke run)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    with table_output(args.json):
        figures = measure(runs, args.modes, args.scrape_interval)
    if args.json:
        print_json("bench_capture_latency", args, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
