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
