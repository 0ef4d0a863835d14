"""traceml-processor ingest, freshness and memory, against a real processor process.

    .venv/bin/python -m benchmarks.bench_ingest            # everything (about 2-3 minutes)
    .venv/bin/python -m benchmarks.bench_ingest --quick    # shorter runs
    .venv/bin/python -m benchmarks.bench_ingest --json     # the figures as one JSON object
    .venv/bin/python -m benchmarks.bench_ingest --baseline-ref d3d0d60 --batch-sizes 2048 512
        # only: OTLP/gRPC ingest of that git ref vs the working tree, alternating, same run
    .venv/bin/python -m benchmarks.bench_ingest --baseline-ref 13a4bdd --transport http --batch-sizes 64 512
        # the same over OTLP/HTTP (keep-alive connections), e.g. across the HTTP front change
    .venv/bin/python -m benchmarks.bench_ingest --baseline-ref fd60ee5 --baseline-wire --batch-sizes 64 512
        # a ref from before the OpenTelemetry names (2026-12-01): it is sent its own wire format
    .venv/bin/python -m benchmarks.bench_ingest --idle-flood 2000 --baseline-ref 13a4bdd
        # only: 2,000 idle connections to the HTTP port, that ref then this tree

What is measured (the processor is the real CLI in its own process; senders are
threads in this process sending pre-serialised OTLP requests, so client-side
protobuf encoding does not count against the processor):

1. Baseline in the same run: `StepTimeStore.write` alone (no network, no decode)
   on the same records, in this process.
2. Sustained OTLP/gRPC ingest with acknowledgement after commit: spans/s over
   `--seconds`, per batch size (spans per request), 1,000 ranks x 20 steps per
   replica pattern (each request = consecutive steps of one rank). The row count
   in SQLite afterwards must equal the spans acknowledged.
3. The same over OTLP/HTTP (protobuf, keep-alive connections).
4. Freshness: wall time from a step's end (span end time = send time) to the
   first `/metrics` scrape whose `traceml_window_last_step` shows that step.
5. RSS of the processor with 1,024 ranks in one run (peak while ingesting and
   analysing a 100-step live window).
"""
from __future__ import annotations

import argparse
import http.client
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from benchmarks.lib.ingest_load import TRACE_METHOD, Processor, build_requests, grpc_sender, http_sender, sustained
from benchmarks.lib.json_output import add_json_flag, print_json, table_output
from harness.otlp_payloads import step_span, trace_request

ROOT = Path(__file__).resolve().parents[1]

TARGET_SPANS_PER_S = 20_000


def baseline_store_rate(folder: Path, n: int = 20_000) -> float:
    """StepTimeStore.write alone on decoded records (same process, no network)."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb

    from traceml.processor.decode import Decoder
    from traceml.processor.sqlite_writer import StepTimeStore

    decoder = Decoder()
    records = []
    for raw in build_requests("baseline", 1000, 500, n):
        records.extend(decoder.decode_traces(pb.ExportTraceServiceRequest.FromString(raw)).step_records)
    store = StepTimeStore(folder / "baseline.db")
    started = time.perf_counter()
    for i in range(0, len(records), 500):
        store.write(records[i:i + 500])
    elapsed = time.perf_counter() - started
    store.close()
    return len(records) / elapsed


def decode_rate(n: int = 20_000) -> float:
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb

    from traceml.processor.decode import Decoder

    raws = build_requests("decode", 1000, 500, n)
    decoder = Decoder()
    started = time.perf_counter()
    for raw in raws:
        decoder.decode_traces(pb.ExportTraceServiceRequest.FromString(raw))
    return n / (time.perf_counter() - started)


def bench_throughput(folder: Path, args) -> dict:
    results: dict = {}
    for batch in args.batch_sizes:
        # Enough for 35,000 spans/s over the whole period; fewer only if the processor is faster.
        requests = build_requests("bench", args.ranks, batch, int(args.seconds * 35_000))
        for workers in args.workers:
            for transport in ("grpc", "http"):
                proc = Processor(folder / f"{transport}-{batch}-{workers}", workers=workers)
                try:
                    sender = grpc_sender(proc.grpc) if transport == "grpc" else http_sender(proc.http)
                    cpu_before = proc.cpu_s()
                    rate, acked = sustained(sender, requests, batch, args.seconds, args.threads)
                    per_cpu_s = acked / max(1e-9, proc.cpu_s() - cpu_before)
                    rows = proc.rows()
                    assert rows == acked, f"{rows} rows stored but {acked} spans acknowledged"
                    results.setdefault(transport, {}).setdefault(workers, {})[batch] = {
                        "spans_per_s": round(rate), "acked": acked,
                        "spans_per_processor_cpu_s": round(per_cpu_s), "rss_mib": round(proc.rss_mib(), 1)}
                    print(f"  {transport:4s} workers {workers} batch {batch:5d}: {rate:9,.0f} spans/s wall "
                          f"({acked:,} acked = rows in SQLite); {per_cpu_s:,.0f} spans per processor CPU-second",
                          flush=True)
                finally:
                    proc.stop()
    return results


def extract_ref(ref: str, folder: Path) -> Path:
    """`git archive REF` laid out as an importable `traceml` package under `folder`; returns `folder`.

    The layout is setup.py's PACKAGE_ROOTS (`traceml` is instrumentation/, `traceml.processor`
    is processor/, ...): a plain copy of the repository would be a namespace portion, which loses
    to the installed package, and the "before" figures would silently be this tree's.
    """
    source = folder / "source"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    roots = {"traceml": "instrumentation", "traceml.exporter": "exporter", "traceml.processor": "processor",
             "traceml.schema": "schema", "traceml.launcher": "launcher"}
    for package, subdir in roots.items():
        target = folder.joinpath(*package.split("."))
        target.parent.mkdir(parents=True, exist_ok=True)
        if (source / subdir).is_dir():
            target.symlink_to(source / subdir, target_is_directory=True)
    return folder


_BASELINE_BUILD = """
import pickle, sys, time
import otlp_payloads as p
ranks, batch, total, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
requests, rank, sent, step_of, base = [], 0, 0, [0] * ranks, time.time()
while sent < total:
    first = step_of[rank]
    spans = [p.step_span(first + i, rank, end_s=base + (first + i) * 0.05) for i in range(batch)]
    requests.append(p.trace_request("ab", rank, spans, world_size=1000).SerializeToString())
    step_of[rank] += batch
    sent += batch
    rank = (rank + 1) % ranks
with open(out, "wb") as f:
    pickle.dump(requests, f)
"""


def baseline_requests(old_root: Path, ranks: int, batch: int, total: int, folder: Path) -> list[bytes]:
    """`build_requests`' shape in the baseline's own wire format (`--baseline-wire`): its payload
    builder (harness/ or tests/processor/otlp_payloads.py of the tree `extract_ref` laid out)
    run in a child on the baseline's code, for trees whose decoder refuses today's names."""
    import pickle

    source = old_root / "source"
    builders = [d for d in (source / "harness", source / "tests" / "processor") if (d / "otlp_payloads.py").exists()]
    if not builders:
        raise SystemExit(f"--baseline-wire: no otlp_payloads.py under {source}/harness or tests/processor")
    out = folder / f"baseline-requests-{batch}.pickle"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(old_root), str(builders[0]), str(source)])}
    subprocess.run([sys.executable, "-c", _BASELINE_BUILD, str(ranks), str(batch), str(total), str(out)],
                   check=True, env=env, cwd=folder)
    with open(out, "rb") as f:
        return pickle.load(f)


def bench_before_after(folder: Path, args) -> dict:
    """Same requests, same run: the processor at `--baseline-ref` and this tree, alternating
    (one process; OTLP/gRPC, or OTLP/HTTP with `--transport http`), so machine load hits both alike."""
    old_root = (Path(args.baseline_root) if args.baseline_root
                else extract_ref(args.baseline_ref, folder / "baseline-code"))
    out: dict = {}
    for batch in args.batch_sizes:
        requests = build_requests("ab", args.ranks, batch, int(args.seconds * 35_000))
        old_requests = (baseline_requests(old_root, args.ranks, batch, int(args.seconds * 35_000), folder)
                        if args.baseline_wire else requests)
        for round_ in range(args.rounds):
            for label, root in ((args.baseline_ref, old_root), ("this tree", None)):
                sent = old_requests if root is not None else requests
                proc = Processor(folder / f"ab-{batch}-{round_}-{root is None}", code_root=root)
                try:
                    cpu_before = proc.cpu_s()
                    sender = grpc_sender(proc.grpc) if args.transport == "grpc" else http_sender(proc.http)
                    rate, acked = sustained(sender, sent, batch, args.seconds, args.threads)
                    per_cpu_s = acked / max(1e-9, proc.cpu_s() - cpu_before)
                    assert proc.rows() == acked, "rows stored != spans acknowledged"
                finally:
                    proc.stop()
                entry = out.setdefault(label, {}).setdefault(batch, {"spans_per_s": [], "per_cpu_s": []})
                entry["spans_per_s"].append(round(rate))
                entry["per_cpu_s"].append(round(per_cpu_s))
                print(f"  {label:>12s} {args.transport} batch {batch:5d} round {round_}: {rate:9,.0f} spans/s wall, "
                      f"{per_cpu_s:,.0f} spans per processor CPU-second", flush=True)
        old, new = out[args.baseline_ref][batch], out["this tree"][batch]
        print(f"  batch {batch}: this tree / {args.baseline_ref}: wall {statistics.median(new['spans_per_s']) / statistics.median(old['spans_per_s']):.2f}x, "
              f"per CPU-second {statistics.median(new['per_cpu_s']) / statistics.median(old['per_cpu_s']):.2f}x (medians)", flush=True)
    return out


def bench_idle_flood(folder: Path, args) -> dict:
    """What `--idle-flood N` idle connections to the HTTP port cost, and whether real clients are still served.

    Per version (`--baseline-ref` and this tree, when given; else this tree): the processor's
    threads and RSS with the flood held open, then one OTLP/HTTP and one OTLP/gRPC export with
    a 10 s deadline (served or not, and how long it took), then the processor's CPU-seconds
    over 3 idle seconds with the flood still open.
    """
    import socket

    versions = [("this tree", None)]
    if args.baseline_ref:
        versions.insert(0, (args.baseline_ref, Path(args.baseline_root) if args.baseline_root
                            else extract_ref(args.baseline_ref, folder / "flood-code")))
    body = trace_request("flood", 0, [step_span(0, 0)]).SerializeToString()
    out: dict = {}
    for label, root in versions:
        proc = Processor(folder / f"flood-{root is None}", code_root=root)
        socks = []
        try:
            base_threads, base_rss = proc.ps.num_threads(), proc.rss_mib()
            for _ in range(args.idle_flood):
                try:
                    socks.append(socket.create_connection(("127.0.0.1", proc.http), timeout=2))
                except OSError:
                    break
            time.sleep(2.0)
            entry = {"connections": len(socks), "threads_before": base_threads, "threads": proc.ps.num_threads(),
                     "rss_before_mib": round(base_rss, 1), "rss_mib": round(proc.rss_mib(), 1)}
            for transport in ("http", "grpc"):
                started = time.perf_counter()
                try:
                    if transport == "http":
                        conn = http.client.HTTPConnection("127.0.0.1", proc.http, timeout=10)
                        conn.request("POST", "/v1/traces", body=body, headers={"Content-Type": "application/x-protobuf"})
                        served = conn.getresponse().status == 200
                        conn.close()
                    else:
                        with grpc.insecure_channel(f"127.0.0.1:{proc.grpc}") as channel:
                            channel.unary_unary(TRACE_METHOD)(body, timeout=10)
                        served = True
                except (OSError, http.client.HTTPException, grpc.RpcError):
                    served = False
                entry[f"{transport}_served"] = served
                entry[f"{transport}_s"] = round(time.perf_counter() - started, 3)
            cpu_before = proc.cpu_s()
            time.sleep(3.0)
            entry["idle_cpu_s_per_3s"] = round(proc.cpu_s() - cpu_before, 2)
        finally:
            for sock in socks:
                sock.close()
            proc.stop()
        out[label] = entry
        print(f"  {label:>12s}: {entry['connections']} idle connections: threads {entry['threads_before']} -> "
              f"{entry['threads']}, RSS {entry['rss_before_mib']} -> {entry['rss_mib']} MiB; a real export served: "
              f"HTTP {entry['http_served']} ({entry['http_s']} s), gRPC {entry['grpc_served']} ({entry['grpc_s']} s); "
              f"{entry['idle_cpu_s_per_3s']} CPU-s over 3 idle s", flush=True)
    return out


def bench_freshness(folder: Path, samples: int, refresh_s: float, transport: str = "grpc") -> dict:
    """Step end -> `/metrics`, each step sent over `transport` (grpc, or http: what a one-node
    `traceml run`'s ranks use)."""
    proc = Processor(folder / f"freshness-{transport}", refresh_s=refresh_s)
    channel = grpc.insecure_channel(f"127.0.0.1:{proc.grpc}") if transport == "grpc" else None
    if channel is not None:
        call = channel.unary_unary(TRACE_METHOD)
        send = lambda body: call(body, timeout=10)  # noqa: E731
    else:
        send = http_sender(proc.http)()
    lags = []
    try:
        for step in range(samples + 2):
            end = time.time()
            for rank in range(2):
                send(trace_request("fresh", rank, [step_span(step, rank, end_s=end)]).SerializeToString())
            pattern = re.compile(r'traceml_window_last_step\{traceml_run_id="fresh"\} (\d+)')
            while True:
                match = pattern.search(proc.scrape())
                if match and int(match.group(1)) >= step:
                    break
                time.sleep(0.01)
            if step >= 2:  # the first refreshes open the session
                lags.append(time.time() - end)
    finally:
        if channel is not None:
            channel.close()
        proc.stop()
    return {"transport": transport, "refresh_s": refresh_s, "median_s": round(statistics.median(lags), 3),
            "max_s": round(max(lags), 3), "samples": len(lags)}


def bench_memory(folder: Path, ranks: int, steps: int) -> dict:
    proc = Processor(folder / "memory", refresh_s=0.5)
    peak = [proc.rss_mib()]
    stop = threading.Event()

    def watch():
        while not stop.wait(0.1):
            peak[0] = max(peak[0], proc.rss_mib())

    watcher = threading.Thread(target=watch)
    watcher.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{proc.grpc}", options=[("grpc.max_send_message_length", 64 << 20)])
    call = channel.unary_unary(TRACE_METHOD)
    try:
        chunk = 20
        base = time.time()
        for first in range(0, steps, chunk):
            for rank in range(ranks):
                spans = [step_span(s, rank, end_s=base + s * 0.05) for s in range(first, min(steps, first + chunk))]
                while True:
                    try:
                        call(trace_request("mem-run", rank, spans, world_size=ranks).SerializeToString(), timeout=60)
                        break
                    except grpc.RpcError as exc:
                        if exc.code() != grpc.StatusCode.UNAVAILABLE:
                            raise
                        time.sleep(0.05)
        pattern = re.compile(r'traceml_window_ranks\{traceml_run_id="mem-run"\} (\d+)')
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            match = pattern.search(proc.scrape())
            if match and int(match.group(1)) == ranks and f'traceml_window_last_step{{traceml_run_id="mem-run"}} {steps - 1}' in proc.scrape():
                break
            time.sleep(0.5)
        time.sleep(2.0)  # a few more refreshes and scrapes at full size
        proc.scrape()
        rows = proc.rows()
    finally:
        stop.set()
        watcher.join()
        channel.close()
        final = proc.rss_mib()
        proc.stop()
    return {"ranks": ranks, "steps": steps, "rows": rows, "peak_rss_mib": round(peak[0], 1),
            "final_rss_mib": round(final, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="processor --workers values to compare")
    p.add_argument("--ranks", type=int, default=1000)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 512, 2048])
    p.add_argument("--memory-ranks", type=int, default=1024)
    p.add_argument("--memory-steps", type=int, default=120)
    add_json_flag(p)
    p.add_argument("--baseline-ref", help="only compare ingest (--transport) of this git ref with the working "
                                          "tree, in the same run (e.g. d3d0d60, before the ingest speed-ups)")
    p.add_argument("--baseline-root", metavar="DIR",
                   help="like --baseline-ref, with the baseline code already laid out as DIR/traceml (e.g. this "
                        "tree with one module swapped back, when the wire format moved on since the ref)")
    p.add_argument("--baseline-wire", action="store_true",
                   help="with --baseline-ref: send the baseline its own wire format, built by its own payload "
                        "module (for refs before the OpenTelemetry names of 2026-12-01, e.g. fd60ee5)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per version with --baseline-ref")
    p.add_argument("--idle-flood", type=int, metavar="N",
                   help="only: hold N idle connections to the HTTP port and report threads, RSS, idle CPU and "
                        "whether real exports are served (with --baseline-ref: that ref, then this tree)")
    p.add_argument("--transport", choices=("grpc", "http"), default="grpc",
                   help="the OTLP transport --baseline-ref compares (default grpc)")
    args = p.parse_args()
    with table_output(args.json):
        figures = measure(args)
    if args.json:
        print_json("bench_ingest", args, figures)


def measure(args) -> dict:
    if args.baseline_root and not args.baseline_ref:
        args.baseline_ref = "baseline"
    if args.idle_flood:
        print(f"bench_ingest idle flood: {args.idle_flood} connections; load average {os.getloadavg()[0]:.1f}")
        with tempfile.TemporaryDirectory() as tmp:
            return {"idle_flood": bench_idle_flood(Path(tmp), args)}
    if args.baseline_ref:
        print(f"bench_ingest before/after: {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} at start")
        with tempfile.TemporaryDirectory() as tmp:
            before_after = bench_before_after(Path(tmp), args)
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
        return {"before_after": before_after}
    if args.quick:
        args.seconds, args.batch_sizes, args.memory_steps = 4.0, [64, 512], 110
    print(f"bench_ingest: {os.cpu_count()} CPUs; figures are under whatever else runs on this machine")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        start = Processor(folder / "start")
        start_s = start.start_s
        start.stop()
        print(f"processor start (spawn -> /readyz 200): {start_s:.2f} s")
        dec = decode_rate()
        base = baseline_store_rate(folder)
        print(f"baseline, same run: decode alone {dec:,.0f} spans/s; StepTimeStore.write alone {base:,.0f} rows/s")
        results = bench_throughput(folder, args)
        best = max(r["spans_per_s"] for per_batch in results["grpc"].values() for r in per_batch.values())
        print(f"best OTLP/gRPC: {best:,} spans/s = {best / TARGET_SPANS_PER_S:.2f}x the 20,000 target, "
              f"{best / base:.2f}x the store-only baseline")
        fresh = {transport: bench_freshness(folder / "freshness", 10, 0.5, transport) for transport in ("grpc", "http")}
        for transport, figures in fresh.items():
            print(f"freshness over {transport} (refresh 0.5 s): median {figures['median_s']} s, max "
                  f"{figures['max_s']} s over {figures['samples']} steps")
        mem = bench_memory(folder / "memory", args.memory_ranks, args.memory_steps)
        print(f"memory: {mem['ranks']} ranks x {mem['steps']} steps ({mem['rows']:,} rows): "
              f"peak RSS {mem['peak_rss_mib']} MiB, final {mem['final_rss_mib']} MiB (bound 500 MiB)")
    return {"start_s": start_s, "decode_spans_per_s": dec, "store_rows_per_s": base,
            "throughput": results, "freshness": fresh, "memory": mem}


if __name__ == "__main__":
    main()
