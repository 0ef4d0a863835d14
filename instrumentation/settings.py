"""Training-side settings: arguments first, then TRACEML_* variables, then defaults.

Variable names are declared in `traceml.schema.environment`. Read when `traceml.init()`
runs; the kill switch also when the training side's state first loads
(`process_state`), so a `trace_step` before any `init()` is free when disabled. Every
reader of TRACEML_DISABLE goes through `kill_switch()`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from traceml.schema import env_values
from traceml.schema import environment as env_names

MODE_AUTO = "auto"
MODE_MANUAL = "manual"
MODES = (MODE_AUTO, MODE_MANUAL)


@dataclass(frozen=True)
class TrainingSettings:
    disabled: bool
    mode: str


def kill_switch(environ: Mapping[str, str] | None = None) -> bool:
    """True when TRACEML_DISABLE is set to 1/true/yes/on."""
    env = os.environ if environ is None else environ
    return env_names.env_flag(env.get(env_names.TRACEML_DISABLE))


def resolve_mode(mode: str | None, environ: Mapping[str, str] | None = None) -> str:
    """`mode` argument, else TRACEML_MODE, else `auto`; anything else is a ValueError."""
    env = os.environ if environ is None else environ
    source = "mode" if mode is not None else env_names.TRACEML_MODE
    value = mode if mode is not None else (env.get(env_names.TRACEML_MODE) or MODE_AUTO)
    value = value.strip().lower()
    if value not in MODES:
        raise ValueError(f"TraceML {source}={value!r}: use one of {list(MODES)}")
    return value


def read_settings(mode: str | None = None, environ: Mapping[str, str] | None = None) -> TrainingSettings:
    disabled = kill_switch(environ)
    if disabled:
        return TrainingSettings(disabled=True, mode=MODE_MANUAL)
    return TrainingSettings(disabled=False, mode=resolve_mode(mode, environ))


DEFAULT_RESOURCE_INTERVAL_S = 5.0
"""A few seconds: resource figures move slowly, and each sample costs the process a GIL hand-off."""
MIN_RESOURCE_INTERVAL_S = 0.1
"""A shorter interval (valid, but a sampler waking every few milliseconds takes the GIL from the
training thread as often) is raised to this."""


@dataclass(frozen=True)
class ResourceSettings:
    enabled: bool
    interval_s: float


def read_resource_settings(environ: Mapping[str, str] | None = None) -> ResourceSettings:
    """TRACEML_RESOURCES (on unless 0/false/no/off) and TRACEML_RESOURCE_INTERVAL (seconds).

    A value that is neither a switch spelling nor a positive number is warned about once
    and ignored, as every numeric TraceML variable is (`env_values`): the sampler keeps
    its default rather than the run losing its resource figures to a typo.
    """
    env = os.environ if environ is None else environ
    enabled = True
    raw = env.get(env_names.TRACEML_RESOURCES)
    if raw is not None and raw.strip():
        value = raw.strip().lower()
        if value in env_names.FALSE_VALUES:
            enabled = False
        elif value not in env_names.TRUE_VALUES:
            env_values.warn_ignored(env_names.TRACEML_RESOURCES, raw, "1/true/yes/on or 0/false/no/off")
    interval = env_values.positive_seconds(env_names.TRACEML_RESOURCE_INTERVAL,
                                           env.get(env_names.TRACEML_RESOURCE_INTERVAL), MIN_RESOURCE_INTERVAL_S)
    if interval is None:
        interval = DEFAULT_RESOURCE_INTERVAL_S
    return ResourceSettings(enabled=enabled, interval_s=interval)
