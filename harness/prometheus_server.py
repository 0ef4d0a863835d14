"""Start a real Prometheus (the Debian `prometheus` binary) on loopback for a test, query it, stop it.

    with PrometheusServer(tmp_path, targets=["127.0.0.1:9464"]) as prom:
        series = prom.wait_for('traceml_window_steps{traceml_run_id="r"}')
        value = prom.query_value('sum(traceml_rank_metric_seconds)')

Its own config and storage live under the given folder; scrape interval 1 s by
default; optional rule files are loaded (and checked by Prometheus at start); `features`
turns on Prometheus feature flags (`exemplar-storage` for `exemplars()`).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

from harness.ports import free_port

PROMETHEUS_BIN = "prometheus"


def prometheus_available() -> bool:
    return shutil.which(PROMETHEUS_BIN) is not None


class PrometheusServer:
    def __init__(self, folder: Path, targets: Sequence[str], *, scrape_interval: str = "1s",
                 job: str = "traceml", rule_files: Sequence[Path] = (), evaluation_interval: str = "1s",
                 metrics_path: str = "/metrics", features: Sequence[str] = ()):
        self.folder = Path(folder)
        self.targets = list(targets)
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.job = job
        self.rule_files = [Path(p) for p in rule_files]
        self.metrics_path = metrics_path
        self.features = list(features)  # --enable-feature=... (e.g. exemplar-storage)
        self.port = free_port()
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config_text(self) -> str:
        # JSON is valid YAML: no YAML library needed to write the config.
        config = {
            "global": {"scrape_interval": self.scrape_interval, "scrape_timeout": self.scrape_interval,
                       "evaluation_interval": self.evaluation_interval},
            "scrape_configs": [{"job_name": self.job, "metrics_path": self.metrics_path,
                                "static_configs": [{"targets": self.targets}]}],
        }
        if self.rule_files:
            config["rule_files"] = [str(p.resolve()) for p in self.rule_files]
        return json.dumps(config, indent=2)

    def start(self, ready_timeout_s: float = 60.0) -> "PrometheusServer":
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "prometheus.yml"
        config.write_text(self.config_text())
        self._log = open(self.folder / "prometheus.log", "wb")
        self._proc = subprocess.Popen(
            [PROMETHEUS_BIN, f"--config.file={config}", f"--storage.tsdb.path={self.folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
             "--storage.tsdb.retention.time=1h", "--web.enable-lifecycle",
             *(f"--enable-feature={feature}" for feature in self.features)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}: {self.log_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus not ready after {ready_timeout_s} s: {self.log_text()}")

    def log_text(self) -> str:
        path = self.folder / "prometheus.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- HTTP API ------------------------------------------------------------------------

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            document = json.load(response)
        if document.get("status") != "success":
            raise RuntimeError(f"prometheus API error: {document}")
        return document["data"]

    def query(self, promql: str) -> list[dict]:
        """Instant query -> the `result` vector (each item has `metric` labels and `value`)."""
        return self.api("query", query=promql)["result"]

    def query_value(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def exemplars(self, promql: str, start: float = 0.0, end: float | None = None) -> list[dict]:
        """`/api/v1/query_exemplars` (needs `features=["exemplar-storage"]`): per series selected by
        `promql`, its `seriesLabels` and `exemplars` (each `labels`, `value`, `timestamp`)."""
        return self.api("query_exemplars", query=promql, start=start, end=time.time() + 60 if end is None else end)

    def targets_health(self) -> list[str]:
        return [t["health"] for t in self.api("targets")["activeTargets"]]

    def wait_for(self, promql: str, predicate: Callable[[list[dict]], bool] = bool,
                 timeout_s: float = 60.0) -> list[dict]:
        """Poll an instant query until `predicate(result)` holds; returns that result."""
        deadline = time.monotonic() + timeout_s
        result: list[dict] = []
        while time.monotonic() < deadline:
            result = self.query(promql)
            if predicate(result):
                return result
            time.sleep(0.5)
        raise AssertionError(f"prometheus query {promql!r} did not satisfy the condition within "
                             f"{timeout_s} s; last result {result}; targets {self.targets_health()}")
