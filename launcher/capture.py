"""`traceml capture --run ID --rank R [--reference R2] [--steps N] [--processor URL ...] [--wait S]`.

A person's request for a deep profiler capture of a live run (docs/capture.md): posted to each
processor URL in turn until one accepts it (202) -- the replica that holds the run; the others
answer 404 -- then that one is asked for the capture until it is done or failed or `--wait`
seconds passed, and the digest is printed. The URLs default to `TRACEML_CONTROL_ENDPOINT` (the
list the ranks poll), the bearer token to the headers TraceML's exporter sends
(`TRACEML_OTLP_HEADERS`, else `OTEL_EXPORTER_OTLP_[TRACES_]HEADERS`), an https URL's CA to
`OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE`. Operator names come from the ranks: printed as text,
never as markup. Only HTTP: nothing of the processor is imported.

Exit codes: 0 done, 1 failed or not finished within --wait, 2 refused or unreachable.
"""
from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from typing import Mapping, Sequence, TextIO
from urllib.parse import quote

from traceml.schema import environment as env
from traceml.schema.capture import CAPTURES_PATH, DEFAULT_STEPS, MAX_STEPS, ManualRequest
from traceml.schema.otlp_headers import parse_otlp_headers

POLL_S = 0.5
TIMEOUT_S = 5.0
DEFAULT_WAIT_S = 180.0


class Refused(Exception):
    """Every processor refused or could not be reached; the message says what each answered."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="traceml capture",
        description="Ask the processor that holds a live run to profile a few steps of one rank against a "
                    "reference rank, then print the digest: where the rank's extra time goes.")
    parser.add_argument("--run", required=True, help="the run id")
    parser.add_argument("--rank", required=True, type=int, help="the rank to capture")
    parser.add_argument("--reference", type=int, default=None,
                        help="the rank to compare with (default: the processor's choice, never --rank)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"steps to record on each rank (1-{MAX_STEPS}, default {DEFAULT_STEPS})")
    parser.add_argument("--processor", action="append", default=None, metavar="URL",
                        help="a processor's OTLP/HTTP base URL (repeat for each replica; default: "
                             f"${env.TRACEML_CONTROL_ENDPOINT}, comma-separated)")
    parser.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="SECONDS",
                        help=f"how long to wait for the digest (default {DEFAULT_WAIT_S:g}; 0: ask and return)")
    parser.add_argument("--json", action="store_true", help="print the capture as the processor answers it")
    return parser


def processor_urls(given: Sequence[str] | None, environ: Mapping[str, str]) -> list[str]:
    raw = list(given) if given else [environ.get(env.TRACEML_CONTROL_ENDPOINT, "")]
    urls = []
    for item in raw:
        for url in item.split(","):
            url = url.strip().rstrip("/")
            if url and url not in urls:
                urls.append(url)
    return urls


class Client:
    """JSON over HTTP with the exporter's token and CA."""

    def __init__(self, environ: Mapping[str, str]):
        found = env.exporter_value(environ, "HEADERS", "traces")
        self.headers = dict(parse_otlp_headers(found[1] if found else None))
        ca = env.otlp_value(environ, "CERTIFICATE", "traces")
        self.context = ssl.create_default_context(cafile=ca[1]) if ca else None

    def call(self, method: str, url: str, doc: bytes | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(url, data=doc, method=method,
                                         headers={**self.headers, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self.context) as answer:
                body = answer.read()
                status = answer.status
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read()
        try:
            parsed = json.loads(body) if body else {}
        except ValueError:
            parsed = {"error": body[:200].decode(errors="replace")}
        return status, parsed if isinstance(parsed, dict) else {}


def request_capture(client: Client, urls: Sequence[str], manual: ManualRequest) -> tuple[str, dict]:
    """(the URL that accepted, its answer): posted to each URL until one answers 202. A 409 (one in
    progress) or 403 (captures off) from the run's owner stops the search: it is the answer."""
    answers = []
    for url in urls:
        try:
            status, doc = client.call("POST", url + CAPTURES_PATH, manual.to_json())
        except (OSError, ValueError) as exc:
            answers.append(f"{url}: unreachable ({exc})")
            continue
        if status == 202:
            return url, doc
        answers.append(f"{url}: {status} {doc.get('error', '')}".rstrip())
        if status in (400, 401, 403, 409):
            break
    raise Refused("; ".join(answers) or "no processor URL: pass --processor or set "
                                        f"{env.TRACEML_CONTROL_ENDPOINT}")


def wait_for(client: Client, url: str, capture_id: str, wait_s: float) -> dict:
    deadline = time.monotonic() + wait_s
    record: dict = {}
    while True:
        try:
            status, doc = client.call("GET", f"{url}{CAPTURES_PATH}/{quote(capture_id, safe='')}")
            if status == 200:
                record = doc
        except OSError:
            pass
        if record.get("status") in ("done", "failed", "refused") or time.monotonic() >= deadline:
            return record
        time.sleep(POLL_S)


def render(record: dict, out: TextIO, width: int | None = None) -> None:
    """The capture and its digest as text: Rich where it is installed (the processor extra), plain
    columns otherwise (a rank-only install); every wire string as text, never markup."""
    ref = record.get("reference_rank")
    lines = [f"Capture {record.get('capture_id')} of run {record.get('run_id')}: rank {record.get('culprit_rank')}"
             f" vs {'no reference' if ref is None else f'rank {ref}'} over {record.get('steps')} steps "
             f"({record.get('trigger')}): {record.get('status')}"]
    if record.get("reason"):
        lines.append(f"  reason: {record['reason']}")
    digest = record.get("digest")
    header = ("entry", "kind", "culprit ms/step", "reference ms/step", "excess", "share of gap")
    rows = []
    if digest:
        lines.append(f"  step {digest['culprit_step_ms']:.2f} ms vs {digest['reference_step_ms']:.2f} ms: "
                     f"gap {digest['gap_ms']:+.2f} ms per step")
        rows = [(row["name"], row["kind"], f"{row['culprit_ms']:.3f}",
                 "?" if row["reference_ms"] is None else f"{row['reference_ms']:.3f}",
                 "?" if row["excess_ms"] is None else f"{row['excess_ms']:+.3f}",
                 "" if row["share_of_gap"] is None else f"{row['share_of_gap']:.0%}") for row in digest["rows"]]
    tail = [f"  not seen: {note}" for note in (digest or {}).get("not_seen") or ()]
    tail += [f"  trace: {name}" for name in record.get("traces") or ()]
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        for line in lines:
            print(_printable(line), file=out)
        if rows:
            cells = [header] + [tuple(_printable(c) for c in row) for row in rows]
            widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
            for row in cells:
                print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))),
                      file=out)
        for line in tail:
            print(_printable(line), file=out)
        return
    console = Console(file=out, highlight=False, soft_wrap=True, width=width)
    for line in lines:
        console.print(Text(_printable(line)))
    if rows:
        table = Table(box=None, pad_edge=False)
        for i, column in enumerate(header):
            table.add_column(column, justify="left" if i < 2 else "right")
        for row in rows:
            table.add_row(*(Text(_printable(cell)) for cell in row))
        console.print(table)
    for line in tail:
        console.print(Text(_printable(line)))


def _printable(text: str) -> str:
    """A processor's message may quote wire strings: control characters are spelled out."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def main(argv: Sequence[str], out: TextIO | None = None, environ: Mapping[str, str] | None = None) -> int:
    out = out or sys.stdout
    environ = os.environ if environ is None else environ
    parser = build_parser()
    options = parser.parse_args(list(argv))
    if not 1 <= options.steps <= MAX_STEPS:
        parser.error(f"--steps must be 1..{MAX_STEPS}")
    if options.rank < 0 or (options.reference is not None and options.reference < 0):
        parser.error("ranks are whole numbers >= 0")
    if options.wait < 0:
        parser.error("--wait must be >= 0")
    urls = processor_urls(options.processor, environ)
    client = Client(environ)
    manual = ManualRequest(run_id=options.run, rank=options.rank, reference=options.reference, steps=options.steps)
    try:
        url, accepted = request_capture(client, urls, manual)
    except Refused as exc:
        print(f"traceml capture: refused: {_printable(str(exc))}", file=sys.stderr)
        return 2
    capture_id = str(accepted.get("capture_id"))
    print(f"traceml capture: {capture_id} accepted by {url}", file=sys.stderr)
    record = wait_for(client, url, capture_id, options.wait) if options.wait > 0 else accepted
    if options.json:
        print(json.dumps(record, indent=2), file=out)
    elif options.wait > 0:
        render(record, out)
    return 0 if record.get("status") == "done" or options.wait == 0 else 1
