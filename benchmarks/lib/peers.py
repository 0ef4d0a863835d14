"""The peer tools' environment and one `traceml run` under either TraceML.

bench_peers compares this project with its peers (the original TraceML, NVIDIA's straggler
sections) and checks/peers_agreement compares the two tools' verdicts on the same jobs;
both run the peers from one virtual environment, built once under `benchmarks/.peers/venv`
(git-ignored; never the project's `.venv`) with a constraints file pinning torch, so
nothing can pull a CUDA torch. `build_peers` builds it and says what it holds;
`run_job` runs one job under either tool's `traceml run`. Stdlib only.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = ROOT / "benchmarks" / ".peers"
PEER_VENV = PEERS_DIR / "venv"
PEER_PYTHON = PEER_VENV / "bin" / "python"
TORCH_PIN = "2.13.0"
PEER_PINS = {"traceml-ai": "0.5.0", "nvidia-resiliency-ext": "0.4.1", "nvidia-cuda-cupti-cu12": "12.9.79"}
NVRX_WANTED = "0.7.0"  # the latest listed; it has no distribution this machine can install
STAMP = PEER_VENV / "peers-stamp.json"
WORKLOAD = ROOT / "launcher" / "demo_workload.py"


def _cupti_lib_dir() -> Path:
    return PEER_VENV / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages" / "nvidia" / "cuda_cupti" / "lib"


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(PEER_PYTHON), "-m", "pip", "install", "-q", "-c", str(PEERS_DIR / "constraints.txt"),
                           *args], capture_output=True, text=True, timeout=1800)


def build_peers(log=print) -> dict:
    """The peer environment, built once; returns its stamp (versions installed, what runs on the CPU)."""
    wanted = {"torch": TORCH_PIN, **PEER_PINS}
    if STAMP.exists():
        stamp = json.loads(STAMP.read_text())
        if stamp.get("wanted") == wanted:
            return stamp
    log(f"building the peer environment in {PEER_VENV} (once)")
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    (PEERS_DIR / "constraints.txt").write_text(f"torch=={TORCH_PIN}\n")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(PEER_VENV)], check=True, timeout=600)
    out = _pip(f"torch=={TORCH_PIN}", f"traceml-ai=={PEER_PINS['traceml-ai']}")
    if out.returncode != 0:
        raise SystemExit(f"peer environment: pip failed:\n{out.stderr[-3000:]}")
    stamp: dict = {"wanted": wanted}
    latest = _pip("--dry-run", f"nvidia-resiliency-ext=={NVRX_WANTED}")
    stamp["nvrx_latest_listed"] = NVRX_WANTED
    stamp["nvrx_latest_installs"] = latest.returncode == 0
    out = _pip(f"nvidia-resiliency-ext=={PEER_PINS['nvidia-resiliency-ext']}",
               f"nvidia-cuda-cupti-cu12=={PEER_PINS['nvidia-cuda-cupti-cu12']}")
    stamp["nvrx_installed"] = out.returncode == 0
    probe = subprocess.run([str(PEER_PYTHON), "-c", (
        "import json, torch, importlib.metadata as m\n"
        "v = {n: m.version(n) for n in ('torch', 'traceml-ai')}\n"
        "try: v['nvidia-resiliency-ext'] = m.version('nvidia-resiliency-ext')\n"
        "except Exception: pass\n"
        "v['torch_cuda'] = torch.version.cuda\n"
        "print(json.dumps(v))")], capture_output=True, text=True, timeout=300)
    stamp["versions"] = json.loads(probe.stdout.strip().splitlines()[-1])
    if stamp["versions"]["torch_cuda"] is not None or not stamp["versions"]["torch"].startswith(TORCH_PIN):
        raise SystemExit(f"peer environment: expected the CPU torch {TORCH_PIN}, got {stamp['versions']}")
    stamp["nvrx_cpu_sections"] = stamp["nvrx_installed"] and _probe_nvrx()
    STAMP.write_text(json.dumps(stamp, indent=1))
    return stamp


def _probe_nvrx() -> bool:
    """Do the straggler detection sections run on this CPU-only machine?"""
    out = subprocess.run([str(PEER_PYTHON), "-W", "ignore", "-c", (
        "import nvidia_resiliency_ext.straggler as s\n"
        "s.Detector.initialize(gather_on_rank0=False, report_time_interval=1e9)\n"
        "with s.Detector.detection_section('probe', profile_cuda=False): pass\n"
        "print('ok')")], env=peer_env(), capture_output=True, text=True, timeout=300)
    return out.returncode == 0 and out.stdout.strip().endswith("ok")


def peer_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACEML_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                "LD_LIBRARY_PATH": f"{_cupti_lib_dir()}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")})
    env.update(extra or {})
    return env


def our_env() -> dict:
    """This process's environment without OpenTelemetry or TraceML settings, one torch thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACEML_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_job(tool: str, folder: Path, name: str, scenario: str, steps: int, nproc: int = 2,
            argv: list[str] | None = None) -> dict:
    """One `traceml run --nproc-per-node N` of launcher/demo_workload.py under `tool`; wall time and its summary.

    `argv` (a script and its arguments) runs instead of the demo workload; `scenario` and
    `steps` are then unused. For the original the caller passes a script that marks its own steps
    (checks/original_step_runner.py runs one that does not)."""
    folder.mkdir(parents=True, exist_ok=True)
    script, *workload = argv or [str(WORKLOAD), "--scenario", scenario, "--steps", str(steps)]
    if tool == "ours":
        cmd = [str(Path(sys.executable).parent / "traceml"), "run", "--standalone", "--nproc-per-node", str(nproc),
               "--runs-dir", str(folder), "--run-id", name, "--no-summary-print", script, *workload]
        env = our_env()
        summary_path = folder / name / "final_summary.json"
    else:
        shim = PEERS_DIR / "shim"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "traceml.py").write_text(ORIGINAL_SHIM)
        cmd = [str(PEER_VENV / "bin" / "traceml"), "run", "--nproc-per-node", str(nproc), "--logs-dir",
               str(folder), "--run-name", name, script, "--args", *workload]
        env = peer_env({"PYTHONPATH": str(shim)})
        summary_path = folder / name / "final_summary.json"
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads(summary_path.read_text())
    return {"wall_s": wall, "summary": summary, "rows": _stored_rows(tool, folder / name), "folder": folder / name}


# What the original's `traceml run` executes instead of `import traceml`: the workload calls
# trace_step and is_initialized/set_recording/shutdown; the original's own demos call init(mode="auto").
ORIGINAL_SHIM = '''"""Lets launcher/demo_workload.py run under the original TraceML (benchmarks/lib/peers.py writes this file)."""
import traceml_ai as _t

_t.init(mode="auto")
trace_step = _t.trace_step


def is_initialized():
    return False  # the calibration steps run outside trace_step, which the original does not record


def set_recording(on):
    pass


def shutdown(*args, **kwargs):
    from traceml_ai.runtime import lifecycle
    handle = lifecycle.get_active_runtime_handle()
    if handle is not None:
        handle.stop()
'''


def _stored_rows(tool: str, run_folder: Path) -> int:
    import sqlite3
    if tool == "ours":
        dbs = sorted(run_folder.glob("*.sqlite")) + sorted(run_folder.glob("*.db"))
        table = "step_time_samples"
    else:
        dbs = [run_folder / "aggregator" / "telemetry"]
        table = "step_time_samples"
    total = 0
    for db in dbs:
        if db.exists():
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
                try:
                    total += conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
                except sqlite3.Error:
                    pass
    return total
