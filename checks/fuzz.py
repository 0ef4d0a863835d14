"""Bad-input fuzzing, long version: many generated OTLP requests against one real processor.

    .venv/bin/python -m checks.fuzz                     # 100,000 requests (~8-10 min here)
    .venv/bin/python -m checks.fuzz --requests 20000    # shorter
    .venv/bin/python -m checks.fuzz --seed 7            # another stream

The CI version is tests/reliability/test_bad_input_fuzz.py (hypothesis, ~10,000
requests). This one draws the same request shapes from a seeded generator (the
same documented defects, hostile run ids, duplicate spans, huge steps, foreign
telemetry, undecodable and truncated bodies, bad gzip, wrong content types and
paths) so it can run far longer; every answer is checked against the documented
one, and at the end SQLite must hold exactly the valid records. It prints
requests per transport, records refused, mismatches (must be 0), rows stored vs
expected, and the cost per request per transport. It also measures the HTTP
receiver's per-answer stall (Nagle + delayed ACK on answers with a body) with
and without the client acknowledging at once.
"""
from __future__ import annotations

import argparse
import gzip
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc

from harness import ProcessorProcess
from harness.stored_rows import integrity_ok, stored_memory_keys, stored_step_keys
from harness.reliability import fuzz_cases as fc
from harness.reliability import reliability_helpers as h
from traceml.schema import vocabulary as v


def group(rng: random.Random) -> fc.GroupSpec:
    return fc.GroupSpec(
        run=rng.randrange(len(fc.RUN_POOL)), rank=rng.randrange(32),
        resource_defect=rng.choice([None] * 3 + sorted(fc.RESOURCE_MUTATIONS)), alias=rng.random() < 0.5,
        valid=rng.randrange(4), huge_valid_step=rng.random() < 0.3,
        defects=tuple(rng.choice(sorted(fc.SPAN_MUTATIONS)) for _ in range(rng.randrange(4))),
        foreign=rng.randrange(3), phase=rng.randrange(2), duplicate=rng.random() < 0.3)


def memory(rng: random.Random) -> fc.MemorySpec:
    return fc.MemorySpec(
        run=rng.randrange(len(fc.RUN_POOL)), rank=rng.randrange(32), valid=rng.randrange(4),
        defects=tuple(rng.choice(fc.MEMORY_MUTATIONS) for _ in range(rng.randrange(4))),
        histogram_points=rng.randrange(3), foreign_metric=rng.random() < 0.5,
        drop_queue=rng.choice([None, *v.QUEUE_NAMES, "bogus-queue"]))


def one(rng: random.Random, client: fc.OtlpClient, kind: str, transport: str, mismatches: Counter) -> None:
    ok = grpc.StatusCode.OK if transport == "grpc" else 200
    try:
        if kind in ("traces", "metrics"):
            path = fc.TRACES if kind == "traces" else fc.METRICS
            if kind == "traces":
                request, expected = fc.build_trace_request([group(rng) for _ in range(rng.randrange(1, 4))],
                                                           client.ledger)
            else:
                request, expected = fc.build_metrics_request(memory(rng), client.ledger)
            answer = (client.grpc(path, request) if transport == "grpc"
                      else client.http(path, request, rng.choice(fc.HTTP_VARIANTS)))
            fc.check_answer(answer, expected, ok)
            client.ledger.expect(expected)
        elif kind == "bytes":
            path = rng.choice([fc.TRACES, fc.METRICS])
            if rng.random() < 0.5:
                body = rng.randbytes(rng.randrange(400))
            else:
                steps = [client.ledger.step("fuzz-truncated", 0) for _ in range(3)]
                body = h.steps_request("fuzz-truncated", 0, steps).SerializeToString()
                body = body[:rng.randrange(len(body))]
            parses = fc.decodes(path, body)
            if transport == "grpc":
                answer = client.grpc_bytes(path, body)
                want = {grpc.StatusCode.OK} if parses else {grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT}
            else:
                answer = client.http_raw(path, body)
                want = {200 if parses else 400}
            assert answer.status in want, answer
        else:  # HTTP envelope faults
            fault = rng.choice(["bad_gzip", "truncated_gzip", "content_type", "encoding", "path"])
            valid = h.steps_request("fuzz-envelope", 0, [1]).SerializeToString()
            if fault == "bad_gzip":
                answer, want = client.http_raw(fc.TRACES, b"\x1f\x8b\x08\x00" + rng.randbytes(50),
                                               headers={"Content-Encoding": "gzip"}), 400
            elif fault == "truncated_gzip":
                body = gzip.compress(valid)
                answer, want = client.http_raw(fc.TRACES, body[:rng.randrange(1, len(body) - 1)],
                                               headers={"Content-Encoding": "gzip"}), 400
            elif fault == "content_type":
                answer, want = client.http_raw(fc.TRACES, b"", rng.choice(["text/plain", "", "application/xml"])), 415
            elif fault == "encoding":
                answer, want = client.http_raw(fc.TRACES, valid, headers={"Content-Encoding": "br"}), 415
            else:
                answer, want = client.http_raw(rng.choice(["/v1/logs", "/", "/x"]), b""), 404
            assert answer.status == want, answer
    except AssertionError as exc:
        mismatches[f"{kind}/{transport}: {str(exc)[:160]}"] += 1


def nagle_probe(http_port: int, grpc_port: int, n: int = 100) -> dict:
    """ms per HTTP request whose answer has a body (partial success), without and with quick ACKs."""
    out = {}
    for quickack in (False, True):
        client = fc.OtlpClient(grpc_port, http_port, quickack=quickack)
        request = h.trace_request([h.resource_spans(h.resource_attrs("nagle", 0), [
            h.step_span("nagle", 0, 1, attrs={v.ATTR_RANK: 0})])])  # rejected: missing step
        t0 = time.perf_counter()
        for _ in range(n):
            assert client.http(fc.TRACES, request).rejected == 1
        out["quickack" if quickack else "plain client"] = (time.perf_counter() - t0) / n * 1e3
        client.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rng = random.Random(args.seed)
    folder = Path(tempfile.mkdtemp(prefix="check-fuzz-"))
    proc = ProcessorProcess(folder, extra_args=["--refresh-interval", "2", "--max-runs", "1000000"]).start()
    client = fc.OtlpClient(proc.grpc, proc.http)
    mismatches: Counter = Counter()
    seconds: Counter = Counter()
    counts: Counter = Counter()
    kinds = ["traces"] * 5 + ["metrics"] * 2 + ["bytes"] * 2 + ["envelope"]
    began = time.perf_counter()
    try:
        for i in range(args.requests):
            kind = rng.choice(kinds)
            transport = "http" if kind == "envelope" else rng.choice(["grpc", "http"])
            t0 = time.perf_counter()
            one(rng, client, kind, transport, mismatches)
            seconds[transport] += time.perf_counter() - t0
            counts[transport] += 1
            if i and i % 10_000 == 0:
                print(f"  {i} requests, {len(mismatches)} kinds of mismatch", flush=True)
        wall = time.perf_counter() - began
        pool = {r.strip() for r in fc.RUN_POOL}
        stored = {k for k in stored_step_keys(proc.db) if k[0] in pool}
        stored_memory = {k for k in stored_memory_keys(proc.db) if k[0] in pool}
        alive = proc.proc.poll() is None
        nagle = nagle_probe(proc.http, proc.grpc)
    finally:
        client.close()
        code = proc.stop()
    ledger = client.ledger
    print(f"\nrequests: {dict(ledger.requests)} (total {ledger.total}) in {wall:.0f} s "
          "(shared 2-core machine, contended)")
    for t in ("grpc", "http"):
        print(f"  {t}: {seconds[t] / max(1, counts[t]) * 1e3:.2f} ms per request (client + processor)")
    print(f"bad records refused with the documented reason: {ledger.rejected_expected}")
    print(f"mismatching answers: {sum(mismatches.values())}")
    for key, n in mismatches.most_common(10):
        print(f"  {n} x {key}")
    print(f"valid step rows: expected {len(ledger.steps)}, stored {len(stored)}, "
          f"missing {len(ledger.steps - stored)}, unexpected {len(stored - ledger.steps)}")
    print(f"valid memory rows: expected {len(ledger.memory)}, stored {len(stored_memory)}, "
          f"missing {len(ledger.memory - stored_memory)}")
    print(f"processor alive at the end: {alive}; exit code after SIGTERM: {code}; "
          f"database integrity: {integrity_ok(proc.db)}")
    print("HTTP answer with a body (partial success), ms/request: "
          + ", ".join(f"{k} {val:.1f}" for k, val in nagle.items()))
    ok = not mismatches and stored == ledger.steps and stored_memory == ledger.memory and alive and code == 0
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
