"""The start hook `traceml.init()` calls: an exporter when an endpoint is configured, else None.

Never raises into the caller: an unreachable identity source (or anything else
unexpected) becomes one log line and training continues without export. A
malformed setting does not even get that far: it is warned about and ignored
(`settings`), and export starts with the default in its place.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping

from traceml.schema import environment as env_names

from .settings import resolve_settings, sdk_disabled
from .step_exporter import OtlpStepExporter

_log = logging.getLogger("traceml.exporter")
_hinted = False

NO_ENDPOINT_HINT = (
    "traceml: no OTLP endpoint configured, step telemetry stays in this process. "
    "To export it, set OTEL_EXPORTER_OTLP_ENDPOINT (e.g. http://collector:4317, "
    "OTEL_EXPORTER_OTLP_PROTOCOL=grpc|http/protobuf) or a per-signal "
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / _METRICS_ENDPOINT, pass traceml.init(endpoint=...), "
    "or start the job with `traceml run` for a local processor and diagnosis."
)


def _hint_once(message: str) -> None:
    global _hinted
    if not _hinted:
        _hinted = True
        _log.warning(message)


def start_from_settings(
    endpoint: str | None = None,
    protocol: str | None = None,
    *,
    run_id: str | None = None,
    strategy: str | None = None,
    phase_spans: bool | None = None,
    identity=None,
    environ: Mapping[str, str] | None = None,
    **settings_overrides,
) -> OtlpStepExporter | None:
    """Start an `OtlpStepExporter` for this rank, or return None (disabled, no endpoint, start failed)."""
    env = os.environ if environ is None else environ
    try:
        if sdk_disabled(env):
            _log.info("traceml: %s=true, OTLP export disabled", env_names.OTEL_SDK_DISABLED)
            return None
        settings = resolve_settings(endpoint, protocol, phase_spans=phase_spans, environ=env,
                                    **settings_overrides)
        if settings is None:
            if not env_names.env_flag(env.get(env_names.TRACEML_LAUNCHED)):
                _hint_once(NO_ENDPOINT_HINT)
            return None
        if identity is None:
            from .identity import resolve_identity
            identity = resolve_identity(run_id=run_id, strategy=strategy, environ=env)
        exporter = OtlpStepExporter(identity, settings)
        _log.info("traceml: exporting run %s rank %d: traces to %s over %s, metrics to %s over %s",
                  identity.run_id, identity.rank, settings.traces.endpoint, settings.traces.protocol,
                  settings.metrics.endpoint, settings.metrics.protocol)
        return exporter
    except Exception as exc:
        _log.error("traceml: OTLP export not started: %s", exc)
        return None
