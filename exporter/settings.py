"""Exporter settings: arguments first, then the standard OTEL_* variables, then defaults.

Every variable read here is declared in `traceml.schema.environment` and listed in
`docs/configuration.md`. The OTLP exporter specification is followed by the
letter, per signal: traces (step spans, the run-end marker) and metrics (the
telemetry counters) each take every option from its per-signal variable
(`OTEL_EXPORTER_OTLP_TRACES_*`, `..._METRICS_*`), else the generic one, else the
default (`environment.otlp_candidates` owns that order), so the two signals may go
to different endpoints over different protocols. TraceML's own `TRACEML_OTLP_ENDPOINT`,
`_PROTOCOL` and `_HEADERS` come before all of them (`environment.exporter_candidates`):
`traceml run` sets those, so the job's own OpenTelemetry SDK, which reads only
`OTEL_*`, keeps its destination. Export starts when an argument or any of the
endpoint variables gives an endpoint; a signal without one of its own then goes to
the specification's default (`http://localhost:4317`, or
`http://localhost:4318/v1/<signal>` over HTTP).

A value that is unknown or invalid is warned about once and ignored (the next
source or the default applies, `traceml.schema.env_values`): a typo never turns
export off for the run. Two variables have their own, specified policy:
`OTEL_EXPORTER_OTLP_HEADERS` (per-signal forms too) is read by the parser both
sides share (`traceml.schema.otlp_headers`), which skips a malformed entry with a
warning; a malformed `OTEL_RESOURCE_ATTRIBUTES` is discarded whole with an error
logged, as the OpenTelemetry resource SDK specification says.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, TypeVar
from urllib.parse import urlparse

from traceml.schema import env_values
from traceml.schema import environment as env_names
from traceml.schema.key_value_list import key_value_entries
from traceml.schema.otlp_headers import parse_otlp_headers

_log = logging.getLogger("traceml.exporter")

PROTOCOL_GRPC = env_names.PROTOCOL_GRPC
PROTOCOL_HTTP = env_names.PROTOCOL_HTTP
PROTOCOLS = (PROTOCOL_GRPC, PROTOCOL_HTTP)
# `http` is a TraceML alias kept from the first release; `http/json` is not sent, and
# http/protobuf goes to the same URL instead (OTLP/HTTP servers accept both there).
_PROTOCOL_SPELLINGS = {PROTOCOL_GRPC: PROTOCOL_GRPC, PROTOCOL_HTTP: PROTOCOL_HTTP, "http": PROTOCOL_HTTP}
_HTTP_JSON = "http/json"
COMPRESSION_NONE = "none"
COMPRESSION_GZIP = "gzip"
COMPRESSIONS = (COMPRESSION_NONE, COMPRESSION_GZIP)

# Defaults, and why they differ from the specification's where they do:
DEFAULT_PROTOCOL = PROTOCOL_GRPC  # TraceML's default since its first release (the spec allows keeping it)
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
DEFAULT_HTTP_BASE = "http://localhost:4318"
DEFAULT_TIMEOUT_S = 10.0  # OTEL_EXPORTER_OTLP_TIMEOUT's own default
DEFAULT_PROCESSOR_TIMEOUT_S = 30.0  # OTEL_BSP_EXPORT_TIMEOUT / OTEL_METRIC_EXPORT_TIMEOUT's default
DEFAULT_QUEUE_SIZE = 8192  # not the BSP's 2048: a burst of steps at start-up must not drop
DEFAULT_MAX_BATCH = 512  # the BSP's
DEFAULT_EXPORT_INTERVAL_S = 1.0  # not the BSP's 5 s: a live view wants a step within a second of its end
DEFAULT_TELEMETRY_INTERVAL_S = 10.0  # not the reader's 60 s: drop counters should show while a run is young
MIN_INTERVAL_S = 0.01  # a 0 ms delay (valid by the spec) would spin the export thread
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
DEFAULT_CONTROL_POLL_INTERVAL_S = 2.0  # deep capture: a request waits at most this (plus a round) for its rank
MIN_CONTROL_POLL_INTERVAL_S = 0.1

_HTTP_PATHS = {"traces": "v1/traces", "metrics": "v1/metrics"}
_GRPC_TARGET_SCHEMES = frozenset({"dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock"})


@dataclass(frozen=True)
class SignalSettings:
    """Where and how one signal (traces or metrics) is sent, resolved.

    `endpoint` is, over OTLP/HTTP, the URL requests are POSTed to (the signal path
    already appended to a generic endpoint); over gRPC, the endpoint as given
    (`http(s)://host:port`, or a scheme-less `host:port`).
    """

    endpoint: str
    protocol: str = DEFAULT_PROTOCOL
    headers: tuple[tuple[str, str], ...] = ()
    timeout_s: float = DEFAULT_TIMEOUT_S
    compression: str = COMPRESSION_NONE
    insecure: bool = False
    certificate_file: str | None = None
    client_key_file: str | None = None
    client_certificate_file: str | None = None

    @property
    def uses_tls(self) -> bool:
        """`https` is TLS and `http` is plaintext, whatever `insecure` says; only a gRPC endpoint
        without either scheme is decided by `insecure` (default false, so TLS), as the spec says."""
        scheme = _scheme(self.endpoint)
        if scheme in ("http", "https"):
            return scheme == "https"
        return not self.insecure

    @property
    def grpc_target(self) -> str:
        """`host:port` for grpcio: the URL's authority, or a scheme-less endpoint as it is."""
        if _scheme(self.endpoint) in ("http", "https"):
            return urlparse(self.endpoint).netloc
        return self.endpoint


@dataclass(frozen=True)
class ExporterSettings:
    """How one rank exports: per-signal destinations plus the exporter's queue, batch and intervals."""

    traces: SignalSettings
    metrics: SignalSettings
    service_name: str | None = None
    resource_attributes: Mapping[str, str] = field(default_factory=dict)
    phase_spans: bool = True
    queue_size: int = DEFAULT_QUEUE_SIZE
    max_batch: int = DEFAULT_MAX_BATCH
    export_interval_s: float = DEFAULT_EXPORT_INTERVAL_S
    telemetry_interval_s: float = DEFAULT_TELEMETRY_INTERVAL_S
    control_endpoints: tuple[str, ...] = ()
    """Processor base URLs polled for deep-capture requests (TRACEML_CONTROL_ENDPOINT); () = off."""
    control_poll_interval_s: float = DEFAULT_CONTROL_POLL_INTERVAL_S

    def signal(self, name: str) -> SignalSettings:
        """The settings of signal `name` (`traces` or `metrics`)."""
        return self.traces if name == "traces" else self.metrics

    @property
    def timeout_s(self) -> float:
        """The longer of the two signals' timeouts: the exporter's bound on one export call;
        each transport call also stops at its own signal's timeout."""
        return max(self.traces.timeout_s, self.metrics.timeout_s)

    @property
    def endpoint(self) -> str:
        """Where telemetry goes, for log lines."""
        if self.traces.endpoint == self.metrics.endpoint:
            return self.traces.endpoint
        return f"{self.traces.endpoint} (traces), {self.metrics.endpoint} (metrics)"


def sdk_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """OTEL_SDK_DISABLED by the specification's Boolean rule: only `true` (any case) disables."""
    env = os.environ if environ is None else environ
    return env_values.otel_boolean(env_names.OTEL_SDK_DISABLED, env.get(env_names.OTEL_SDK_DISABLED))


T = TypeVar("T")
_Source = tuple[str, object]


def _first_valid(sources: list[_Source], read: Callable[[str, object], T | None]) -> tuple[T, str] | None:
    """The first source whose value `read` accepts (it warns about the ones it ignores), with its name."""
    for name, raw in sources:
        value = read(name, raw)
        if value is not None:
            return value, name
    return None


def _sources(argument, argument_name: str, env: Mapping[str, str], option: str, signal: str) -> list[_Source]:
    """An argument (code configuration wins over the environment), then TraceML's own variable, then
    the OTEL_* variables in spec order."""
    given = argument is not None and not (isinstance(argument, str) and not argument.strip())
    out: list[_Source] = [(argument_name, argument)] if given else []
    return out + list(env_names.exporter_candidates(env, option, signal))


def _scheme(endpoint: str) -> str:
    return endpoint.split("://", 1)[0].lower() if "://" in endpoint else ""


def _read_protocol(name: str, raw) -> str | None:
    value = str(raw).strip().lower()
    if value == _HTTP_JSON:
        env_values.warn_ignored(name, str(raw), "supported (http/json is not sent; http/protobuf is sent instead)")
        return PROTOCOL_HTTP
    return env_values.otel_enum(name, str(raw), _PROTOCOL_SPELLINGS)


def _endpoint_reader(protocol: str, signal: str) -> Callable[[str, object], str | None]:
    def read(name: str, raw) -> str | None:
        value = str(raw).strip()
        scheme = _scheme(value)
        if scheme in ("http", "https"):
            if not urlparse(value).netloc:
                env_values.warn_ignored(name, value, "an http:// or https:// URL with a host")
                return None
        elif protocol != PROTOCOL_GRPC or (scheme and scheme not in _GRPC_TARGET_SCHEMES) or not value \
                or any(c.isspace() for c in value):
            # gRPC also takes grpcio's own target forms (`host:port`, `dns:///...`, `unix:...`).
            env_values.warn_ignored(name, value, "an http:// or https:// URL (or, for gRPC, host:port)")
            return None
        if protocol == PROTOCOL_GRPC:
            return value
        if name.startswith(f"OTEL_EXPORTER_OTLP_{signal.upper()}_"):
            # A per-signal URL is used as it is; only an empty path becomes `/`.
            return value if urlparse(value).path else value + "/"
        return value.rstrip("/") + "/" + _HTTP_PATHS[signal]
    return read


def _read_seconds_argument(name: str, raw) -> float | None:
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        seconds = 0.0
    if seconds <= 0:
        env_values.warn_ignored(name, str(raw), "a positive number of seconds")
        return None
    return seconds


def _read_timeout_variable(name: str, raw: str | None) -> float | None:
    ms = env_values.timeout_ms(name, raw)
    return None if ms is None else ms / 1000.0


def _read_compression(name: str, raw) -> str | None:
    return env_values.otel_enum(name, str(raw), {c: c for c in COMPRESSIONS})


def _read_path(name: str, raw) -> str | None:
    value = str(raw).strip()
    return value or None


def _signal_settings(signal: str, env: Mapping[str, str], *, endpoint, protocol, headers, timeout_s,
                     compression) -> tuple[SignalSettings, bool]:
    """One signal's settings, and whether its endpoint was configured (not the default)."""
    found = _first_valid(_sources(protocol, "protocol argument", env, "PROTOCOL", signal), _read_protocol)
    proto = found[0] if found else DEFAULT_PROTOCOL

    found = _first_valid(_sources(endpoint, "endpoint argument", env, "ENDPOINT", signal),
                         _endpoint_reader(proto, signal))
    configured = found is not None
    if found:
        url = found[0]
    else:
        url = DEFAULT_GRPC_ENDPOINT if proto == PROTOCOL_GRPC else f"{DEFAULT_HTTP_BASE}/{_HTTP_PATHS[signal]}"

    if headers is not None:
        header_items = tuple((str(k).lower(), str(val)) for k, val in headers.items())
    else:
        raw_headers = env_names.exporter_value(env, "HEADERS", signal)
        header_items = parse_otlp_headers(raw_headers[1] if raw_headers else None)

    argument = [] if timeout_s is None else [("timeout_s argument", timeout_s)]
    found = (_first_valid(argument, _read_seconds_argument)
             or _first_valid(_sources(None, "", env, "TIMEOUT", signal), _read_timeout_variable))
    exporter_timeout = found[0] if found else DEFAULT_TIMEOUT_S
    # The batch span processor's / periodic metric reader's export timeout bounds the same export.
    processor_variable = (env_names.OTEL_BSP_EXPORT_TIMEOUT if signal == "traces"
                          else env_names.OTEL_METRIC_EXPORT_TIMEOUT)
    processor_timeout = _read_timeout_variable(processor_variable, env.get(processor_variable))

    found = _first_valid(_sources(compression, "compression argument", env, "COMPRESSION", signal),
                         _read_compression)

    insecure_source = env_names.otlp_value(env, "INSECURE", signal)
    files = {}
    for option in ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE"):
        path = _first_valid(_sources(None, "", env, option, signal), _read_path)
        files[option] = path[0] if path else None

    return SignalSettings(
        endpoint=url,
        protocol=proto,
        headers=header_items,
        timeout_s=min(exporter_timeout, processor_timeout or DEFAULT_PROCESSOR_TIMEOUT_S),
        compression=found[0] if found else COMPRESSION_NONE,
        insecure=env_values.otel_boolean(*insecure_source) if insecure_source else False,
        certificate_file=files["CERTIFICATE"],
        client_key_file=files["CLIENT_KEY"],
        client_certificate_file=files["CLIENT_CERTIFICATE"],
    ), configured


def resolve_settings(
    endpoint: str | None = None,
    protocol: str | None = None,
    *,
    phase_spans: bool | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    compression: str | None = None,
    queue_size: int | None = None,
    environ: Mapping[str, str] | None = None,
    **overrides,
) -> ExporterSettings | None:
    """Settings for this process, or None when no endpoint is configured for either signal.

    Args:
        endpoint, protocol, headers, timeout_s, compression: code configuration for both
            signals; each wins over the environment (an invalid one is warned about and
            ignored, like a variable). `endpoint` is a base URL: over HTTP the signal path
            is appended, as for OTEL_EXPORTER_OTLP_ENDPOINT.
        queue_size, phase_spans, overrides: ExporterSettings fields, winning over their
            variables.
        environ: the environment to read (default `os.environ`).
    """
    env = os.environ if environ is None else environ
    resolved = {signal: _signal_settings(signal, env, endpoint=endpoint, protocol=protocol, headers=headers,
                                         timeout_s=timeout_s, compression=compression)
                for signal in env_names.OTLP_SIGNALS}
    if not any(configured for _, configured in resolved.values()):
        return None

    if phase_spans is None:
        phase_spans = env_names.env_flag(env.get(env_names.TRACEML_PHASE_SPANS), default=True)
    if queue_size is not None and queue_size < 1:
        env_values.warn_ignored("queue_size argument", str(queue_size), "a whole number >= 1")
        queue_size = None
    if queue_size is None:
        queue_size = _env_int(env, (env_names.TRACEML_EXPORT_QUEUE_SIZE, env_names.OTEL_BSP_MAX_QUEUE_SIZE),
                              env_values.positive_int, DEFAULT_QUEUE_SIZE)
    if "max_batch" not in overrides:
        overrides["max_batch"] = _max_batch(env, int(queue_size))
    if "export_interval_s" not in overrides:
        overrides["export_interval_s"] = _interval_s(env, env_names.OTEL_BSP_SCHEDULE_DELAY,
                                                     DEFAULT_EXPORT_INTERVAL_S)
    if "control_endpoints" not in overrides:
        overrides["control_endpoints"] = control_endpoints(env)
    if "control_poll_interval_s" not in overrides:
        overrides["control_poll_interval_s"] = _control_poll_interval_s(env)
    if "telemetry_interval_s" not in overrides:
        overrides["telemetry_interval_s"] = _interval_s(env, env_names.OTEL_METRIC_EXPORT_INTERVAL,
                                                        DEFAULT_TELEMETRY_INTERVAL_S)

    return ExporterSettings(
        traces=resolved["traces"][0],
        metrics=resolved["metrics"][0],
        service_name=(env.get(env_names.OTEL_SERVICE_NAME) or "").strip() or None,
        resource_attributes=parse_resource_attributes(env.get(env_names.OTEL_RESOURCE_ATTRIBUTES) or ""),
        phase_spans=bool(phase_spans),
        queue_size=int(queue_size),
        **overrides,
    )


def _env_int(env: Mapping[str, str], names: tuple[str, ...], read, default: int) -> int:
    """The first of `names` (TraceML's own first) holding a valid value, else `default`."""
    for name in names:
        value = read(name, env.get(name))
        if value is not None:
            return value
    return default


def _max_batch(env: Mapping[str, str], queue_size: int) -> int:
    """OTEL_BSP_MAX_EXPORT_BATCH_SIZE, which the spec requires to be <= the queue size."""
    name = env_names.OTEL_BSP_MAX_EXPORT_BATCH_SIZE
    batch = env_values.positive_int(name, env.get(name))
    if batch is not None and batch > queue_size:
        env_values.warn_ignored(name, env[name], f"<= the queue size ({queue_size})")
        batch = None
    return min(DEFAULT_MAX_BATCH, queue_size) if batch is None else batch


def _interval_s(env: Mapping[str, str], name: str, default_s: float) -> float:
    """A Duration variable in milliseconds, as seconds (floored at MIN_INTERVAL_S), else `default_s`."""
    ms = env_values.non_negative_int(name, env.get(name))
    return default_s if ms is None else max(MIN_INTERVAL_S, ms / 1000.0)


def control_endpoints(env: Mapping[str, str]) -> tuple[str, ...]:
    """TRACEML_CONTROL_ENDPOINT: comma-separated http(s) base URLs (each kept once, without a trailing
    `/`); an entry that is not one is warned about and skipped, the others stay."""
    name = env_names.TRACEML_CONTROL_ENDPOINT
    out: list[str] = []
    for entry in (env.get(name) or "").split(","):
        url = entry.strip().rstrip("/")
        if not url:
            continue
        parsed = urlparse(url)
        if parsed.scheme.lower() not in ("http", "https") or not parsed.netloc or parsed.query \
                or parsed.fragment or any(c.isspace() for c in url):
            env_values.warn_ignored(name, entry.strip(), "http:// or https:// base URLs, comma-separated")
            continue
        if url not in out:
            out.append(url)
    return tuple(out)


def _control_poll_interval_s(env: Mapping[str, str]) -> float:
    """TRACEML_CONTROL_POLL_INTERVAL in seconds (floored at MIN_CONTROL_POLL_INTERVAL_S), else the default."""
    seconds = env_values.positive_seconds(env_names.TRACEML_CONTROL_POLL_INTERVAL,
                                          env.get(env_names.TRACEML_CONTROL_POLL_INTERVAL),
                                          MIN_CONTROL_POLL_INTERVAL_S)
    return DEFAULT_CONTROL_POLL_INTERVAL_S if seconds is None else seconds


def parse_resource_attributes(raw: str) -> dict[str, str]:
    """OTEL_RESOURCE_ATTRIBUTES: `k1=v1,k2=v2`, keys and values percent-encoded.

    The resource SDK specification: on any error the entire value SHOULD be
    discarded and an error reported. So one malformed entry (no `=`, or an empty
    key) gives no attributes at all and one error log line naming its position;
    a key given twice keeps its last value.
    """
    out: dict[str, str] = {}
    for position, key, value in key_value_entries(raw):
        if value is None or not key:
            _log.error("%s: entry %d is not key=value; the variable is ignored",
                       env_names.OTEL_RESOURCE_ATTRIBUTES, position)
            return {}
        out[key] = value
    return out
