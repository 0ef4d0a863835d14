"""`OTEL_EXPORTER_OTLP_HEADERS`: the one parser both sides use (standard library only).

The OpenTelemetry exporter specification gives the value in the W3C Baggage
header format (`Authorization=Bearer%20abc,x-tenant=ml`), cut into entries by
`key_value_list`, which `OTEL_RESOURCE_ATTRIBUTES` shares. The training side's
exporter and the processor's summary export read the same variable, so they
read it the same way.

A malformed entry (no `=`, or a key that is not an HTTP header name) is logged
and skipped, and the rest are used: that is what the OpenTelemetry Python SDK
does with the same variable, and the user's own exporters in the same process
read it too, so one value means one thing there. The log line gives the
entry's position, never its text, which may hold a credential.
"""
from __future__ import annotations

import logging
import re

from traceml.schema.environment import OTEL_EXPORTER_OTLP_HEADERS
from traceml.schema.key_value_list import key_value_entries

LOG = logging.getLogger(__name__)

# An HTTP header name is an RFC 9110 token; gRPC metadata keys must be lower case.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # no header value may hold these (HTAB may)


def parse_otlp_headers(raw: str | None) -> tuple[tuple[str, str], ...]:
    """`k1=v1,k2=v2` -> `(("k1", "v1"), ("k2", "v2"))`: keys lower-cased, values percent-decoded.

    Args:
        raw: the variable's value; None or blank gives no headers. Empty entries
            (a trailing comma) are ignored; malformed ones are logged and skipped.

    Returns:
        The headers in the order given; a key given twice appears twice.
    """
    headers: list[tuple[str, str]] = []
    for position, key, value in key_value_entries(raw):
        key = key.lower()
        if value is None or not _TOKEN.fullmatch(key) or _CONTROL.search(value):
            LOG.warning("%s: entry %d is not key=value (a header name, then a value without control"
                        " characters); skipped", OTEL_EXPORTER_OTLP_HEADERS, position)
            continue
        headers.append((key, value))
    return tuple(headers)


__all__ = ["parse_otlp_headers"]
