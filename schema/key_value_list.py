"""The `key=value,...` list format that OTEL_* variables share (standard library only).

`OTEL_RESOURCE_ATTRIBUTES` and `OTEL_EXPORTER_OTLP_HEADERS` are both given in the
W3C Baggage header format without properties: comma-separated entries, optional
whitespace around each key and value, keys and values percent-encoded (so a `,`
or `=` inside one is written `%2C` / `%3D`). This module only cuts such a value
into entries; what counts as a bad entry, and what a bad entry costs, differs per
variable and is decided by each variable's parser (`otlp_headers` skips the
entry, the exporter's resource parser refuses the whole variable).
"""
from __future__ import annotations

from typing import Iterator, NamedTuple
from urllib.parse import unquote


class KeyValueEntry(NamedTuple):
    """One non-blank entry of a list, trimmed, then percent-decoded."""

    position: int
    """1-based place among the comma-separated entries, blank ones counted: what a
    log line names instead of the entry's text, which may hold a credential."""
    key: str
    value: str | None
    """None when the entry has no `=` (an empty value is `""`)."""


def key_value_entries(raw: str | None) -> Iterator[KeyValueEntry]:
    """The entries of `raw` in order; blank entries (`a=1,,b=2`, a trailing comma) are left out.

    Args:
        raw: the variable's value; None or blank yields nothing.
    """
    for position, entry in enumerate((raw or "").split(","), start=1):
        if not entry.strip():
            continue
        key, eq, value = entry.partition("=")
        yield KeyValueEntry(position, unquote(key.strip()), unquote(value.strip()) if eq else None)


__all__ = ["KeyValueEntry", "key_value_entries"]
