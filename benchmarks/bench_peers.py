"""This project beside its peers, in one run: the original TraceML, PyTorch's profiler, NVIDIA's straggler sections.

    .venv/bin/python -m benchmarks.bench_peers [--quick] [--json] [--parts training analysis e2e]

The peers live in their own virtual environment, built once under
`benchmarks/.peers/venv` (git-ignored; never the project's `.venv`) with a
constraints file pinning torch 2.13.0, so nothing can pull a CUDA torch:

- `traceml-ai` (the original TraceML; PEER_PINS says which version was measured),
- `nvidia-resiliency-ext`: 0.7.0 has no distribution this machine can install
  (pip lists 0.1.3-0.4.1 only), so 0.4.1, the latest that installs, with the
  CUPTI runtime library from `nvidia-cuda-cupti-cu12` (its straggler module
  loads `libcupti.so.12` even for CPU-only sections). On the CPU its detection
  sections run with `profile_cuda=False`; its report (`generate_report`) calls
  `torch.cuda.synchronize()` and fails without CUDA, so only the sections'
  training-thread cost is measured, never a report.

The original imports as `traceml_ai` and also ships a `traceml` module that
refuses to import, so the two tools cannot share a process. Every tool therefore
runs in its own worker process (one model, optimizer and DataLoader each), and
each worker also runs the same loop uninstrumented: every figure pairs a tool's
steps with its own worker's uninstrumented steps, so separate model instances
never enter a ratio. The coordinator (this process) alternates the workers and
their variants within one run, as `bench_overhead.py` does: a new seeded random
order every round, one turn per (worker, variant), only one worker busy at a
time, the request/answer pipes outside the timed steps.

Training side (`--parts training`), on bench_overhead's two CPU steps (the same
MLP, loader and optimizer shapes: hidden 64, batch 16, about 0.35 ms; hidden
960, batch 128, about 10 ms). All five phases are timed by every tool (input,
H2D, forward, backward, optimizer):

- ours, manual and auto, with the exporter live (OTLP/HTTP without phase child
  spans to a real `traceml-processor` subprocess, as a one-node `traceml run` has it);
- the original, manual (`wrap_dataloader_fetch`, `wrap_h2d`, `wrap_forward`,
  `wrap_backward`, `wrap_optimizer`) and auto (`init(mode="auto")`: its global
  patches and optimizer hooks), each with its own per-process runtime
  (samplers, sender) and its aggregator live: a `traceml serve` subprocess in
  summary mode, the default `traceml run` starts;
- PyTorch's profiler (CPU activities) with `record_function` around the five
  phases, always on and with a schedule (wait 1, warm-up 1, active 3); a turn is
  a block of steps inside one `profile()` whose start and stop are not timed;
- NVIDIA's straggler `detection_section` around the five phases.

Where a tool installs something global (the auto patches; the original's wrapped
`forward`/`step`), it is put in place before its turn and taken away after it,
outside the timed steps, so the uninstrumented turns run bare.

Figures: (a) the small step's added training-thread CPU per step: per round,
the variant's median step minus the uninstrumented median of the same worker,
the median of those differences over the rounds, with a bootstrap 95 % interval;
(b) the ~10 ms step's throughput ratio: uninstrumented over instrumented wall
time, pooled over the rounds (one step per turn; the profiler a block), with the
delta-method 95 % interval of bench_overhead; (c) the CPU the tool's other
threads in the training process (samplers, sender, exporter) spend during the
~10 ms phase per instrumented step, charged to the instrumented steps in a
CPU-accounted ratio (as bench_overhead charges the samplers); the charge is an
upper bound: it includes the idle polling done while other workers had their turns. The helper process (the original's aggregator, our
processor) runs beside training, not in it: its CPU is given as a share of one core
over the phase, not charged to the steps. (d) Background in place, after the ~10 ms
rounds, each tool's worker alone busy (`measure_background`): 20 s (full run 60 s) of
its steps back to back, then 2 s untimed and 20 s (40 s) idle; per 1 s block, the
process's other threads' CPU (process CPU minus the training thread's) and the helper
process's, as shares of a core with a 95 % interval over the blocks, while training
and while idle; and their cost per step in place: the steps during which the other
threads spent CPU, with the step after each, against their unaffected neighbours
(bench_overhead's samplers-in-place estimator, `benchmarks.lib.attribution`, applied to
every thread of the tool, with its no-work control).

Analysis (`--parts analysis`): each tool's store is built through its own
write path (ours: `StepTimeStore.write`; the original: its aggregator's
`SQLiteWriterSimple.ingest` of StepTimeSampler envelopes) with 400 steps of
five phases per rank at 1, 64 and 1,024 ranks; the write rate is the ingest
figure (rows/s into the store). Then, alternating the two tools: a live refresh
after one new step per rank (ours `LiveStepTimeSession`; the original's
`LiveStepTimeSession`, window 100, lookback 4 in both), and the summary over
the same store (ours `StepTimePipeline` summary profile; the original's
`StepTimePipeline(profile="summary")`).

End to end (`--parts e2e`): `traceml run --nproc-per-node 2` of the same
2-rank gloo job (`launcher/demo_workload.py --scenario balanced`) under each
tool's launcher, alternating, wall time from the command's start to its exit,
and the rows each tool stored per second of the run.

Figures come from this shared machine; they are contended when other work runs,
so read the ratios of one run. `--quick` takes about 5-8 minutes here (the peer
environment's first build adds about a minute), the full run about 25-35.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.estimators import ratio_interval, steady_allocator, wall_and_cpu
from benchmarks.lib.json_output import add_json_flag, print_json, table_output
from benchmarks.lib.peers import NVRX_WANTED, PEER_PYTHON, ROOT, build_peers, our_env, peer_env, run_job

# The ~0.35 ms and ~10 ms steps of bench_overhead (hidden, batch, batches).
SHAPES = {"small": (64, 16, 64), "big": (960, 128, 32)}
PROFILER_BLOCK = 5  # steps per torch.profiler turn on the ~10 ms step: one schedule cycle
SMALL_BLOCK = 25


# ---------------------------------------------------------------- worker side (runs in either venv)

def _block(job, one_step):
    """A runner of `steps` steps, each `one_step(x, y)` between two clock readings."""
    def run(steps: int, out: list, clock) -> None:
        next_batch = job.plain_batches.next
        for _ in range(steps):
            t0 = clock()
            x, y = next_batch()
            one_step(x, y)
            out.append(clock() - t0)
    return run


def _plain_runner(job):
    import torch

    mse = torch.nn.functional.mse_loss
    model, opt = job.model, job.opt

    def step(x, y):
        x = x.to("cpu")
        out_ = model(x)
        loss = mse(out_, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _block(job, step)


class _Helper:
    """A helper process a tool runs beside training (aggregator, processor): its CPU seconds."""

    def __init__(self, pid: int | None) -> None:
        import psutil
        self.ps = psutil.Process(pid) if pid else None

    def cpu_s(self) -> float:
        if self.ps is None:
            return 0.0
        total = 0.0
        try:
            for p in [self.ps, *self.ps.children(recursive=True)]:
                t = p.cpu_times()
                total += t.user + t.system
        except Exception:
            pass
        return total


def _worker_ours(job, folder: Path) -> tuple[dict, _Helper, callable]:
    """Ours, manual and auto, the exporter sending to a real processor."""
    sys.path.insert(0, str(ROOT))
    from harness import ProcessorProcess
    from benchmarks.lib.traced_steps import mode_runner, with_timed_loader
    import traceml

    proc = ProcessorProcess(folder, grpc_port=None,  # as a one-node `traceml run` starts it: OTLP/HTTP only
                            extra_args=["--log-level", "WARNING", "--idle-timeout", "3600"])
    proc.start(wait_readyz=True)
    # As `traceml run` sets up a rank of a one-node job: OTLP/HTTP to its processor, no phase child
    # spans (for trace viewers; the processor drops them). bench_background measures the exporter
    # over both protocols with and without them.
    traceml.init(mode="manual", endpoint=f"http://127.0.0.1:{proc.http}", protocol="http/protobuf",
                 run_id="bench-peers", phase_spans=False)
    with_timed_loader(job)

    def variant(mode):
        run = mode_runner(job, mode)
        return lambda steps, out, clock: run(steps, clock, out)
    variants = {"plain": variant(None), "control": variant(None),
                "ours manual": variant("manual"), "ours auto": variant("auto")}

    def close():
        traceml.shutdown(timeout_s=10)
        proc.stop()
    return variants, _Helper(proc.proc.pid), close


def _start_original_aggregator(folder: Path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"TRACEML_AGGREGATOR_PORT": str(port), "TRACEML_SESSION_ID": f"peers-{port}",
           "TRACEML_LOGS_DIR": str(folder / "logs")}
    os.environ.update(env)
    agg = subprocess.Popen([str(Path(sys.executable).parent / "traceml"), "serve", "--mode", "summary",
                            "--logs-dir", str(folder / "logs"), "--run-name", f"peers-{port}",
                            "--aggregator-port", str(port)],
                           stdout=subprocess.DEVNULL, stderr=open(folder / "aggregator.log", "wb"), cwd=folder)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return agg
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the original's aggregator did not start")


def _worker_original(job, folder: Path, mode: str) -> tuple[dict, _Helper, callable]:
    """The original TraceML in `mode`, its runtime and its aggregator live."""
    import torch
    from torch.utils.data import DataLoader

    from benchmarks.lib.workload import Batches

    agg = _start_original_aggregator(folder)
    import traceml_ai as tm
    tm.init(mode=mode)
    model, opt, mse = job.model, job.opt, torch.nn.functional.mse_loss
    if mode == "manual":
        wrapped_batches = Batches(tm.wrap_dataloader_fetch(job.loader))
        tm.wrap_forward(model)
        tm.wrap_optimizer(opt)
        wrapped = {"forward": model.__dict__.pop("forward"), "step": opt.__dict__.pop("step")}

        def manual(steps, out, clock):
            model.forward, opt.step = wrapped["forward"], wrapped["step"]
            try:
                for _ in range(steps):
                    t0 = clock()
                    with tm.trace_step(model):
                        x, y = wrapped_batches.next()
                        x = tm.wrap_h2d(x).to("cpu")
                        out_ = model(x)
                        loss = mse(out_, y)
                        tm.wrap_backward(loss).backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    out.append(clock() - t0)
            finally:
                del model.forward, opt.step
        tool = {"original manual": manual}
    else:
        from traceml_ai.instrumentation.hooks import optimizer_hooks
        patched = {(torch.nn.Module, "__call__"), (DataLoader, "__iter__"), (torch.Tensor, "backward"),
                   (torch.autograd, "backward"), (torch.Tensor, "to")}
        patched = {key: getattr(*key) for key in patched}
        from traceml_ai.instrumentation.patches import (backward_auto_timer_patch as b, dataloader_patch as d,
                                                        forward_auto_timer_patch as f, h2d_auto_timer_patch as h)
        originals = {(torch.nn.Module, "__call__"): f._ORIG_MODULE_CALL, (DataLoader, "__iter__"): d._ORIG_DATALOADER_ITER,
                     (torch.Tensor, "backward"): b._ORIG_TENSOR_BACKWARD,
                     (torch.autograd, "backward"): b._ORIG_AUTOGRAD_BACKWARD, (torch.Tensor, "to"): h._ORIG_TENSOR_TO}

        def put(table):
            for (owner, name), value in table.items():
                setattr(owner, name, value)
        put(originals)
        patched_batches = []

        def auto(steps, out, clock):
            put(patched)
            try:
                if not patched_batches:
                    patched_batches.append(Batches(job.loader))  # its iterator comes from the patched __iter__
                next_batch = patched_batches[0].next
                for _ in range(steps):
                    t0 = clock()
                    with tm.trace_step(model):
                        x, y = next_batch()
                        x = x.to("cpu")
                        out_ = model(x)
                        loss = mse(out_, y)
                        loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    out.append(clock() - t0)
            finally:
                put(originals)
                optimizer_hooks.reset_optimizer_timing()
        tool = {"original auto": auto}

    def close():
        from traceml_ai.runtime import lifecycle
        handle = lifecycle.get_active_runtime_handle()
        if handle is not None:
            handle.stop()
        agg.terminate()
        agg.wait(timeout=60)
    return {"plain": _plain_runner(job), "control": _plain_runner(job), **tool}, _Helper(agg.pid), close


def _worker_torch_profiler(job) -> tuple[dict, _Helper, callable]:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    model, opt, mse = job.model, job.opt, torch.nn.functional.mse_loss

    def variant(with_schedule: bool):
        def run(steps, out, clock):
            kwargs = {"schedule": schedule(wait=1, warmup=1, active=3, repeat=0)} if with_schedule else {}
            with profile(activities=[ProfilerActivity.CPU], **kwargs) as prof:
                next_batch = job.plain_batches.next
                for _ in range(steps):
                    t0 = clock()
                    with record_function("input"):
                        x, y = next_batch()
                    with record_function("h2d"):
                        x = x.to("cpu")
                    with record_function("forward"):
                        out_ = model(x)
                    loss = mse(out_, y)
                    with record_function("backward"):
                        loss.backward()
                    with record_function("optimizer"):
                        opt.step()
                    opt.zero_grad(set_to_none=True)
                    prof.step()
                    out.append(clock() - t0)
        return run
    return ({"plain": _plain_runner(job), "control": _plain_runner(job),
             "torch.profiler": variant(False), "torch.profiler, schedule": variant(True)},
            _Helper(None), lambda: None)


def _worker_nvrx(job) -> tuple[dict, _Helper, callable]:
    import nvidia_resiliency_ext.straggler as straggler
    import torch

    straggler.Detector.initialize(gather_on_rank0=False, report_time_interval=1e9)
    section = straggler.Detector.detection_section
    model, opt, mse = job.model, job.opt, torch.nn.functional.mse_loss

    def run(steps, out, clock):
        next_batch = job.plain_batches.next
        for _ in range(steps):
            t0 = clock()
            with section("input", profile_cuda=False):
                x, y = next_batch()
            with section("h2d", profile_cuda=False):
                x = x.to("cpu")
            with section("forward", profile_cuda=False):
                out_ = model(x)
            loss = mse(out_, y)
            with section("backward", profile_cuda=False):
                loss.backward()
            with section("optimizer", profile_cuda=False):
                opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(clock() - t0)
    return {"plain": _plain_runner(job), "control": _plain_runner(job), "NVIDIA straggler sections": run}, \
        _Helper(None), straggler.Detector.shutdown


def _serve_training(kind: str, shape: str) -> None:
    """Worker main: build the tool's variants, then answer the coordinator's turns."""
    import torch

    from benchmarks.lib.workload import Job

    steady_allocator()  # what bench_overhead does, in every worker alike: glibc keeps freed memory
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix=f"bench-peers-{kind}-"))
    job = Job(*SHAPES[shape])
    if kind == "ours":
        variants, helper, close = _worker_ours(job, folder)
    elif kind.startswith("original-"):
        variants, helper, close = _worker_original(job, folder, kind.split("-", 1)[1])
    elif kind == "torch-profiler":
        variants, helper, close = _worker_torch_profiler(job)
    elif kind == "nvrx":
        variants, helper, close = _worker_nvrx(job)
    else:
        raise SystemExit(f"unknown worker {kind}")

    def collect(name, steps):
        out: list = []
        variants[name](steps, out, wall_and_cpu)
        return [(d.real, d.imag) for d in out]

    def cpu_now():
        return {"process_cpu_s": time.process_time(), "thread_cpu_s": time.thread_time(), "helper_cpu_s": helper.cpu_s()}

    handlers = {"variants": lambda msg: list(variants),
                "run": lambda msg: collect(msg["variant"], msg["steps"]),
                "freeze": lambda msg: (__import__("gc").collect(), __import__("gc").freeze(), True)[-1],
                "cpu": lambda msg: cpu_now(),
                "background": lambda msg: background_in_place(variants[msg["variant"]], helper, msg["train_s"],
                                                      msg["idle_s"], msg["settle_s"])}
    _serve(handlers, close)


BACKGROUND_BLOCK_S = 1.0
"""One sample of the background figures: the other threads' and the helper's CPU over this long."""
OTHER_THREADS_WORKED_S = 50e-6
"""A step during which the process's other threads spent more CPU than this had background work in
it (below: the jitter of reading two CPU clocks, and an idle exporter's poller ticks)."""
BACKGROUND_TOOLS = {"ours": ("ours manual", "ours auto"), "original-manual": ("original manual",),
                    "original-auto": ("original auto",)}
"""The variants whose background work is measured in place: every tool with threads or a helper."""


def background_in_place(run, helper, train_s: float, idle_s: float, settle_s: float) -> dict:
    """The tool's background cost in place, with this worker alone busy: `train_s` of its
    steps back to back, then `settle_s` untimed and `idle_s` of nothing (the job between
    steps or done). Per block of about a second: the CPU of the process's other threads
    (process CPU minus the training thread's) and of the helper process, over the block's
    wall time; per training step: its wall time and whether another thread spent CPU
    during it (the coordinator reads the steps that did against their neighbours,
    `benchmarks.lib.attribution`)."""
    process, thread, now = time.process_time, time.thread_time, time.perf_counter
    stamps: list = []

    def clock() -> float:
        t = now()
        stamps.append((t, process() - thread()))
        return t

    def block_start():
        return now(), process() - thread(), helper.cpu_s()

    def block_end(start, steps=0):
        t0, o0, h0 = start
        t1, o1, h1 = now(), process() - thread(), helper.cpu_s()
        return {"wall_s": t1 - t0, "threads_cpu_s": o1 - o0, "helper_cpu_s": h1 - h0, "steps": steps}

    train, durations, per_call = [], [], 5
    deadline = now() + train_s
    while now() < deadline:
        start, first = block_start(), len(durations)
        block_deadline = min(deadline, start[0] + BACKGROUND_BLOCK_S)
        while now() < block_deadline:
            run(per_call, durations, clock)
        train.append(block_end(start, len(durations) - first))
    pairs = list(zip(stamps[0::2], stamps[1::2]))
    marked = [end[1] - begin[1] > OTHER_THREADS_WORKED_S for begin, end in pairs]
    time.sleep(settle_s)
    idle = []
    for _ in range(max(1, round(idle_s / BACKGROUND_BLOCK_S))):
        start = block_start()
        time.sleep(BACKGROUND_BLOCK_S)
        idle.append(block_end(start))
    return {"train": train, "idle": idle, "durations": [float(d) for d in durations], "marked": marked}


def _serve(handlers: dict, close) -> None:
    """JSON lines in on stdin, out on the original stdout; the tools' own prints go to stderr."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    channel.write(json.dumps({"ready": True}) + "\n")
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["cmd"] == "quit":
                break
            try:
                answer = {"ok": handlers[msg["cmd"]](msg)}
            except Exception as exc:  # a worker's failure is reported, the run goes on
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            channel.write(json.dumps(answer) + "\n")
    finally:
        close()
        channel.write(json.dumps({"closed": True}) + "\n")


# ---------------------------------------------------------------- analysis workers

PHASES_MS = {"input": 5.0, "h2d": 5.0, "forward": 30.0, "backward": 45.0, "optimizer": 10.0}


def _skew(rank: int, step: int) -> float:
    return 1.0 + 0.01 * (rank % 7) + 0.001 * (step % 13)


def _serve_analysis(kind: str) -> None:
    folder = Path(tempfile.mkdtemp(prefix=f"bench-peers-analysis-{kind}-"))
    tool = _OursAnalysis(folder) if kind == "ours" else _OriginalAnalysis(folder)
    _serve({"build": lambda m: tool.build(m["ranks"], m["steps"]),
            "live": lambda m: tool.live(m["ranks"]),
            "summary": lambda m: tool.summary(m["ranks"])}, lambda: None)


class _OursAnalysis:
    def __init__(self, folder: Path) -> None:
        sys.path.insert(0, str(ROOT))
        from benchmarks.lib.step_time_rows import RUN, records, write
        from traceml.processor.sqlite_writer import StepTimeStore
        from traceml.processor.step_time.pipeline import PROFILE_SUMMARY, LiveStepTimeSession, StepTimePipeline, \
            StepTimeRequest
        self.folder, self.run = folder, RUN
        self._records, self._write = records, write
        self.Store, self.Session, self.Pipeline, self.Request, self.SUMMARY = \
            StepTimeStore, LiveStepTimeSession, StepTimePipeline, StepTimeRequest, PROFILE_SUMMARY
        self.stores, self.sessions, self.next_step = {}, {}, {}

    def build(self, ranks: int, steps: int) -> dict:
        db = self.folder / f"ours_{ranks}.db"
        store = self.Store(db)
        t0 = time.perf_counter()
        self._write(store, ranks, range(1, steps + 1))
        write_s = time.perf_counter() - t0
        self.stores[ranks], self.next_step[ranks] = (store, db), steps + 1
        session = self.Session(db, self.run)
        t0 = time.perf_counter()
        session.refresh()
        cold = time.perf_counter() - t0
        self.sessions[ranks] = session
        return {"rows_per_s": ranks * steps / write_s, "cold_s": cold}

    def live(self, ranks: int) -> float:
        store, _ = self.stores[ranks]
        step = self.next_step[ranks]
        store.write(self._records(ranks, range(step, step + 1)))
        self.next_step[ranks] = step + 1
        t0 = time.perf_counter()
        result = self.sessions[ranks].refresh()
        elapsed = time.perf_counter() - t0
        assert result.analysis.window.steps[-1] == step
        return elapsed

    def summary(self, ranks: int) -> float:
        _, db = self.stores[ranks]
        t0 = time.perf_counter()
        self.Pipeline().run(self.Request(db, self.run, profile=self.SUMMARY))
        return time.perf_counter() - t0


class _OriginalAnalysis:
    """The original's own write path (its aggregator's SQLite writer) and its own analysis entry points."""

    def __init__(self, folder: Path) -> None:
        from traceml_ai.aggregator import sqlite_writer as w
        from traceml_ai.step_time import pipeline as p
        from traceml_ai.step_time.sqlite import SQLiteStepTimeRepository
        from traceml_ai.step_time.model import STEP_TIME_EVENT_NAMES, StepTimeLoadRequest
        self.names = STEP_TIME_EVENT_NAMES
        self.t0 = time.time() - 2_000  # recent: the writer's 30-minute history retention keeps it
        self.w, self.p, self.Repo, self.Request = w, p, SQLiteStepTimeRepository, StepTimeLoadRequest
        self.folder = folder
        self.writers, self.sessions, self.next_step, self.seq = {}, {}, {}, 0

    def _envelope(self, rank: int, ranks: int, steps: range) -> dict:
        names = {ph: self.names[metric] for ph, metric in (("input", "input_wait"), ("h2d", "h2d"),
                 ("forward", "forward"), ("backward", "backward"), ("optimizer", "optimizer_step"))}
        rows = []
        for step in steps:
            k = _skew(rank, step)
            events = {names[ph]: {"cpu": {"is_gpu": False, "duration_ms": v * k, "cpu_ms": v * k, "gpu_ms": None,
                                          "n_calls": 1}} for ph, v in PHASES_MS.items()}
            total = sum(PHASES_MS.values()) * k
            events[self.names["traced_step_time"]] = {"cpu": {"is_gpu": False, "duration_ms": total,
                                                             "cpu_ms": total, "gpu_ms": None, "n_calls": 1}}
            self.seq += 1
            rows.append({"seq": self.seq, "timestamp": self.t0 + step, "step": step, "events": events})
        return {"meta": {"sampler": "StepTimeSampler", "rank": rank, "global_rank": rank, "local_rank": rank % 8,
                         "world_size": ranks, "local_world_size": min(ranks, 8), "node_rank": rank // 8,
                         "hostname": f"node{rank // 8}", "timestamp": time.time()},
                "body": {"tables": {"StepTimeTable": rows}}}

    def _write(self, writer, ranks: int, steps: range) -> None:
        for rank in range(ranks):
            writer.ingest(self._envelope(rank, ranks, steps))
        if not writer.force_flush(timeout_sec=600):
            raise RuntimeError("the original's writer did not flush")

    def build(self, ranks: int, steps: int) -> dict:
        db = self.folder / f"original_{ranks}" / "telemetry"
        db.parent.mkdir(parents=True)
        cfg = self.w.SQLiteWriterConfig(path=str(db), max_queue=1_000_000)
        writer = self.w.SQLiteWriterSimple(cfg)
        writer.start()
        t0 = time.perf_counter()
        for start in range(1, steps + 1, 50):  # 50 steps per rank and message, like a sender's batch
            self._write(writer, ranks, range(start, min(start + 50, steps + 1)))
        write_s = time.perf_counter() - t0
        self.writers[ranks], self.next_step[ranks] = (writer, db), steps + 1
        session = self.p.LiveStepTimeSession(str(db))
        t0 = time.perf_counter()
        first = session.refresh()
        cold = time.perf_counter() - t0
        if not first.analysis.window.metrics:
            raise RuntimeError("the original's analysis found no step-time metrics in its store")
        self.sessions[ranks] = session
        return {"rows_per_s": ranks * steps / write_s, "cold_s": cold}

    def live(self, ranks: int) -> float:
        writer, _ = self.writers[ranks]
        step = self.next_step[ranks]
        self._write(writer, ranks, range(step, step + 1))
        self.next_step[ranks] = step + 1
        t0 = time.perf_counter()
        result = self.sessions[ranks].refresh()
        elapsed = time.perf_counter() - t0
        window = result.analysis.window
        if window.steps[-1] != step or len(window.step_ranks) != ranks:
            raise RuntimeError(f"the original's live window ends at step {window.steps[-1]} with "
                               f"{len(window.step_ranks)} ranks; expected {step} and {ranks}")
        return elapsed

    def summary(self, ranks: int) -> float:
        import sqlite3
        _, db = self.writers[ranks]
        t0 = time.perf_counter()
        with sqlite3.connect(str(db)) as conn:
            conn.row_factory = sqlite3.Row
            self.p.StepTimePipeline(repository=self.Repo(conn), profile="summary").run(
                self.Request(window_size=10_000, lookback_factor=1))
        return time.perf_counter() - t0


# ---------------------------------------------------------------- coordinator side

class Worker:
    """One worker process and its pipe."""

    def __init__(self, python: Path, args: list[str], env: dict | None = None) -> None:
        self.args = args
        self.proc = subprocess.Popen([str(python), "-m", "benchmarks.bench_peers", *args], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)
        first = self.proc.stdout.readline()
        if not first:
            raise RuntimeError(f"worker {args} died while starting (run it by hand to see why)")

    def ask(self, cmd: str, **kw):
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        if "error" in answer:
            raise RuntimeError(f"worker {self.args}: {answer['error']}")
        return answer["ok"]

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=90)
        except Exception:
            self.proc.kill()


def _training_workers(shape: str, stamp: dict, log) -> dict[str, Worker]:
    ours = Path(sys.executable)
    kinds = [("ours", ours, our_env()), ("torch-profiler", ours, our_env()),
             ("original-manual", PEER_PYTHON, peer_env()), ("original-auto", PEER_PYTHON, peer_env())]
    if stamp.get("nvrx_cpu_sections"):
        kinds.append(("nvrx", PEER_PYTHON, peer_env()))
    workers = {}
    for kind, python, env in kinds:
        workers[kind] = Worker(python, ["--worker", kind, "--shape", shape], env)
        log(f"  worker {kind} ready ({', '.join(workers[kind].ask('variants'))})")
    return workers


def bootstrap_median(diffs: list, seed: int = 0, n: int = 1000) -> tuple[float, float]:
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def _rounds(workers: dict, rounds: int, block_of, log, label: str) -> dict:
    """Per (worker, variant): one list of (wall, cpu) step lists per round, in a shuffled order."""
    turns = [(kind, name) for kind, w in workers.items() for name in w.ask("variants")]
    order = random.Random(0)
    out = {turn: [] for turn in turns}
    started = time.monotonic()
    for r in range(rounds):
        order.shuffle(turns)
        for kind, name in turns:
            out[(kind, name)].append(workers[kind].ask("run", variant=name, steps=block_of(kind)))
        if r and r % max(1, rounds // 5) == 0:
            log(f"  {label}: round {r}/{rounds}, {time.monotonic() - started:.0f} s")
    return out


def measure_training(quick: bool, stamp: dict, log) -> dict:
    figures: dict = {"small": [], "big": []}
    # The small step: training-thread CPU per step.
    log("training side, ~0.35 ms step: workers start")
    workers = _training_workers("small", stamp, log)
    try:
        for w in workers.values():
            for name in w.ask("variants"):
                w.ask("run", variant=name, steps=30)
        samples = _rounds(workers, 40 if quick else 200, lambda kind: SMALL_BLOCK, log, "small step")
    finally:
        for w in workers.values():
            w.close()
    med = statistics.median
    for (kind, name), per_round in samples.items():
        if name == "plain":
            continue
        base = samples[(kind, "plain")]
        diffs = [(med(c for _, c in v) - med(c for _, c in b)) * 1e6 for v, b in zip(per_round, base)]
        lo, hi = bootstrap_median(diffs)
        figures["small"].append({"worker": kind, "variant": name, "plain_step_ms": med(c for b in base for _, c in b) * 1e3,
                                 "added_cpu_us": med(diffs), "added_cpu_us_ci95": (lo, hi)})
    # The ~10 ms step: throughput, one step per turn (the profiler a block), plus background CPU.
    log("training side, ~10 ms step: workers start")
    workers = _training_workers("big", stamp, log)
    try:
        for w in workers.values():
            for name in w.ask("variants"):
                w.ask("run", variant=name, steps=3)
            w.ask("freeze")
        cpu0 = {k: w.ask("cpu") for k, w in workers.items()}
        t0 = time.monotonic()
        samples = _rounds(workers, 120 if quick else 1500,
                          lambda kind: PROFILER_BLOCK if kind == "torch-profiler" else 1, log, "~10 ms step")
        wall = time.monotonic() - t0
        cpu1 = {k: w.ask("cpu") for k, w in workers.items()}
        figures["background"] = measure_background(workers, quick, log)
    finally:
        for w in workers.values():
            w.close()
    for (kind, name), per_round in samples.items():
        if name == "plain":
            continue
        base = samples[(kind, "plain")]
        base_wall = [sum(s for s, _ in b) for b in base]
        var_wall = [sum(s for s, _ in v) for v in per_round]
        ratio, lo, hi = ratio_interval(base_wall, var_wall)
        traced = name != "control"
        n_traced = sum(len(v) for (k, n), per in samples.items() if k == kind and n not in ("plain", "control")
                       for v in per)
        c0, c1 = cpu0[kind], cpu1[kind]
        threads = (c1["process_cpu_s"] - c0["process_cpu_s"]) - (c1["thread_cpu_s"] - c0["thread_cpu_s"])
        background_us = threads / n_traced * 1e6 if traced and n_traced else 0.0
        helper_share = (c1["helper_cpu_s"] - c0["helper_cpu_s"]) / wall if traced else 0.0
        steps = sum(len(v) for v in per_round)
        base_cpu = sum(c for b in base for _, c in b) / steps
        var_cpu = sum(c for v in per_round for _, c in v) / steps
        figures["big"].append({
            "worker": kind, "variant": name, "plain_step_ms": statistics.fmean(base_wall) / len(base[0]) * 1e3,
            "throughput_ratio": ratio, "throughput_ratio_ci95": (lo, hi),
            "added_thread_cpu_us": (var_cpu - base_cpu) * 1e6, "background_cpu_us_per_step": background_us,
            "helper_cpu_share_ratio": helper_share, "threads_cpu_share_ratio": threads / wall if traced else 0.0,
            "cpu_accounted_ratio": base_cpu / (var_cpu + background_us / 1e6),
            "steps": steps})
    figures["big_phase_wall_s"] = wall
    return figures


def mean_interval(values: list) -> tuple[float, float, float]:
    """Mean and its 95 % interval (normal approximation over the blocks)."""
    mean = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("inf")
    return mean, mean - half, mean + half


def measure_background(workers: dict, quick: bool, log) -> list:
    """Each tool's background work in place, one worker busy at a time (`background_in_place`): the
    training process's other threads and the helper process, as shares of a core while its
    steps run back to back and while it is idle, per block with intervals; and the cost per
    step of the other threads' work in the steps it lands in (`benchmarks.lib.attribution`,
    the samplers-in-place estimator of bench_overhead applied to every thread of the tool)."""
    from benchmarks.lib.attribution import attributed

    train_s, idle_s, settle_s = (20.0, 20.0, 2.0) if quick else (60.0, 40.0, 2.0)
    out = []
    for kind, names in BACKGROUND_TOOLS.items():
        if kind not in workers:
            continue
        for name in names:
            log(f"  background in place: {name} ({train_s:.0f} s of steps, then {idle_s:.0f} s idle)")
            got = workers[kind].ask("background", variant=name, train_s=train_s, idle_s=idle_s, settle_s=settle_s)
            row = {"worker": kind, "variant": name, "steps": len(got["durations"]),
                   "step_ms": statistics.median(got["durations"]) * 1e3}
            for phase, key in (("training", "train"), ("idle", "idle")):
                blocks = got[key]
                row[f"{phase}_threads_cpu_share_ratio"] = mean_interval([b["threads_cpu_s"] / b["wall_s"] for b in blocks])
                row[f"{phase}_helper_cpu_share_ratio"] = mean_interval([b["helper_cpu_s"] / b["wall_s"] for b in blocks])
            steps = sum(b["steps"] for b in got["train"])
            row["threads_cpu_us_per_step"] = sum(b["threads_cpu_s"] for b in got["train"]) / steps * 1e6 if steps else 0.0
            found = attributed(got["durations"], got["marked"], after_steps=1)
            row["in_place_us_per_step"] = found["per_step"] * 1e6
            row["in_place_us_per_step_se"] = found["per_step_se"] * 1e6
            row["in_place_marked_ratio"] = found["share"]
            row["in_place_control_us_per_run"] = found["control_per_run"] * 1e6
            row["in_place_control_us_per_run_se"] = found["control_per_run_se"] * 1e6
            row["in_place_runs"] = found["runs"]
            out.append(row)
    return out


def measure_analysis(quick: bool, log) -> dict:
    rank_counts = [1, 64] if quick else [1, 64, 1024]
    repeats = 5 if quick else 9
    ours = Worker(Path(sys.executable), ["--analysis", "ours"], our_env())
    original = Worker(PEER_PYTHON, ["--analysis", "original"], peer_env())
    tools = {"ours": ours, "original": original}
    rows = []
    try:
        for ranks in rank_counts:
            built = {name: w.ask("build", ranks=ranks, steps=400) for name, w in tools.items()}
            live = {name: [] for name in tools}
            summary = {name: [] for name in tools}
            for i in range(repeats):
                for name in (list(tools) if i % 2 == 0 else list(tools)[::-1]):
                    live[name].append(tools[name].ask("live", ranks=ranks))
            for i in range(3):
                for name in (list(tools) if i % 2 == 0 else list(tools)[::-1]):
                    summary[name].append(tools[name].ask("summary", ranks=ranks))
            row = {"ranks": ranks, "steps": 400}
            for name in tools:
                row[f"{name}_ingest_rows_per_s"] = built[name]["rows_per_s"]
                row[f"{name}_cold_ms"] = built[name]["cold_s"] * 1e3
                row[f"{name}_live_ms"] = statistics.median(live[name]) * 1e3
                row[f"{name}_summary_ms"] = statistics.median(summary[name]) * 1e3
            pairs = [o / u for o, u in zip(live["original"], live["ours"])]
            row["live_ratio"] = statistics.median(pairs)
            row["live_ratio_range"] = (min(pairs), max(pairs))
            row["summary_ratio"] = row["original_summary_ms"] / row["ours_summary_ms"]
            rows.append(row)
            log(f"  analysis at {ranks} ranks: live {row['ours_live_ms']:.2f} vs {row['original_live_ms']:.2f} ms")
    finally:
        ours.close()
        original.close()
    return {"analysis": rows}


def measure_e2e(quick: bool, log) -> dict:
    trials = 1 if quick else 3
    steps = 150 if quick else 300
    out: dict = {"steps": steps, "trials": trials, "ours_wall_s": [], "original_wall_s": [],
                 "ours_rows": [], "original_rows": []}
    with tempfile.TemporaryDirectory(prefix="bench-peers-e2e-") as tmp:
        for trial in range(trials):
            for tool in (("ours", "original") if trial % 2 == 0 else ("original", "ours")):
                r = run_job(tool, Path(tmp) / tool, f"e2e-{trial}", "balanced", steps)
                out[f"{tool}_wall_s"].append(r["wall_s"])
                out[f"{tool}_rows"].append(r["rows"])
                log(f"  traceml run, {tool}, trial {trial + 1}: {r['wall_s']:.1f} s, {r['rows']} rows stored")
    for tool in ("ours", "original"):
        out[f"{tool}_median_wall_s"] = statistics.median(out[f"{tool}_wall_s"])
        out[f"{tool}_rows_per_s"] = statistics.median(r / w for r, w in zip(out[f"{tool}_rows"], out[f"{tool}_wall_s"]))
    out["wall_ratio"] = out["original_median_wall_s"] / out["ours_median_wall_s"]
    return out


def _print(figures: dict, stamp: dict) -> None:
    v = stamp["versions"]
    print(f"\nPeers: traceml-ai {v['traceml-ai']}, torch {v['torch']} (CPU), nvidia-resiliency-ext "
          f"{v.get('nvidia-resiliency-ext', 'not installed')} ({NVRX_WANTED} listed: "
          f"{'installs' if stamp.get('nvrx_latest_installs') else 'no installable distribution here'}; "
          f"CPU sections {'run' if stamp.get('nvrx_cpu_sections') else 'do not run'}; its report needs CUDA)")
    print(f"{os.cpu_count()} cores, load avg {figures['load_avg_start']} -> {figures['load_avg_end']} "
          f"(a shared machine: read the ratios of one run)")
    if "training" in figures:
        t = figures["training"]
        print("\n~0.35 ms step: added training-thread CPU per step (median of per-round paired differences, "
              "bootstrap 95 % interval)")
        for r in t["small"]:
            lo, hi = r["added_cpu_us_ci95"]
            print(f"  {r['variant']:28s} {r['added_cpu_us']:+8.1f} us ({lo:+.1f} to {hi:+.1f}) "
                  f"on a {r['plain_step_ms']:.3f} ms step [{r['worker']}]")
        print("\n~10 ms step: throughput ratio (pooled, 95 % interval); training thread's added CPU + the tool's "
              "other threads' CPU per traced step (upper bound) -> CPU-accounted ratio; the helper process's "
              "(aggregator, processor) and the threads' CPU as a share of one core over the phase")
        for r in t["big"]:
            lo, hi = r["throughput_ratio_ci95"]
            print(f"  {r['variant']:28s} {r['throughput_ratio']:.4f} ({lo:.4f}-{hi:.4f}) on {r['plain_step_ms']:.2f} ms; "
                  f"thread {r['added_thread_cpu_us']:+7.1f} us, threads {r['background_cpu_us_per_step']:6.1f} us "
                  f"-> {r['cpu_accounted_ratio']:.4f}; threads {100 * r['threads_cpu_share_ratio']:.2f} %, "
                  f"helper {100 * r['helper_cpu_share_ratio']:.1f} % of a core")
        if t.get("background"):
            print("\n~10 ms step, each tool alone in place: its other threads in the training process and its helper "
                  "process as shares of one core (mean over 1 s blocks, 95 % interval), while its steps run back to "
                  "back and while it is idle; the other threads' CPU per step; their cost to the steps they land in "
                  "(steps with their work against their neighbours, +- standard error; control: the same estimator "
                  "where no work is near)")
            for r in t["background"]:
                def pct(key):
                    m, lo, hi = r[key]
                    return f"{100 * m:.3f} % [{100 * lo:.3f}, {100 * hi:.3f}]"
                print(f"  {r['variant']:16s} training: threads {pct('training_threads_cpu_share_ratio')}, helper "
                      f"{pct('training_helper_cpu_share_ratio')}; idle: threads {pct('idle_threads_cpu_share_ratio')}, helper "
                      f"{pct('idle_helper_cpu_share_ratio')}")
                print(f"  {'':16s} threads {r['threads_cpu_us_per_step']:.1f} us CPU per step; in place "
                      f"{r['in_place_us_per_step']:+.1f} +- {r['in_place_us_per_step_se']:.1f} us per step "
                      f"({r['in_place_runs']} runs, {100 * r['in_place_marked_ratio']:.1f} % of {r['steps']} steps "
                      f"of {r['step_ms']:.2f} ms; control {r['in_place_control_us_per_run']:+.0f} +- "
                      f"{r['in_place_control_us_per_run_se']:.0f} us per run)")
    if "analysis" in figures:
        print("\nAnalysis on the same data shape (400 steps/rank, 5 phases; live window 100, lookback 4), ms")
        print(f"{'ranks':>6} {'ours live':>10} {'orig live':>10} {'orig/ours':>9} {'ours summ':>10} {'orig summ':>10} "
              f"{'orig/ours':>9} {'ours rows/s':>12} {'orig rows/s':>12}")
        for r in figures["analysis"]:
            print(f"{r['ranks']:>6} {r['ours_live_ms']:10.2f} {r['original_live_ms']:10.2f} {r['live_ratio']:8.1f}x "
                  f"{r['ours_summary_ms']:10.1f} {r['original_summary_ms']:10.1f} {r['summary_ratio']:8.1f}x "
                  f"{r['ours_ingest_rows_per_s']:12,.0f} {r['original_ingest_rows_per_s']:12,.0f}")
    if "e2e" in figures:
        e = figures["e2e"]
        print(f"\n`traceml run --nproc-per-node 2`, balanced demo workload, {e['steps']} steps, {e['trials']} trial(s) "
              f"each, alternating: ours {e['ours_median_wall_s']:.1f} s, original {e['original_median_wall_s']:.1f} s "
              f"(original/ours {e['wall_ratio']:.2f}); rows stored per second of the run: ours "
              f"{e['ours_rows_per_s']:.1f}, original {e['original_rows_per_s']:.1f}")


PARTS = ("training", "analysis", "e2e")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and ranks (under 10 minutes here)")
    parser.add_argument("--parts", nargs="*", choices=PARTS, default=list(PARTS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=tuple(SHAPES), help=argparse.SUPPRESS)
    parser.add_argument("--analysis", help=argparse.SUPPRESS)
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.worker:
        _serve_training(args.worker, args.shape)
        return 0
    if args.analysis:
        _serve_analysis(args.analysis)
        return 0
    with table_output(args.json):
        def log(msg):
            print(msg, flush=True)
        stamp = build_peers(log)
        figures: dict = {"peers": stamp["versions"], "nvrx_cpu_sections": stamp.get("nvrx_cpu_sections", False),
                         "nvrx_latest_listed_installs": stamp.get("nvrx_latest_installs", False),
                         "cpu_count": os.cpu_count(), "load_avg_start": round(os.getloadavg()[0], 2)}
        started = time.monotonic()
        if "training" in args.parts:
            figures["training"] = measure_training(args.quick, stamp, log)
        if "analysis" in args.parts:
            figures.update(measure_analysis(args.quick, log))
        if "e2e" in args.parts:
            figures["e2e"] = measure_e2e(args.quick, log)
        figures["load_avg_end"] = round(os.getloadavg()[0], 2)
        figures["wall_s"] = time.monotonic() - started
        _print(figures, stamp)
        print(f"\n(took {figures['wall_s']:.0f} s)")
    if args.json:
        print_json("bench_peers", args, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
