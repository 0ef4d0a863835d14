"""What deep capture (issue 33) costs the training thread: nothing pending, and while it records.

Method. One process, bench_overhead's ~10 ms CPU job (`benchmarks.lib.workload.Job`, hidden 960)
in manual mode (`benchmarks.lib.traced_steps`, its five regions in `trace_step`), TraceML
initialised once, the same steadying of glibc's allocator and a frozen GC heap. The samplers'
threads are stopped and this thread drains them every `DRAIN_EVERY` steps inside every block,
every variant alike, so the records reach the exporter while the block that made them runs.

1. Nothing pending. Two live exporters (`OtlpStepExporter`, a transport that accepts at once, so
   the two differ in the control client only), one registered as the sink per block: "off"
   (no control endpoint), "on" (polling a control server in a child process that answers 204,
   so its work is not on this process's GIL) and "control" ("off" again: what the estimator
   reads when nothing is added). Each round runs one block per variant in a new seeded order
   (`benchmarks.lib.estimators.run_rounds`); the figure is the pooled block ratio off / on with
   its 95 % interval, and the added time per step. The poll interval here is `--poll-interval`
   (default 0.05 s, forty times the default 2 s, with a 50 ms export interval so rounds come
   that often), so the cost shows; the exporter thread's CPU per poll is timed around each poll,
   and the share at the default interval follows from it (one poll per 2 s of steps). On the
   training thread itself nothing differs: with no capture pending a step end reads one global
   (`step_events.step_end_hook`), whether a control endpoint is configured or not.
2. While a capture records. Blocks of "plain" steps against "captured" ones: a capture of K
   steps is armed (`deep_capture.arm`) before the block, its first untimed step's end starts
   the profiler, the K timed steps record, and the K-th step's end stops it. The figure is the
   added time per recorded step (the first K-1 steps: the K-th also holds the stop), the
   profiler's start and stop on the training thread (each read as its step's excess over the
   plain block's median), and, off the training thread, the builder's wall time (summary and
   gzip'd trace) and the trace's size. The builder is waited for outside the timed steps.

    .venv/bin/python -m benchmarks.bench_capture [--quick] [--json]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from benchmarks.lib import checkout  # noqa: E402,F401  (imports the checkout when not installed)
from benchmarks.lib.attribution import attributed, overlapping  # noqa: E402
from benchmarks.lib.estimators import (  # noqa: E402
    quartiles, ratio_interval, run_rounds, steady_allocator, wall_and_cpu)
from benchmarks.lib.json_output import add_json_flag, print_json, table_output  # noqa: E402
from benchmarks.lib.traced_steps import block_traced, drain_samplers, with_timed_loader  # noqa: E402
from benchmarks.lib.workload import Job  # noqa: E402
from harness.exporter_records import identity  # noqa: E402
import traceml  # noqa: E402
from traceml import deep_capture  # noqa: E402
from traceml.exporter import OtlpStepExporter, resolve_settings  # noqa: E402
from traceml.exporter.transport import ExportOutcome  # noqa: E402
from traceml.schema.capture import ROLE_CULPRIT, CaptureRequest  # noqa: E402

torch.set_num_threads(1)

DRAIN_EVERY = 5
DEFAULT_POLL_INTERVAL_S = 2.0
ATTRIBUTED_POLL_INTERVAL_S = 0.2  # about one poll per 15-20 steps: most have unaffected neighbours
_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(204); self.send_header("Content-Length", "0"); self.end_headers()
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_port, flush=True)
s.serve_forever()
"""


class _Accepting:
    """A transport that accepts every export at once: both exporters pay the same encoding."""

    def export(self, signal, request, deadline):
        return ExportOutcome(True)

    def close(self):
        pass


def _traced(job, steps: int, clock, out: list) -> None:
    """`steps` manual-mode steps, the samplers drained on this thread every DRAIN_EVERY steps."""
    done = 0
    while done < steps:
        n = min(DRAIN_EVERY, steps - done)
        block_traced(job, n, clock, out, "manual")
        drain_samplers()
        done += n


def _with_sink(job, exporter):
    def run(steps, clock, out, warmup=0):
        traceml.register_sink(exporter)
        try:
            if warmup:
                _traced(job, warmup, clock, [])
            _traced(job, steps, clock, out)
        finally:
            traceml.unregister_sink(exporter)
    return run


def _polls_attributed(job, exporter, poll_spans: list, seconds: float) -> dict:
    """One long run with the polling exporter as the sink: each step a poll overlaps (and the step
    after) against its two unaffected neighbours (`benchmarks.lib.attribution`), with its control."""
    stamps: list[float] = []

    def clock():
        now = time.perf_counter()
        stamps.append(now)
        return now

    poll_spans.clear()
    traceml.register_sink(exporter)
    gc.collect()
    gc.freeze()
    try:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            _traced(job, 50, clock, [])
    finally:
        gc.unfreeze()
        traceml.unregister_sink(exporter)
    spans = list(zip(stamps[0::2], stamps[1::2]))
    polls = [span for span in poll_spans if span[0] <= spans[-1][1]]
    found = attributed([end - start for start, end in spans], overlapping(spans, polls), after_steps=1)
    return {"attributed_steps": len(spans), "attributed_polls": len(polls),
            "per_poll_us": found["per_run"] * 1e6, "per_poll_us_se": found["per_run_se"] * 1e6,
            "per_poll_pairs": found["runs"], "control_per_poll_us": found["control_per_run"] * 1e6,
            "control_per_poll_us_se": found["control_per_run_se"] * 1e6}


def _nothing_pending(job, rounds: int, block: int, poll_interval_s: float, attributed_s: float) -> dict:
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{server.stdout.readline().strip()}"
        base = replace(resolve_settings("http://127.0.0.1:4317", "grpc", environ={}), export_interval_s=0.05)
        off = OtlpStepExporter(identity("bench-capture-off"), base, instrumentation_drops=lambda: {},
                               transport=_Accepting())
        on = OtlpStepExporter(identity("bench-capture-on"),
                              replace(base, control_endpoints=(url,), control_poll_interval_s=poll_interval_s),
                              instrumentation_drops=lambda: {}, transport=_Accepting())
        client = on._control
        poll_cpu = [0.0]
        poll_spans: list = []
        poll = client._poll

        def timed_poll(u):  # the exporter thread's CPU per poll (its own thread_time) and its span
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return poll(u)
            finally:
                poll_cpu[0] += time.thread_time() - c0
                poll_spans.append((w0, time.perf_counter()))
        client._poll = timed_poll
        variants = {"off": _with_sink(job, off), "on": _with_sink(job, on), "control": _with_sink(job, off)}
        for run in variants.values():
            run(DRAIN_EVERY, time.perf_counter, [])
        gc.collect()
        gc.freeze()
        try:
            per_round = run_rounds(rounds, block, wall_and_cpu, variants)
        finally:
            gc.unfreeze()
        stats = client.stats()
        client._interval_s = ATTRIBUTED_POLL_INTERVAL_S
        attributed_figures = _polls_attributed(job, on, poll_spans, attributed_s) if attributed_s else {}
        off.shutdown(5.0)
        on.shutdown(5.0)
    finally:
        server.kill()
        server.wait()
    cpu_blocks = {name: [sum(t.imag for t in steps) for steps in per] for name, per in per_round.items()}
    blocks = {name: [sum(t.real for t in steps) for steps in per] for name, per in per_round.items()}
    out = {"rounds": rounds, "steps_per_block": block, "poll_interval_s": poll_interval_s,
           "step_ms": statistics.fmean(blocks["off"]) / block * 1e3, "polls": stats.polls,
           "poll_failures": stats.poll_failures}
    for name in ("on", "control"):
        ratio, lo, hi = ratio_interval(blocks["off"], blocks[name])
        added = [(b - o) / block * 1e6 for b, o in zip(blocks[name], blocks["off"])]
        out[f"ratio_{name}"] = ratio
        out[f"ratio_{name}_ci95"] = (lo, hi)
        out[f"added_us_per_step_{name}"] = statistics.fmean(added)
        out[f"added_us_per_step_{name}_se"] = statistics.stdev(added) / len(added) ** 0.5
        cpu = sorted((b - o) / block * 1e6 for b, o in zip(cpu_blocks[name], cpu_blocks["off"]))
        out[f"added_cpu_us_per_step_{name}"] = statistics.median(cpu)
        out[f"added_cpu_us_per_step_{name}_iqr"] = quartiles(cpu)
    on_steps = rounds * block
    out["polls_per_step"] = stats.polls / on_steps
    out["poll_thread_cpu_us"] = poll_cpu[0] / max(1, stats.polls + stats.poll_failures) * 1e6
    # At the default interval: one poll per DEFAULT_POLL_INTERVAL_S of steps.
    out["default_interval_share"] = out["poll_thread_cpu_us"] / 1e6 / DEFAULT_POLL_INTERVAL_S
    scale = (out["step_ms"] / 1e3 / DEFAULT_POLL_INTERVAL_S) / max(out["polls_per_step"], 1e-9)
    out["added_us_per_step_at_default"] = out["added_us_per_step_on"] * scale
    out.update(attributed_figures)
    if attributed_figures:
        # At the default interval a poll lands once per DEFAULT_POLL_INTERVAL_S of steps.
        out["attributed_us_per_step_at_default"] = (out["per_poll_us"] * out["step_ms"] / 1e3
                                                    / DEFAULT_POLL_INTERVAL_S)
    return out


def _while_recording(job, rounds: int, steps: int) -> dict:
    results = {"capture_steps": steps}
    delivered: list = []
    builds: list = []

    def plain(n, clock, out, warmup=0):
        _traced(job, 1 + n, clock, out)

    def captured(n, clock, out, warmup=0):
        request = CaptureRequest(capture_id=f"bench{len(delivered)}", run_id="bench-capture", rank=0,
                                 role=ROLE_CULPRIT, steps=n, max_trace_bytes=64 << 20)
        stopped = [0.0]

        def deliver(result):
            builds.append(time.perf_counter() - stopped[0])
            delivered.append(result)
        reason = deep_capture.arm(request, deliver)
        assert reason is None, reason
        _traced(job, 1 + n, clock, out)  # the first step's end starts the profiler
        stopped[0] = time.perf_counter()
        while deep_capture.busy():  # the builder, outside the timed steps
            time.sleep(0.005)

    per_round = run_rounds(rounds, steps, wall_and_cpu, {"plain": plain, "captured": captured})
    med = statistics.median
    added, added_cpu, starts, stops, base, recorded = [], [], [], [], [], []
    for p, c in zip(per_round["plain"], per_round["captured"]):
        ref = med(t.real for t in p[1:])  # the plain block's own first step is its warm-up twin
        ref_cpu = med(t.imag for t in p[1:])
        added.extend((t.real - ref) * 1e3 for t in c[1:-1])
        added_cpu.extend((t.imag - ref_cpu) * 1e3 for t in c[1:-1])
        starts.append((c[0].imag - ref_cpu) * 1e3)
        stops.append((c[-1].imag - ref_cpu) * 1e3)
        base.extend(t.real for t in p[1:-1])
        recorded.extend(t.real for t in c[1:-1])
    ratio, lo, hi = ratio_interval(base, recorded) if len(base) == len(recorded) else (None, None, None)
    summaries = [r.summary for r in delivered if r.summary is not None]
    results.update(
        rounds=rounds, captures=len(delivered), failures=sum(1 for r in delivered if r.failure),
        added_ms_per_recorded_step=med(added), added_ms_per_recorded_step_iqr=quartiles(sorted(added)),
        added_cpu_ms_per_recorded_step=med(added_cpu),
        added_cpu_ms_per_recorded_step_iqr=quartiles(sorted(added_cpu)),
        plain_step_cpu_ms=med(t.imag for p in per_round["plain"] for t in p[1:]) * 1e3,
        recorded_step_ratio=ratio, recorded_step_ratio_ci95=(lo, hi),
        plain_step_ms=med(base) * 1e3, start_ms=med(starts), stop_ms=med(stops),
        build_s=med(builds) if builds else None,
        trace_bytes_per_step=med(s.trace_bytes / steps for s in summaries if s.trace_bytes) if summaries else None,
        summary_ops=med(len(s.ops) for s in summaries) if summaries else None)
    return results


def measure(quick: bool, rounds: int | None, poll_interval_s: float, capture_rounds: int | None,
            attributed_s: float | None = None) -> dict:
    results: dict = {"cpu_count": os.cpu_count(), "torch": torch.__version__,
                     "load_avg_start": round(os.getloadavg()[0], 2), "steady_allocator": steady_allocator()}
    traceml.init(mode="manual")
    for sampler in (traceml._time_sampler, traceml._memory_sampler):
        sampler.stop()  # drained by this thread inside the blocks (see the module docstring)
    try:
        job = with_timed_loader(Job(960, 128, 32))
        if attributed_s is None:
            attributed_s = 5.0 if quick else 60.0
        results["nothing_pending"] = _nothing_pending(job, rounds or (12 if quick else 100), 20, poll_interval_s,
                                                      attributed_s)
        results["recording"] = _while_recording(job, capture_rounds or (6 if quick else 60), 5)
    finally:
        traceml.shutdown(timeout_s=5)
    results["load_avg_end"] = round(os.getloadavg()[0], 2)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--rounds", type=int, help="nothing-pending rounds of 20 steps per variant (default 100)")
    parser.add_argument("--poll-interval", type=float, default=0.05,
                        help="the control client's poll interval in the nothing-pending phase (default 0.05 s)")
    parser.add_argument("--capture-rounds", type=int, help="captures of 5 steps against plain blocks (default 60)")
    parser.add_argument("--attributed-seconds", type=float,
                        help=f"seconds of steps beside polls every {ATTRIBUTED_POLL_INTERVAL_S} s, each poll read "
                             "from the steps it lands in (default 60, 5 with --quick; 0 skips it)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    with table_output(args.json):
        r = measure(args.quick, args.rounds, args.poll_interval, args.capture_rounds, args.attributed_seconds)
        _print_table(r)
    if args.json:
        print_json("bench_capture", args, r)
    return 0


def _print_table(r: dict) -> None:
    n, c = r["nothing_pending"], r["recording"]
    print(f"Deep capture on the training thread (torch {r['torch']}, {r['cpu_count']} cores, load avg "
          f"{r['load_avg_start']} -> {r['load_avg_end']}; manual mode, ~{n['step_ms']:.1f} ms CPU step)")
    print(f"  nothing pending, control client polling every {n['poll_interval_s']} s "
          f"({n['polls']} polls, {n['polls_per_step']:.3f} per step) against none, "
          f"{n['rounds']} rounds of {n['steps_per_block']} steps:")
    for name in ("on", "control"):
        lo, hi = n[f"ratio_{name}_ci95"]
        q1, q3 = n[f"added_cpu_us_per_step_{name}_iqr"]
        print(f"    {name:8s} training-thread CPU {n[f'added_cpu_us_per_step_{name}']:+.1f} us per step "
              f"(IQR {q1:+.1f} to {q3:+.1f}); throughput {n[f'ratio_{name}']:.4f} ({lo:.4f}-{hi:.4f}), "
              f"{n[f'added_us_per_step_{name}']:+.1f} +- {n[f'added_us_per_step_{name}_se']:.1f} us per step")
    if "per_poll_us" in n:
        print(f"    one poll read from the steps it lands in ({n['attributed_polls']} polls every "
              f"{ATTRIBUTED_POLL_INTERVAL_S} s, {n['per_poll_pairs']} paired): {n['per_poll_us']:+.1f} +- "
              f"{n['per_poll_us_se']:.1f} us (control {n['control_per_poll_us']:+.1f} +- "
              f"{n['control_per_poll_us_se']:.1f}); at the default {DEFAULT_POLL_INTERVAL_S:.0f} s: "
              f"{n['attributed_us_per_step_at_default']:+.2f} us per step")
    print(f"    exporter thread CPU per poll {n['poll_thread_cpu_us']:.0f} us: at the default "
          f"{DEFAULT_POLL_INTERVAL_S:.0f} s, {n['default_interval_share'] * 100:.3f} % of a core, "
          f"{n['added_us_per_step_at_default']:+.2f} us per step scaled from the figure above")
    lo, hi = c["recorded_step_ratio_ci95"]
    q1, q3 = c["added_cpu_ms_per_recorded_step_iqr"]
    w1, w3 = c["added_ms_per_recorded_step_iqr"]
    print(f"  while a capture records ({c['captures']} captures of {c['capture_steps']} steps, "
          f"{c['failures']} failed): training-thread CPU {c['added_cpu_ms_per_recorded_step']:+.3f} ms "
          f"(IQR {q1:+.3f} to {q3:+.3f}) per recorded step on a {c['plain_step_cpu_ms']:.2f} ms CPU step; "
          f"wall {c['added_ms_per_recorded_step']:+.3f} ms (IQR {w1:+.3f} to {w3:+.3f}) per recorded step on a "
          f"{c['plain_step_ms']:.2f} ms step (throughput {c['recorded_step_ratio']:.4f}, {lo:.4f}-{hi:.4f})")
    print(f"    profiler start {c['start_ms']:.1f} ms / stop {c['stop_ms']:.1f} ms CPU on the training thread; "
          f"builder {c['build_s']:.2f} s off it; trace {c['trace_bytes_per_step'] or 0:.0f} bytes gzip'd per step, "
          f"{c['summary_ops']} entries")


if __name__ == "__main__":
    sys.exit(main())
