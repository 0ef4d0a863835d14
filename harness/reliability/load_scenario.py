"""Many simulated ranks against one processor: memory, lag, ingest and diagnosis under load.

Shared by tests/reliability/test_load.py (CI size) and checks/load.py.
"""
from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import ProcessorProcess, wait_until
from harness.stored_rows import count_rows
from harness.child_python import child_env, module_command
from harness.reliability import reliability_helpers as h
from traceml.schema import vocabulary as v

LOAD_SENDER = "harness.reliability.load_sender"


@dataclass
class LoadResult:
    ranks: int
    steps_per_s: float
    duration_s: float
    spans_sent: int = 0
    rows_stored: int = 0
    sender_retries: int = 0
    late_ticks: int = 0
    rss_start_mib: float = 0.0
    rss_max_mib: float = 0.0
    lag_max_s: float = 0.0
    lag_samples: list = field(default_factory=list)
    rss_samples: list = field(default_factory=list)  # (seconds since start, MiB)
    diagnosis: list = field(default_factory=list)  # (kind, culprit_rank, score) active at the end
    culprit_found: bool = False
    diagnosis_samples: int = 0  # scrapes while running that showed a straggler issue
    straggler_named_samples: int = 0  # ... naming the injected straggler
    false_culprit_samples: int = 0  # ... naming any other rank (must stay 0)
    first_named_s: float | None = None
    ingest_spans_per_s: float = 0.0
    wall_s: float = 0.0

    def rss_trajectory(self, points: int = 6) -> str:
        """RSS at evenly spaced moments of the run: flat means bounded, a ramp means growth."""
        if not self.rss_samples:
            return "no RSS samples"
        n = len(self.rss_samples)
        picks = [self.rss_samples[min(n - 1, round(i * (n - 1) / (points - 1)))] for i in range(points)]
        return "RSS over time: " + ", ".join(f"{t:.0f} s {mib:.0f} MiB" for t, mib in picks)

    def line(self) -> str:
        return (f"ranks={self.ranks} rate={self.steps_per_s}/s/rank duration={self.duration_s}s "
                f"sent={self.spans_sent} stored={self.rows_stored} ingest={self.ingest_spans_per_s:.0f} spans/s "
                f"rss start={self.rss_start_mib:.0f} MiB max={self.rss_max_mib:.0f} MiB "
                f"lag max={self.lag_max_s:.2f} s retries={self.sender_retries} late_ticks={self.late_ticks} "
                f"diagnosis={self.diagnosis} culprit_found={self.culprit_found} "
                f"scrapes naming the straggler {self.straggler_named_samples}/{self.diagnosis_samples} "
                f"(first after {self.first_named_s} s), naming another rank {self.false_culprit_samples}")


def _labels_value(text: str, name: str, run: str) -> list[tuple[dict, float]]:
    return [(labels, val) for labels, val in h.prometheus_samples(text, name)
            if labels.get(v.prometheus_label(v.ATTR_RUN_ID)) == run]


def _label(labels: dict, attribute: str) -> str:
    return labels.get(v.prometheus_label(attribute), "")


def run_load(folder: Path, *, ranks: int, steps_per_s: float, duration_s: float, straggler: int,
             senders: int = 2, interval_s: float = 1.0, run: str = "load-run",
             refresh_interval_s: float = 1.0) -> LoadResult:
    result = LoadResult(ranks, steps_per_s, duration_s)
    proc = ProcessorProcess(folder, extra_args=["--refresh-interval", str(refresh_interval_s)]).start()
    try:
        result.rss_start_mib = proc.rss_bytes() / 2**20
        per = ranks // senders
        procs = []
        began = time.monotonic()
        for i in range(senders):
            last = ranks - 1 if i == senders - 1 else (i + 1) * per - 1
            procs.append(subprocess.Popen(
                [*module_command(LOAD_SENDER), "--grpc", str(proc.grpc), "--run", run,
                 "--ranks", f"{i * per}-{last}", "--world-size", str(ranks),
                 "--steps-per-s", str(steps_per_s), "--duration", str(duration_s),
                 "--interval", str(interval_s), "--straggler", str(straggler)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env()))
        while any(p.poll() is None for p in procs):
            rss = proc.rss_bytes() / 2**20
            result.rss_max_mib = max(result.rss_max_mib, rss)
            result.rss_samples.append((round(time.monotonic() - began, 1), round(rss, 1)))
            try:
                text = proc.metrics_text()
            except OSError:
                text = ""
            lags = _labels_value(text, "traceml_processor_run_lag_seconds", run)
            if lags:
                result.lag_samples.append(lags[0][1])
            culprits = {_label(labels, v.ATTR_CULPRIT_RANK) for labels, _ in
                        _labels_value(text, "traceml_diagnosis_active_ratio", run)} - {""}
            if culprits:
                result.diagnosis_samples += 1
                if str(straggler) in culprits:
                    result.straggler_named_samples += 1
                    if result.first_named_s is None:
                        result.first_named_s = round(time.monotonic() - began, 1)
                if culprits - {str(straggler)}:
                    result.false_culprit_samples += 1
            time.sleep(1.0)
        for p in procs:
            out, _ = p.communicate(timeout=60)
            assert p.returncode == 0, out
            counts = json.loads(out.strip().splitlines()[-1])
            result.spans_sent += counts["spans"]
            result.sender_retries += counts["retries"]
            result.late_ticks += counts["late_ticks"]
        result.wall_s = time.monotonic() - began
        result.rows_stored = count_rows(proc.db)
        result.ingest_spans_per_s = result.rows_stored / result.wall_s
        result.lag_max_s = max(result.lag_samples, default=float("nan"))
        result.rss_max_mib = max(result.rss_max_mib, proc.rss_bytes() / 2**20)

        def diagnosis():
            found = _labels_value(proc.metrics_text(), "traceml_diagnosis_active_ratio", run)
            result.diagnosis = sorted((_label(labels, v.ATTR_DIAGNOSIS_KIND), _label(labels, v.ATTR_CULPRIT_RANK),
                                       round(score, 3))
                                      for labels, score in found)
            return any(culprit == str(straggler) for _, culprit, _ in result.diagnosis)

        result.culprit_found = wait_until(diagnosis, 60, 0.5)
    finally:
        code = proc.stop()
    assert code == 0, proc.log_text()[-3000:]
    return result
