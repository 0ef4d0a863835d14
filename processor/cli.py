"""`traceml-processor`: flags first, then TRACEML_PROCESSOR_* / OTEL_* environment, then defaults.

Loopback by default. SIGTERM and SIGINT stop the receivers, commit what is
queued, summarise open runs and exit 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sqlite3
import sys
from pathlib import Path

from traceml.schema import environment as env
from traceml.schema.distribution import package_version

DEFAULT_GRPC = "127.0.0.1:4317"
DEFAULT_HTTP = "127.0.0.1:4318"
OFF = ("off", "none", "")


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def build_parser() -> argparse.ArgumentParser:
    from traceml.processor.ingest import DEFAULT_MAX_CONCURRENT_REQUESTS

    p = argparse.ArgumentParser(
        prog="traceml-processor",
        description="Receive TraceML OTLP, store it in SQLite, diagnose live, re-export summary metrics.")
    p.add_argument("--db", help=f"SQLite file (env {env.TRACEML_PROCESSOR_DB}; default ./traceml.db)")
    p.add_argument("--otlp-grpc", metavar="HOST:PORT",
                   help=f"OTLP/gRPC listen address or 'off' (env {env.TRACEML_PROCESSOR_OTLP_GRPC}; "
                        f"default {DEFAULT_GRPC})")
    p.add_argument("--otlp-http", metavar="HOST:PORT",
                   help=f"OTLP/HTTP listen address, also /healthz and /readyz, or 'off' "
                        f"(env {env.TRACEML_PROCESSOR_OTLP_HTTP}; default {DEFAULT_HTTP})")
    p.add_argument("--prometheus", metavar="HOST:PORT",
                   help=f"serve /metrics here (env {env.TRACEML_PROCESSOR_PROMETHEUS}; default off)")
    p.add_argument("--ui", metavar="HOST:PORT",
                   help=f"serve the live web view (index /ui/, one page per run) here, with the bearer token "
                        f"and TLS settings below (env {env.TRACEML_PROCESSOR_UI}; default off; docs/web.md)")
    p.add_argument("--export-endpoint", metavar="URL",
                   help=f"push summary metrics over OTLP (env {env.TRACEML_PROCESSOR_EXPORT_ENDPOINT}, "
                        f"else {env.OTEL_EXPORTER_OTLP_METRICS_ENDPOINT} / {env.OTEL_EXPORTER_OTLP_ENDPOINT}; "
                        "default off)")
    p.add_argument("--export-protocol", choices=("grpc", "http/protobuf"),
                   help=f"OTLP protocol for --export-endpoint (env {env.OTEL_EXPORTER_OTLP_METRICS_PROTOCOL} / "
                        f"{env.OTEL_EXPORTER_OTLP_PROTOCOL}; default grpc, http/protobuf for URLs ending /v1/metrics)")
    p.add_argument("--export-interval", type=float, metavar="SECONDS",
                   help=f"seconds between pushes (env {env.TRACEML_PROCESSOR_EXPORT_INTERVAL}; default 5)")
    p.add_argument("--summary-dir", metavar="DIR",
                   help=f"write final_summary.json + card per ended run here "
                        f"(env {env.TRACEML_PROCESSOR_SUMMARY_DIR}; default off)")
    p.add_argument("--idle-timeout", type=float, metavar="SECONDS",
                   help=f"end a run after this long without data (env {env.TRACEML_PROCESSOR_IDLE_TIMEOUT}; "
                        "default 300)")
    p.add_argument("--refresh-interval", type=float, metavar="SECONDS",
                   help=f"live analysis refresh period (env {env.TRACEML_PROCESSOR_REFRESH_INTERVAL}; default 0.5)")
    p.add_argument("--auth-token-file", metavar="FILE",
                   help=f"require 'Authorization: Bearer <token>' (token read from FILE; "
                        f"or env {env.TRACEML_PROCESSOR_AUTH_TOKEN})")
    p.add_argument("--tls-cert", metavar="PEM", help=f"server certificate (env {env.TRACEML_PROCESSOR_TLS_CERT})")
    p.add_argument("--tls-key", metavar="PEM", help=f"server key (env {env.TRACEML_PROCESSOR_TLS_KEY})")
    p.add_argument("--max-runs", type=int, help=f"env {env.TRACEML_PROCESSOR_MAX_RUNS}; default 1000")
    p.add_argument("--max-ranks-per-run", type=int,
                   help=f"env {env.TRACEML_PROCESSOR_MAX_RANKS_PER_RUN}; default 16384")
    p.add_argument("--workers", type=int, metavar="N",
                   help=f"ingest processes sharing the receiver ports (env {env.TRACEML_PROCESSOR_WORKERS}; "
                        "default 1; more use more cores for decode and normalisation)")
    p.add_argument("--rank-series-top-k", type=int, metavar="K",
                   help=f"per-rank series for the K ranks of each run with the highest deviation score, beyond "
                        f"the culprits, victims, worst and representative rank (env "
                        f"{env.TRACEML_PROCESSOR_RANK_SERIES_TOP_K}; default 8; all ranks stay in the summary)")
    p.add_argument("--max-series", type=int, metavar="N",
                   help=f"series per /metrics scrape or push; whole runs beyond it are left out and counted "
                        f"(env {env.TRACEML_PROCESSOR_MAX_SERIES}; default 100000)")
    p.add_argument("--max-concurrent-requests", type=int, metavar="N",
                   help=f"export requests each receiver handles at once; beyond it gRPC UNAVAILABLE with RetryInfo, "
                        f"HTTP 429 with Retry-After (env {env.TRACEML_PROCESSOR_MAX_CONCURRENT_REQUESTS}; "
                        f"default {DEFAULT_MAX_CONCURRENT_REQUESTS})")
    from traceml.processor import http_front

    p.add_argument("--http-header-timeout", type=float, metavar="SECONDS",
                   help=f"OTLP/HTTP: the request head must arrive within this, from connect or its first byte "
                        f"(env {env.TRACEML_PROCESSOR_HTTP_HEADER_TIMEOUT}; default "
                        f"{http_front.DEFAULT_HEADER_TIMEOUT_S:g})")
    p.add_argument("--http-body-timeout", type=float, metavar="SECONDS",
                   help=f"OTLP/HTTP: the body must arrive within this after the head; then 408 "
                        f"(env {env.TRACEML_PROCESSOR_HTTP_BODY_TIMEOUT}; default {http_front.DEFAULT_BODY_TIMEOUT_S:g})")
    p.add_argument("--http-keepalive-timeout", type=float, metavar="SECONDS",
                   help=f"OTLP/HTTP: an idle kept-alive connection is closed after this "
                        f"(env {env.TRACEML_PROCESSOR_HTTP_KEEPALIVE_TIMEOUT}; default "
                        f"{http_front.DEFAULT_KEEPALIVE_TIMEOUT_S:g})")
    p.add_argument("--http-max-connections", type=int, metavar="N",
                   help=f"OTLP/HTTP connections open at once per process (lowered below the descriptor limit); "
                        f"beyond it the longest-idle is closed, else 503 + Retry-After "
                        f"(env {env.TRACEML_PROCESSOR_HTTP_MAX_CONNECTIONS}; default {http_front.DEFAULT_MAX_CONNECTIONS})")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    return p


def _address(value: str | None, default: str | None):
    from traceml.processor.security import parse_host_port

    value = default if value is None else value
    if value is None or value.strip().lower() in OFF:
        return None
    return parse_host_port(value)


def _export_config(args):
    """--export-* flags -> SummaryExportConfig; the OTLP exporter itself reads the rest of OTEL_EXPORTER_OTLP_*."""
    from traceml.processor.summary_export import SummaryExportConfig
    from traceml.schema.otlp_headers import parse_otlp_headers

    own = args.export_endpoint or _env(env.TRACEML_PROCESSOR_EXPORT_ENDPOINT)
    per_signal = _env(env.OTEL_EXPORTER_OTLP_METRICS_ENDPOINT)
    chosen = own or per_signal or _env(env.OTEL_EXPORTER_OTLP_ENDPOINT)
    if not chosen or chosen.strip().lower() in OFF:
        return None
    protocol = (args.export_protocol or _env(env.OTEL_EXPORTER_OTLP_METRICS_PROTOCOL)
                or _env(env.OTEL_EXPORTER_OTLP_PROTOCOL))
    if protocol is None:
        protocol = "http/protobuf" if chosen.rstrip("/").endswith("/v1/metrics") else "grpc"
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"unsupported OTLP protocol {protocol!r} for summary export (grpc or http/protobuf)")
    headers = _env(env.OTEL_EXPORTER_OTLP_METRICS_HEADERS) or _env(env.OTEL_EXPORTER_OTLP_HEADERS)
    return SummaryExportConfig(
        endpoint=own.strip() if own else None,  # None: the exporter resolves the OTEL_* endpoint by the spec
        protocol=protocol,
        headers=dict(parse_otlp_headers(headers)),
        timeout_s=_otlp_timeout_s(),
        interval_s=float(args.export_interval or _env(env.TRACEML_PROCESSOR_EXPORT_INTERVAL, "5")),
    )


def _otlp_timeout_s(default_s: float = 10.0) -> float:
    """OTEL_EXPORTER_OTLP_METRICS_TIMEOUT, else OTEL_EXPORTER_OTLP_TIMEOUT: milliseconds by the spec."""
    for name in (env.OTEL_EXPORTER_OTLP_METRICS_TIMEOUT, env.OTEL_EXPORTER_OTLP_TIMEOUT):
        raw = _env(name)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if value > 0:
            return value / 1000.0
        logging.getLogger("traceml.processor").warning("%s=%r is not a positive number of milliseconds; ignored",
                                                       name, raw)
    return default_s


def _http_limits(args):
    """--http-* flags, else TRACEML_PROCESSOR_HTTP_*, else the front's defaults. Raises ValueError."""
    from traceml.processor import http_front

    def pick(flag, name: str, default, kind):
        return flag if flag is not None else kind(_env(name, str(default)))

    limits = http_front.HttpLimits(
        header_timeout_s=pick(args.http_header_timeout, env.TRACEML_PROCESSOR_HTTP_HEADER_TIMEOUT,
                              http_front.DEFAULT_HEADER_TIMEOUT_S, float),
        body_timeout_s=pick(args.http_body_timeout, env.TRACEML_PROCESSOR_HTTP_BODY_TIMEOUT,
                            http_front.DEFAULT_BODY_TIMEOUT_S, float),
        keepalive_timeout_s=pick(args.http_keepalive_timeout, env.TRACEML_PROCESSOR_HTTP_KEEPALIVE_TIMEOUT,
                                 http_front.DEFAULT_KEEPALIVE_TIMEOUT_S, float),
        max_connections=pick(args.http_max_connections, env.TRACEML_PROCESSOR_HTTP_MAX_CONNECTIONS,
                             http_front.DEFAULT_MAX_CONNECTIONS, int),
    )
    limits.validate()
    return limits


def config_from_args(argv=None):
    """Flags + environment -> ProcessorConfig. Raises ValueError on bad settings."""
    from traceml.processor.decode import DecodeLimits
    from traceml.processor.ingest import DEFAULT_MAX_CONCURRENT_REQUESTS
    from traceml.processor.security import BearerAuth, TlsConfig, read_token_file
    from traceml.processor.service import ProcessorConfig

    args = build_parser().parse_args(argv)
    token = _env(env.TRACEML_PROCESSOR_AUTH_TOKEN)
    if args.auth_token_file:
        token = read_token_file(args.auth_token_file)  # TokenFileError: exit 1
    limits = DecodeLimits(
        max_runs=int(args.max_runs or _env(env.TRACEML_PROCESSOR_MAX_RUNS, "1000")),
        max_ranks_per_run=int(args.max_ranks_per_run or _env(env.TRACEML_PROCESSOR_MAX_RANKS_PER_RUN, "16384")),
    )
    summary_dir = args.summary_dir or _env(env.TRACEML_PROCESSOR_SUMMARY_DIR)
    config = ProcessorConfig(
        db=Path(args.db or _env(env.TRACEML_PROCESSOR_DB, "traceml.db")),
        otlp_grpc=_address(args.otlp_grpc, _env(env.TRACEML_PROCESSOR_OTLP_GRPC, DEFAULT_GRPC)),
        otlp_http=_address(args.otlp_http, _env(env.TRACEML_PROCESSOR_OTLP_HTTP, DEFAULT_HTTP)),
        prometheus=_address(args.prometheus, _env(env.TRACEML_PROCESSOR_PROMETHEUS)),
        ui=_address(args.ui, _env(env.TRACEML_PROCESSOR_UI)),
        export=_export_config(args),
        summary_dir=Path(summary_dir) if summary_dir else None,
        auth=BearerAuth(token or None),
        tls=TlsConfig(args.tls_cert or _env(env.TRACEML_PROCESSOR_TLS_CERT),
                      args.tls_key or _env(env.TRACEML_PROCESSOR_TLS_KEY)),
        idle_timeout_s=float(args.idle_timeout or _env(env.TRACEML_PROCESSOR_IDLE_TIMEOUT, "300")),
        refresh_interval_s=float(args.refresh_interval or _env(env.TRACEML_PROCESSOR_REFRESH_INTERVAL, "0.5")),
        limits=limits,
        workers=int(args.workers or _env(env.TRACEML_PROCESSOR_WORKERS, "1")),
        rank_series_top_k=(args.rank_series_top_k if args.rank_series_top_k is not None
                           else int(_env(env.TRACEML_PROCESSOR_RANK_SERIES_TOP_K, "8"))),
        max_series=(args.max_series if args.max_series is not None
                    else int(_env(env.TRACEML_PROCESSOR_MAX_SERIES, "100000"))),
        max_concurrent_requests=(args.max_concurrent_requests if args.max_concurrent_requests is not None
                                 else int(_env(env.TRACEML_PROCESSOR_MAX_CONCURRENT_REQUESTS,
                                               str(DEFAULT_MAX_CONCURRENT_REQUESTS)))),
        http_limits=_http_limits(args),
    )
    if config.workers < 1:
        raise ValueError("--workers must be at least 1")
    if config.rank_series_top_k < 0 or config.max_series < 1:
        raise ValueError("--rank-series-top-k must be at least 0 and --max-series at least 1")
    if config.max_concurrent_requests < 1:
        raise ValueError("--max-concurrent-requests must be at least 1")
    if config.idle_timeout_s <= 0 or config.refresh_interval_s <= 0:
        raise ValueError("--idle-timeout and --refresh-interval must be positive")
    return config, args


def main(argv=None) -> int:
    from traceml.schema.distribution import processor_side_missing_message

    missing = processor_side_missing_message("traceml-processor")
    if missing:  # a core-only (training side) install: the install line, not an ImportError traceback
        print(f"traceml-processor: {missing}", file=sys.stderr)
        return 2
    from traceml.processor.security import TokenFileError

    try:
        config, args = config_from_args(argv)
    except TokenFileError as exc:  # a file that is there to be used, as a missing TLS file: cannot start
        print(f"traceml-processor: cannot start: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"traceml-processor: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from traceml.processor.service import ProcessorService
    from traceml.processor.signal_stop import SignalStop

    stopping = SignalStop().install(signal.SIGTERM, signal.SIGINT)  # noted only: see signal_stop
    try:
        service = ProcessorService(config).start()
    except (ValueError, OSError, RuntimeError, sqlite3.Error) as exc:  # database problems: sqlite_guard
        print(f"traceml-processor: cannot start: {exc}", file=sys.stderr)
        return 1
    # One line on stdout that launchers and tests can wait for.
    print(f"traceml-processor ready grpc={service.grpc_port} http={service.http_port} "
          f"prometheus={service.prometheus_port} ui={service.ui_port}", flush=True)
    signum = stopping.wait()
    logging.getLogger("traceml.processor").info("signal %d: stopping", signum)
    service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
