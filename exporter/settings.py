"""Exporter settings: arguments first, then the standard OTEL_* variables, then defaults.

Every variable read here is declared in `traceml.schema.environment`. Values are
validated once at start-up: a malformed one raises ValueError with its name, and
the start hook turns that into one log line (training goes on without export).
Two variables have their own, specified policy instead: `OTEL_EXPORTER_OTLP_HEADERS`
is read by the parser both sides share (`traceml.schema.otlp_headers`), which
skips a malformed entry with a warning; a malformed `OTEL_RESOURCE_ATTRIBUTES` is
discarded whole with an error logged, as the OpenTelemetry resource SDK
specification says, and export goes on without those attributes.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Mapping
from urllib.parse import urlparse

from traceml.schema import environment as env_names
from traceml.schema.key_value_list import key_value_entries
from traceml.schema.otlp_headers import parse_otlp_headers

_log = logging.getLogger("traceml.exporter")

PROTOCOL_GRPC = "grpc"
PROTOCOL_HTTP = "http/protobuf"
PROTOCOLS = (PROTOCOL_GRPC, PROTOCOL_HTTP)
COMPRESSIONS = ("none", "gzip")

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_QUEUE_SIZE = 8192
DEFAULT_MAX_BATCH = 512
DEFAULT_EXPORT_INTERVAL_S = 1.0
DEFAULT_TELEMETRY_INTERVAL_S = 10.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ExporterSettings:
    """Where and how one rank exports. `endpoint` is a URL (`http://host:4317`)."""

    endpoint: str
    protocol: str = PROTOCOL_GRPC
    headers: tuple[tuple[str, str], ...] = ()
    timeout_s: float = DEFAULT_TIMEOUT_S
    compression: str = "none"
    insecure: bool | None = None
    certificate_file: str | None = None
    service_name: str | None = None
    resource_attributes: Mapping[str, str] = field(default_factory=dict)
    phase_spans: bool = True
    queue_size: int = DEFAULT_QUEUE_SIZE
    max_batch: int = DEFAULT_MAX_BATCH
    export_interval_s: float = DEFAULT_EXPORT_INTERVAL_S
    telemetry_interval_s: float = DEFAULT_TELEMETRY_INTERVAL_S

    @property
    def uses_tls(self) -> bool:
        if self.insecure is not None:
            return not self.insecure
        return urlparse(self.endpoint).scheme == "https"

    def signal_url(self, signal_path: str) -> str:
        """OTLP/HTTP: base endpoint + `v1/traces` or `v1/metrics` (as the OTel spec says)."""
        return self.endpoint.rstrip("/") + "/" + signal_path

    @property
    def grpc_target(self) -> str:
        parsed = urlparse(self.endpoint)
        return parsed.netloc or self.endpoint


def sdk_disabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env_names.env_flag(env.get(env_names.OTEL_SDK_DISABLED))


def configured_endpoint(endpoint: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    value = endpoint if endpoint is not None else env.get(env_names.OTEL_EXPORTER_OTLP_ENDPOINT)
    value = (value or "").strip()
    return value or None


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
    """Settings for this process, or None when no endpoint is configured."""
    env = os.environ if environ is None else environ
    url = configured_endpoint(endpoint, env)
    if url is None:
        return None
    if "://" not in url:
        url = "http://" + url
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"OTLP endpoint {url!r} is not an http(s)://host:port URL")

    proto = (protocol or env.get(env_names.OTEL_EXPORTER_OTLP_PROTOCOL) or PROTOCOL_GRPC).strip().lower()
    if proto == "http":
        proto = PROTOCOL_HTTP
    if proto not in PROTOCOLS:
        raise ValueError(f"{env_names.OTEL_EXPORTER_OTLP_PROTOCOL}={proto!r}: use one of {list(PROTOCOLS)} "
                         "(http/json is not supported by the TraceML exporter)")

    if timeout_s is None:
        raw = env.get(env_names.OTEL_EXPORTER_OTLP_TIMEOUT)
        # The OpenTelemetry specification gives this variable in milliseconds.
        timeout_s = _positive_float(raw, env_names.OTEL_EXPORTER_OTLP_TIMEOUT) / 1000.0 if raw else DEFAULT_TIMEOUT_S
    if timeout_s <= 0:
        raise ValueError(f"export timeout must be positive, got {timeout_s}")

    comp = (compression or env.get(env_names.OTEL_EXPORTER_OTLP_COMPRESSION) or "none").strip().lower()
    if comp not in COMPRESSIONS:
        raise ValueError(f"{env_names.OTEL_EXPORTER_OTLP_COMPRESSION}={comp!r}: use one of {list(COMPRESSIONS)}")

    header_items = tuple(headers.items()) if headers is not None else parse_otlp_headers(
        env.get(env_names.OTEL_EXPORTER_OTLP_HEADERS))

    insecure_raw = env.get(env_names.OTEL_EXPORTER_OTLP_INSECURE)
    insecure = None if not insecure_raw else env_names.env_flag(insecure_raw)

    if phase_spans is None:
        phase_spans = env_names.env_flag(env.get(env_names.TRACEML_PHASE_SPANS), default=True)
    if queue_size is None:
        raw = env.get(env_names.TRACEML_EXPORT_QUEUE_SIZE)
        queue_size = int(_positive_float(raw, env_names.TRACEML_EXPORT_QUEUE_SIZE)) if raw else DEFAULT_QUEUE_SIZE
    if queue_size < 1:
        raise ValueError(f"queue size must be >= 1, got {queue_size}")

    return ExporterSettings(
        endpoint=url,
        protocol=proto,
        headers=header_items,
        timeout_s=float(timeout_s),
        compression=comp,
        insecure=insecure,
        certificate_file=env.get(env_names.OTEL_EXPORTER_OTLP_CERTIFICATE) or None,
        service_name=(env.get(env_names.OTEL_SERVICE_NAME) or "").strip() or None,
        resource_attributes=parse_resource_attributes(env.get(env_names.OTEL_RESOURCE_ATTRIBUTES) or ""),
        phase_spans=bool(phase_spans),
        queue_size=int(queue_size),
        **overrides,
    )


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


def _positive_float(raw: str, name: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value
