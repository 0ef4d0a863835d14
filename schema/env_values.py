"""Typed environment values, read by the OpenTelemetry environment-variable specification.

The specification types every standard variable: Boolean (only a case-insensitive
`true` is true), Duration and Timeout (an integer count of milliseconds, never
negative; a Timeout of 0 means no limit), Integer, Enum. A value that does not
parse, or lies outside its range, is warned about and ignored: treated as unset,
so the next source or the default applies. A bad value is never a reason to stop
exporting, let alone to stop training.

Each reader returns None for "unset or ignored" and leaves the default to its
caller, which knows it. The warning is logged once per variable and value: the
same setting is read by each signal and by every `traceml.init()`. The value is
named in the warning; these readers are not for variables that may hold a
credential (headers have their own parser, `otlp_headers`).

TraceML's own switches keep their looser boolean rule (`environment.env_flag`);
its numeric variables use these readers, so a bad value costs the same there.
Standard library only.
"""
from __future__ import annotations

import logging
import math
import threading
from typing import Mapping

LOG = logging.getLogger(__name__)

NO_LIMIT_MS = 2**31 - 1
"""What a Timeout of 0 ("indefinite") becomes: the specification allows "a very long time",
such as the largest 32-bit count of milliseconds, and it keeps deadline arithmetic finite."""

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def warn_ignored(name: str, raw: str, expected: str) -> None:
    """Log, once per (variable, value), that `raw` is not `expected` and is ignored."""
    with _warned_lock:
        if (name, raw) in _warned:
            return
        _warned.add((name, raw))
    LOG.warning("%s=%r is not %s; it is ignored and the default applies", name, raw, expected)


def _present(raw: str | None) -> str | None:
    """The stripped value, or None when unset or empty (the specification: empty is unset)."""
    if raw is None or not raw.strip():
        return None
    return raw.strip()


def otel_boolean(name: str, raw: str | None) -> bool:
    """A Boolean: True only for `true` in any case; anything else is False, with a warning
    unless it is `false`, empty or unset."""
    value = _present(raw)
    if value is None:
        return False
    lowered = value.lower()
    if lowered == "true":
        return True
    if lowered != "false":
        warn_ignored(name, raw, "true or false (read as false)")
    return False


def _int_at_least(name: str, raw: str | None, minimum: int) -> int | None:
    value = _present(raw)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        warn_ignored(name, raw, f"a whole number >= {minimum}")
        return None
    return number


def non_negative_int(name: str, raw: str | None) -> int | None:
    """An Integer or a Duration (milliseconds): a whole number >= 0, else None."""
    return _int_at_least(name, raw, 0)


def positive_int(name: str, raw: str | None) -> int | None:
    """An Integer whose valid values are positive (queue and batch sizes), else None."""
    return _int_at_least(name, raw, 1)


def positive_seconds(name: str, raw: str | None, floor_s: float) -> float | None:
    """TraceML's own interval variables: a positive number of seconds (at least `floor_s`,
    so a tiny value cannot spin a thread), else None with a warning unless unset or empty."""
    value = _present(raw)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not math.isfinite(seconds) or seconds <= 0:
        warn_ignored(name, raw, "a positive number of seconds")
        return None
    return max(floor_s, seconds)


TIMEOUT_EXPECTED = "a whole number >= 0"
"""What a Timeout variable accepts (milliseconds)."""


def timeout_ms_value(text: str) -> int:
    """A Timeout in milliseconds, strictly: 0 (no limit) becomes `NO_LIMIT_MS`.

    Raises ValueError (saying what is accepted) for anything but a whole number
    >= 0. For readers that stop on a bad value (the processor's start-up);
    `timeout_ms` is the same reading for those that warn and go on.
    """
    try:
        number = int(text.strip())
    except ValueError:
        raise ValueError(TIMEOUT_EXPECTED) from None
    if number < 0:
        raise ValueError(TIMEOUT_EXPECTED)
    return NO_LIMIT_MS if number == 0 else number


def timeout_ms(name: str, raw: str | None) -> int | None:
    """A Timeout in milliseconds; 0 (no limit) becomes `NO_LIMIT_MS`; invalid -> None (warned about)."""
    value = _present(raw)
    if value is None:
        return None
    try:
        return timeout_ms_value(value)
    except ValueError as exc:
        warn_ignored(name, raw, str(exc))
        return None


def otel_enum(name: str, raw: str | None, known: Mapping[str, str]) -> str | None:
    """An Enum, case-insensitive: `known` maps each accepted spelling to the value it means."""
    value = _present(raw)
    if value is None:
        return None
    meaning = known.get(value.lower())
    if meaning is None:
        warn_ignored(name, raw, "one of " + ", ".join(sorted(known)))
    return meaning


__all__ = ["NO_LIMIT_MS", "TIMEOUT_EXPECTED", "non_negative_int", "otel_boolean", "otel_enum", "positive_int",
           "timeout_ms", "timeout_ms_value", "warn_ignored"]
