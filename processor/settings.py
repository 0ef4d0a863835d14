"""Every `traceml-processor` setting, declared once: flag, variable, default, type, range, meaning.

In the manner of the OpenTelemetry SDK's environment-variable constants: each
setting is one module constant (`IDLE_TIMEOUT`, `MAX_RUNS`, ...) that states its
flag, its environment variable (named in `traceml.schema.environment`), its
default, the values it accepts and what it means. The CLI builds its flags and
help from these declarations, `ProcessorConfig` takes its defaults from them, and
`tests/processor/test_settings.py` checks docs/processor.md's settings table
against them and that no other processor or launcher module restates a default.

One rule, strictly: a flag wins over its variable, which wins over the default,
and a value outside its range is an error naming the flag or variable, the value
and what is accepted (`SettingError`), before anything starts. Nothing is
silently rewritten; where 0 is accepted the declaration says what it means. An
empty variable counts as unset, as the OpenTelemetry specification says.

The standard `OTEL_EXPORTER_OTLP_*` variables of the summary push follow the one
precedence rule the house has (`environment.otlp_candidates`: the per-signal
`..._METRICS_...` form, then the generic one). The timeout is read as the
specification and the training side's exporter read it (`env_values`: whole
milliseconds, 0 is no limit), but an invalid value stops start-up here instead
of being warned about: a service is configured once, by someone watching it
start. Headers keep their shared, lenient parser (`otlp_headers`), which skips a
malformed entry with a warning that never shows its text (it may be a credential).

Standard library only, and nothing of the processor at import: the modules whose
defaults these are import this one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Mapping, TypeVar

from traceml.schema import capture as capture_wire
from traceml.schema import env_values
from traceml.schema import environment as env

T = TypeVar("T")

OFF = ("off", "none", "")
"""Spellings (after stripping, any case) that turn an address or the push off."""


class SettingError(ValueError):
    """A flag or variable with a value outside its range; the message names all three."""


# --- the kinds of value -------------------------------------------------------------------


class Kind(Generic[T]):
    """How one kind of value is read from text, checked and shown."""

    expected: str = "a value"
    """What is accepted, for help texts, the docs and error messages."""

    def parse(self, text: str) -> T:
        """The value `text` gives. Raises ValueError when it is not one this kind accepts."""
        raise NotImplementedError

    def check(self, value: T) -> None:
        """Raises ValueError when `value` (already typed) is outside the range."""

    def show(self, value: T) -> str:
        return "off" if value is None else str(value)


class Number(Kind[T]):
    """A whole number or a finite number of seconds, with a lower bound (inclusive or not) and,
    where the wire bounds it, an inclusive upper bound."""

    def __init__(self, kind: type, minimum: float, *, inclusive: bool, unit: str = "",
                 maximum: float | None = None):
        self.kind = kind
        self.minimum = minimum
        self.inclusive = inclusive
        self.maximum = maximum
        noun = "a whole number" if kind is int else f"a number of {unit}" if unit else "a number"
        self.expected = f"{noun} {'at least' if inclusive else 'greater than'} {minimum:g}"
        if maximum is not None:
            self.expected += f" and at most {maximum:g}"

    def parse(self, text: str) -> T:
        try:
            value = self.kind(text.strip())
        except ValueError:
            raise ValueError(self.expected) from None
        self.check(value)
        return value

    def check(self, value: T) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (self.kind is int and not isinstance(value, int)) or not math.isfinite(value):
            raise ValueError(self.expected)
        if value < self.minimum or (value == self.minimum and not self.inclusive):
            raise ValueError(self.expected)
        if self.maximum is not None and value > self.maximum:
            raise ValueError(self.expected)

    def show(self, value: T) -> str:
        if value is None:
            return "off"
        return str(value) if self.kind is int else f"{value:g}"  # a byte count is shown whole


def seconds(above: float) -> Number[float]:
    return Number(float, above, inclusive=False, unit="seconds")


def at_least(minimum: int, at_most: int | None = None) -> Number[int]:
    return Number(int, minimum, inclusive=True, maximum=at_most)


class Address(Kind["tuple[str, int] | None"]):
    """`HOST:PORT`, `:PORT` (loopback), `[::1]:PORT`, or `off`."""

    expected = "HOST:PORT (a port 0-65535) or off"

    def parse(self, text: str):
        if text.strip().lower() in OFF:
            return None
        from traceml.processor.security import parse_host_port

        try:
            return parse_host_port(text)
        except ValueError:
            raise ValueError(self.expected) from None

    def show(self, value) -> str:
        if value is None:
            return "off"
        host, port = value
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Text(Kind["str | None"]):
    """Free text (a URL, a token, a file name); blank is refused."""

    def __init__(self, expected: str = "a non-empty value"):
        self.expected = expected

    def parse(self, text: str) -> str:
        if not text.strip():
            raise ValueError(self.expected)
        return text.strip()


class Endpoint(Kind["str | None"]):
    """A URL for the summary push, or `off` (None)."""

    expected = "a URL or off"

    def parse(self, text: str) -> str | None:
        return None if text.strip().lower() in OFF else text.strip()


class FilePath(Text):
    def parse(self, text: str) -> Path:  # type: ignore[override]
        return Path(super().parse(text))


class Choice(Kind[str]):
    """One of a closed set, case-insensitive; `aliases` maps other accepted spellings."""

    def __init__(self, choices: tuple[str, ...], *, case: str = "lower"):
        self.choices = choices
        self.case = case
        self.expected = "one of " + ", ".join(choices)

    def parse(self, text: str) -> str:
        value = text.strip().upper() if self.case == "upper" else text.strip().lower()
        if value not in self.choices:
            raise ValueError(self.expected)
        return value


class OtlpTimeout(Kind[float]):
    """An OTLP Timeout variable: whole milliseconds >= 0 by the specification, 0 meaning no limit.

    Read by `env_values`' strict reader, the one that also serves the training side
    (where an invalid value is warned about instead); held in seconds.
    """

    expected = f"{env_values.TIMEOUT_EXPECTED} (milliseconds)"

    def parse(self, text: str) -> float:
        try:
            return env_values.timeout_ms_value(text) / 1000.0
        except ValueError:
            raise ValueError(self.expected) from None

    def show(self, value: float) -> str:
        return f"{value * 1000:g} ms"


# --- the declaration ----------------------------------------------------------------------


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One processor setting.

    Args:
        name: its key, the `ProcessorConfig` field or part it fills (argparse `dest`).
        flag: the command-line flag, or None (a variable only).
        variable: the TraceML environment variable, or None (a flag only).
        default: the value when neither is given (None: off / unset).
        kind: how a value is read and which values are accepted.
        meaning: one sentence for `--help` and the docs.
        metavar: the flag's argument in `--help`.
        otlp_option: for the summary push, the OTLP exporter option whose standard
            variables (`OTEL_EXPORTER_OTLP_METRICS_<OPTION>`, then
            `OTEL_EXPORTER_OTLP_<OPTION>`) are read after `variable`.
        shown_default: how the default reads in help and docs, when not `kind.show`.
        zero: what 0 means, where the range accepts it.
    """

    name: str
    flag: str | None
    variable: str | None
    default: T
    kind: Kind
    meaning: str
    metavar: str | None = None
    otlp_option: str | None = None
    shown_default: str | None = None
    zero: str | None = None

    @property
    def variables(self) -> tuple[str, ...]:
        """Every variable read, in precedence order."""
        own = (self.variable,) if self.variable else ()
        return own + (env.otlp_variables(self.otlp_option, "metrics") if self.otlp_option else ())

    @property
    def default_text(self) -> str:
        return self.shown_default if self.shown_default is not None else self.kind.show(self.default)

    @property
    def accepted(self) -> str:
        """The range, for help and the docs' table, with what 0 means where it is accepted."""
        text = self.kind.expected
        return f"{text}; 0: {self.zero}" if self.zero else text

    def help_text(self, *, variables: bool = True) -> str:
        """The meaning, then (variables, default, range) in brackets."""
        where = " / ".join(self.variables) if variables else ""
        parts = [f"env {where}" if where else None, f"default {self.default_text}"]
        if isinstance(self.kind, (Number, OtlpTimeout)):
            parts.append(self.accepted)
        return f"{self.meaning} ({'; '.join(p for p in parts if p)})"

    def parse(self, text: str, source: str) -> T:
        """`text` read from `source` (`--flag` or `VARIABLE`); SettingError naming both if invalid."""
        try:
            return self.kind.parse(text)
        except ValueError as exc:
            shown = f"{source} {text!r}" if source.startswith("-") else f"{source}={text!r}"
            raise SettingError(f"{shown} is invalid: expected {exc}") from None

    def check(self, value: T, source: str) -> None:
        """A typed value given in code (`ProcessorConfig`): SettingError naming `source` if out of range."""
        try:
            self.kind.check(value)
        except ValueError as exc:
            raise SettingError(f"{source}={value!r} is invalid: expected {exc}") from None


# --- the settings, in `--help` order ------------------------------------------------------

DB: Setting[Path] = Setting(
    "db", "--db", env.TRACEML_PROCESSOR_DB, Path("traceml.db"), FilePath("a file name"),
    "SQLite file (created if missing, reused if present)", metavar="PATH", shown_default="./traceml.db")
OTLP_GRPC: Setting[tuple[str, int] | None] = Setting(
    "otlp_grpc", "--otlp-grpc", env.TRACEML_PROCESSOR_OTLP_GRPC, ("127.0.0.1", 4317), Address(),
    "OTLP/gRPC listen address, or off", metavar="HOST:PORT")
OTLP_HTTP: Setting[tuple[str, int] | None] = Setting(
    "otlp_http", "--otlp-http", env.TRACEML_PROCESSOR_OTLP_HTTP, ("127.0.0.1", 4318), Address(),
    "OTLP/HTTP listen address, also /healthz and /readyz, or off", metavar="HOST:PORT")
PROMETHEUS: Setting[tuple[str, int] | None] = Setting(
    "prometheus", "--prometheus", env.TRACEML_PROCESSOR_PROMETHEUS, None, Address(),
    "serve /metrics here", metavar="HOST:PORT")
UI: Setting[tuple[str, int] | None] = Setting(
    "ui", "--ui", env.TRACEML_PROCESSOR_UI, None, Address(),
    "serve the live web view (index /ui/, one page per run) here, with the bearer token and TLS settings "
    "below (docs/web.md)", metavar="HOST:PORT")
EXPORT_ENDPOINT: Setting[str | None] = Setting(
    "export_endpoint", "--export-endpoint", env.TRACEML_PROCESSOR_EXPORT_ENDPOINT, None,
    Endpoint(), "push summary metrics over OTLP to this base URL, or off", metavar="URL",
    otlp_option="ENDPOINT")
EXPORT_PROTOCOL: Setting[str | None] = Setting(
    "export_protocol", "--export-protocol", None, None, Choice(("grpc", "http/protobuf")),
    "OTLP protocol of the summary push", otlp_option="PROTOCOL",
    shown_default="grpc, http/protobuf for a URL ending /v1/metrics")
EXPORT_INTERVAL: Setting[float] = Setting(
    "export_interval_s", "--export-interval", env.TRACEML_PROCESSOR_EXPORT_INTERVAL, 5.0, seconds(0),
    "seconds between summary pushes", metavar="SECONDS")
EXPORT_TIMEOUT: Setting[float] = Setting(
    "export_timeout_s", None, None, 10.0, OtlpTimeout(),
    "one summary push, its retries included", otlp_option="TIMEOUT", zero="no limit")
SUMMARY_DIR: Setting[Path | None] = Setting(
    "summary_dir", "--summary-dir", env.TRACEML_PROCESSOR_SUMMARY_DIR, None, FilePath("a folder name"),
    "write final_summary.json + card per ended run here", metavar="DIR")
IDLE_TIMEOUT: Setting[float] = Setting(
    "idle_timeout_s", "--idle-timeout", env.TRACEML_PROCESSOR_IDLE_TIMEOUT, 300.0, seconds(0),
    "end a run after this long without data", metavar="SECONDS")
REFRESH_INTERVAL: Setting[float] = Setting(
    "refresh_interval_s", "--refresh-interval", env.TRACEML_PROCESSOR_REFRESH_INTERVAL, 0.5, seconds(0),
    "how long a /metrics scrape or the OTLP push waits for the live analysis of rows that arrived "
    "since the last one (a run is analysed when rows arrived for it and its figures are read); with "
    "--workers, how often the store is read for the workers' rows", metavar="SECONDS")
AUTH_TOKEN_FILE: Setting[Path | None] = Setting(
    "auth_token_file", "--auth-token-file", None, None, FilePath("a file name"),
    "require 'Authorization: Bearer <token>', the token read from FILE (an empty or unreadable file "
    f"stops start-up), or the token itself from {env.TRACEML_PROCESSOR_AUTH_TOKEN}", metavar="FILE")
AUTH_TOKEN: Setting[str | None] = Setting(
    "auth_token", None, env.TRACEML_PROCESSOR_AUTH_TOKEN, None, Text("a non-empty token"),
    "the bearer token itself (--auth-token-file wins)")
TLS_CERT: Setting[Path | None] = Setting(
    "tls_cert", "--tls-cert", env.TRACEML_PROCESSOR_TLS_CERT, None, FilePath("a file name"),
    "server certificate (PEM), both receivers", metavar="PEM")
TLS_KEY: Setting[Path | None] = Setting(
    "tls_key", "--tls-key", env.TRACEML_PROCESSOR_TLS_KEY, None, FilePath("a file name"),
    "server key (PEM)", metavar="PEM")
MAX_RUNS: Setting[int] = Setting(
    "max_runs", "--max-runs", env.TRACEML_PROCESSOR_MAX_RUNS, 1000, at_least(1),
    "runs tracked at once; data of further runs is rejected", metavar="N")
MAX_RANKS_PER_RUN: Setting[int] = Setting(
    "max_ranks_per_run", "--max-ranks-per-run", env.TRACEML_PROCESSOR_MAX_RANKS_PER_RUN, 16384, at_least(1),
    "ranks accepted per run; further ranks are rejected", metavar="N")
WORKERS: Setting[int] = Setting(
    "workers", "--workers", env.TRACEML_PROCESSOR_WORKERS, 1, at_least(1),
    "ingest processes sharing the receiver ports; more use more cores for decode and normalisation",
    metavar="N")
MAPPING_FILE: Setting[Path | None] = Setting(
    "mapping_file", "--mapping-file", env.TRACEML_PROCESSOR_MAPPING_FILE, None, FilePath("a file name"),
    "a declared mapping (TOML) naming a job's own step span, phase spans or attributes and identity "
    "attributes, read before the built-in Megatron-LM and nemo-lens mappings; checked at start-up "
    "(docs/mapping.md)", metavar="FILE")
RANK_SERIES_TOP_K: Setting[int] = Setting(
    "rank_series_top_k", "--rank-series-top-k", env.TRACEML_PROCESSOR_RANK_SERIES_TOP_K, 8, at_least(0),
    "per-rank series for the K ranks of each run with the highest deviation score, beyond the culprits, "
    "victims, worst and representative rank (all ranks stay in the summary)", metavar="K",
    zero="only those named ranks")
REPEAT_OFFENDER_RUNS: Setting[int] = Setting(
    "repeat_offender_runs", "--repeat-offender-runs", env.TRACEML_PROCESSOR_REPEAT_OFFENDER_RUNS, 3, at_least(1),
    "K: a run whose confirmed straggler's host (or GPU) was the culprit in at least K of the host's last N "
    "summarised runs, this one included, gets REPEAT_OFFENDER_HOST", metavar="K")
REPEAT_OFFENDER_WINDOW: Setting[int] = Setting(
    "repeat_offender_window", "--repeat-offender-window", env.TRACEML_PROCESSOR_REPEAT_OFFENDER_WINDOW, 5,
    at_least(1), "N: the host's latest runs the repeat-offender rule counts (K above N never fires)", metavar="N")
FLEET_PERIOD: Setting[float] = Setting(
    "fleet_period_s", "--fleet-period", env.TRACEML_PROCESSOR_FLEET_PERIOD, 7 * 86400.0, seconds(0),
    "culprit history the fleet series on /metrics and the push, and the web view's fleet page, cover",
    metavar="SECONDS")
MAX_SERIES: Setting[int] = Setting(
    "max_series", "--max-series", env.TRACEML_PROCESSOR_MAX_SERIES, 100_000, at_least(1),
    "series per /metrics scrape or push; whole runs beyond it are left out and counted", metavar="N")
MAX_CONCURRENT_REQUESTS: Setting[int] = Setting(
    "max_concurrent_requests", "--max-concurrent-requests", env.TRACEML_PROCESSOR_MAX_CONCURRENT_REQUESTS, 128,
    at_least(1), "export requests each receiver handles at once; beyond it gRPC UNAVAILABLE with RetryInfo, "
    "HTTP 429 with Retry-After", metavar="N")
HTTP_HEADER_TIMEOUT: Setting[float] = Setting(
    "http_header_timeout_s", "--http-header-timeout", env.TRACEML_PROCESSOR_HTTP_HEADER_TIMEOUT, 5.0, seconds(0),
    "every HTTP port (OTLP/HTTP, web view, /metrics): the request head must arrive within this, from connect "
    "(TLS handshake included) or its first byte; then 408", metavar="SECONDS")
HTTP_BODY_TIMEOUT: Setting[float] = Setting(
    "http_body_timeout_s", "--http-body-timeout", env.TRACEML_PROCESSOR_HTTP_BODY_TIMEOUT, 30.0, seconds(0),
    "every HTTP port: the body must arrive within this after the head; then 408", metavar="SECONDS")
HTTP_BODY_CHUNK_TIMEOUT: Setting[float] = Setting(
    "http_body_chunk_timeout_s", "--http-body-chunk-timeout", env.TRACEML_PROCESSOR_HTTP_BODY_CHUNK_TIMEOUT, 10.0,
    seconds(0), "every HTTP port: no longer than this between two pieces of a request body; then 408",
    metavar="SECONDS")
HTTP_KEEPALIVE_TIMEOUT: Setting[float] = Setting(
    "http_keepalive_timeout_s", "--http-keepalive-timeout", env.TRACEML_PROCESSOR_HTTP_KEEPALIVE_TIMEOUT, 60.0,
    seconds(0), "every HTTP port: an idle kept-alive connection is closed after this", metavar="SECONDS")
HTTP_MAX_CONNECTIONS: Setting[int] = Setting(
    "http_max_connections", "--http-max-connections", env.TRACEML_PROCESSOR_HTTP_MAX_CONNECTIONS, 1024,
    at_least(1), "connections open at once per HTTP port (lowered below the descriptor limit; /metrics keeps "
    "at most 64); beyond it the one that made the least progress is closed (no complete request head, the "
    "longest waiting; else the slowest body), and only when all are being answered 503 + Retry-After",
    metavar="N")
CAPTURE: Setting[str] = Setting(
    "capture", "--capture", env.TRACEML_PROCESSOR_CAPTURE, "auto", Choice(("auto", "manual", "off")),
    "deep profiler captures (docs/capture.md): auto, a confirmed finding that names a culprit rank asks it and "
    "a reference rank to profile a few steps; manual, only a person asks (traceml capture, the web view); off, "
    "none is asked and ranks are handed nothing")
CAPTURE_STEPS: Setting[int] = Setting(
    "capture_steps", "--capture-steps", env.TRACEML_PROCESSOR_CAPTURE_STEPS, capture_wire.DEFAULT_STEPS,
    at_least(1, capture_wire.MAX_STEPS), "steps an automatic capture records on each of its two ranks "
    "(a person's request says its own)", metavar="N")
CAPTURE_COOLDOWN: Setting[float] = Setting(
    "capture_cooldown_s", "--capture-cooldown", env.TRACEML_PROCESSOR_CAPTURE_COOLDOWN, 300.0, seconds(0),
    "after an automatic capture of a run, the diagnosis asks for no other of that run for this long "
    "(a person's request is not held back)", metavar="SECONDS")
CAPTURE_MAX_TRACE_BYTES: Setting[int] = Setting(
    "capture_max_trace_bytes", "--capture-max-trace-bytes", env.TRACEML_PROCESSOR_CAPTURE_MAX_TRACE_BYTES,
    capture_wire.DEFAULT_MAX_TRACE_BYTES, at_least(0), "the largest gzip'd raw trace a rank keeps and uploads "
    "per capture (its summary is always sent); a larger upload is answered 413", metavar="BYTES",
    zero="no raw trace is kept, summaries only")
CAPTURE_DEADLINE: Setting[float] = Setting(
    "capture_deadline_s", "--capture-deadline", env.TRACEML_PROCESSOR_CAPTURE_DEADLINE, 120.0, seconds(0),
    "a capture fails, saying which rank did not answer, when no rank took it this long after it was asked "
    "or a rank's answer is missing this long after that rank took it", metavar="SECONDS")
LOG_LEVEL: Setting[str] = Setting(
    "log_level", "--log-level", None, "INFO", Choice(("DEBUG", "INFO", "WARNING", "ERROR"), case="upper"),
    "log lines go to stderr from this level")

SETTINGS: tuple[Setting, ...] = (
    DB, OTLP_GRPC, OTLP_HTTP, PROMETHEUS, UI, EXPORT_ENDPOINT, EXPORT_PROTOCOL, EXPORT_INTERVAL, EXPORT_TIMEOUT,
    SUMMARY_DIR, IDLE_TIMEOUT, REFRESH_INTERVAL, AUTH_TOKEN_FILE, AUTH_TOKEN, TLS_CERT, TLS_KEY, MAX_RUNS,
    MAX_RANKS_PER_RUN, WORKERS, MAPPING_FILE, RANK_SERIES_TOP_K, REPEAT_OFFENDER_RUNS, REPEAT_OFFENDER_WINDOW,
    FLEET_PERIOD, MAX_SERIES, MAX_CONCURRENT_REQUESTS, HTTP_HEADER_TIMEOUT,
    HTTP_BODY_TIMEOUT, HTTP_BODY_CHUNK_TIMEOUT, HTTP_KEEPALIVE_TIMEOUT, HTTP_MAX_CONNECTIONS, CAPTURE,
    CAPTURE_STEPS, CAPTURE_COOLDOWN, CAPTURE_MAX_TRACE_BYTES, CAPTURE_DEADLINE, LOG_LEVEL)

CAPTURE_WATCH_INTERVAL_S = 5.0
"""With --capture auto, how often a run with new rows is analysed although nobody reads its figures:
the diagnosis can only ask for a capture after an analysis. Not 2 s: an analysis of a 2-rank run
costs the processor about 10 ms, so a 2 s watch alone was about 0.5 % of a core per run (issue 37
holds the processor's background cost); a straggler confirmed over 20 steps is still there 5 s
later. A run a scrape or the summary push reads is analysed at their pace and never waits for this
(`traceml run`'s live view and the web view read through sessions of their own: they do not)."""

CAPTURE_WATCH_MAX_INTERVAL_S = 30.0
"""The longest the watch waits between analyses of a run whose last one found nothing a capture
could be asked for over a window long enough to confirm a finding (`bears_watching`): each such
analysis doubles the run's interval from CAPTURE_WATCH_INTERVAL_S up to this; an analysis that
names a culprit, or a window still too short, takes it back to the start. A balanced run then
costs one analysis every 30 s instead of every 5 s, and a straggler that appears late in a long
balanced run is looked at within 30 s of its rows (issue 37)."""

# --- internal sizes: no flag, stated here so that their users share one value ------------

MAX_PENDING_RECORDS = 200_000
"""Records the ingest queue holds before it answers "retry later" (gRPC UNAVAILABLE, HTTP 429)."""
GRPC_THREADS = 8
"""Threads of each gRPC receiver."""


# --- resolution ----------------------------------------------------------------------------


class ProcessorSettings:
    """Every setting's value, and where it came from; read with a declaration: `settings[IDLE_TIMEOUT]`.

    A bad value of a standard `OTEL_EXPORTER_OTLP_*` variable is kept as its error
    and raised when the setting is read, which only the summary push does: those
    variables are shared with whatever else runs in the environment, and one the
    processor does not use is no reason to refuse to start.
    """

    def __init__(self, values: Mapping[str, object], sources: Mapping[str, str],
                 errors: Mapping[str, SettingError] | None = None):
        self._values = dict(values)
        self._sources = dict(sources)
        self._errors = dict(errors or {})

    def __getitem__(self, setting: Setting[T]) -> T:
        if setting.name in self._errors:
            raise self._errors[setting.name]
        return self._values[setting.name]  # type: ignore[return-value]

    def source(self, setting: Setting) -> str:
        """The flag or variable that gave the value, or `default`."""
        return self._sources[setting.name]


def resolve(flags: Mapping[str, str | None] | None = None,
            environ: Mapping[str, str] | None = None) -> ProcessorSettings:
    """Flags (raw text by `Setting.name`, None when not given), else variables, else defaults.

    Raises SettingError, naming the flag or variable, the value and the range,
    for the first value that is not valid.
    """
    import os

    flags = flags or {}
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    errors: dict[str, SettingError] = {}
    for setting in SETTINGS:
        raw = flags.get(setting.name)
        if raw is not None and setting.flag:
            values[setting.name], sources[setting.name] = setting.parse(raw, setting.flag), setting.flag
            continue
        for name in setting.variables:
            text = environ.get(name)
            if text is not None and text.strip():
                sources[setting.name] = name
                try:
                    values[setting.name] = setting.parse(text, name)
                except SettingError as exc:
                    if name == setting.variable:  # TraceML's own: always judged
                        raise
                    errors[setting.name] = exc  # a standard OTLP variable: judged when the push reads it
                break
        else:
            values[setting.name], sources[setting.name] = setting.default, "default"
    return ProcessorSettings(values, sources, errors)


def summary_export_config(settings: ProcessorSettings, environ: Mapping[str, str] | None = None):
    """The summary push's `SummaryExportConfig`, or None when no endpoint is configured (or it is off).

    The processor's own endpoint (flag or `TRACEML_PROCESSOR_EXPORT_ENDPOINT`) is a
    base URL passed to the exporter; a standard endpoint variable only turns the
    push on and is left to the OpenTelemetry exporter, which reads it by the
    specification (a per-signal URL used as it is).
    """
    import os

    from traceml.processor.summary_export import SummaryExportConfig
    from traceml.schema.otlp_headers import parse_otlp_headers

    environ = os.environ if environ is None else environ
    endpoint = settings[EXPORT_ENDPOINT]
    if endpoint is None:
        return None
    own = settings.source(EXPORT_ENDPOINT) in (EXPORT_ENDPOINT.flag, EXPORT_ENDPOINT.variable)
    protocol = settings[EXPORT_PROTOCOL]
    if protocol is None:
        protocol = "http/protobuf" if endpoint.rstrip("/").endswith("/v1/metrics") else "grpc"
    headers = env.otlp_value(environ, "HEADERS", "metrics")
    return SummaryExportConfig(
        endpoint=endpoint if own else None,  # None: the exporter resolves the OTEL_* endpoint by the spec
        protocol=protocol,
        headers=dict(parse_otlp_headers(headers[1] if headers else None)),
        timeout_s=settings[EXPORT_TIMEOUT],
        interval_s=settings[EXPORT_INTERVAL],
    )
