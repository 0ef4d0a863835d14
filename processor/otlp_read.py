"""Export-request bodies -> OTLP request objects, keeping every part that can be read.

One OTLP request carries many resources: behind a Collector, TraceML's spans share
a batch with other services' telemetry. protobuf refuses a whole message when any
part of it is nested past its recursion limit (100 message levels in upb, i.e. an
attribute map nested ~33 deep) or is otherwise malformed, and so does
`json_format.ParseDict` (the same 100 levels); `json.loads` stops near Python's
recursion limit. So one neighbour's attribute map would sink TraceML's spans in
the same request.

The common case costs nothing extra: the body is parsed whole, once. Only when that
fails is it read part by part: the request's `resource_spans` (`resource_metrics`,
`resource_logs`) one by one, then within an unreadable one its scopes and spans
(metrics, log records), each
parsed on its own. protobuf's wire framing (a tag and a length before every
embedded message) lets the bytes be split without parsing what is inside; for
OTLP/JSON an iterative scanner finds the array elements without recursing. What
still cannot be read becomes an `UnreadablePart` naming where it was, which
service sent it (when its resource could be read) and how many spans or points it
held; the decoder rejects exactly those, with a partial-success reason. A body in
which nothing at all can be read is refused whole, as before (DecodeError /
ValueError).
"""
from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.logs.v1 import logs_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from traceml.processor.store_records import NESTED_TOO_DEEPLY, UNREADABLE
from traceml.schema import vocabulary as v

_ERROR_CHARS = 160
_DEPTH_MARKERS = ("MaxDepth", "too deep", "recursion")


@dataclass(frozen=True, slots=True)
class UnreadablePart:
    """One part of a request that could not be read, and what was lost with it."""

    path: str  # e.g. `resource_spans[1]`, `resource_spans[0].scope_spans[0].spans[3]`
    service: str | None  # `service.name` of its resource, when that could be read
    items: int  # spans (traces) or data points (metrics) inside it
    reason: str  # NESTED_TOO_DEEPLY or UNREADABLE
    error: str  # the parser's own words, shortened

    def describe(self, unit: str) -> str:
        who = f" (service.name {self.service[:64]!r})" if self.service is not None else ""
        return f"{self.path}{who}: {self.items} {unit} could not be read: {self.error}"


class PartlyReadable:
    """What could be read of a request the parser refused whole, and what could not.

    Stands in for the request: the decoder reads `resource_spans` / `resource_metrics`
    as usual, then `unreadable`.
    """

    __slots__ = ("request", "unreadable")

    def __init__(self, request, unreadable: list[UnreadablePart]):
        self.request = request
        self.unreadable = unreadable

    @property
    def resource_spans(self):
        return self.request.resource_spans

    @property
    def resource_metrics(self):
        return self.request.resource_metrics

    @property
    def resource_logs(self):
        return self.request.resource_logs


@dataclass(frozen=True)
class _Level:
    """One level of a request's nesting: its message type, the repeated field its parts
    sit in (None at the leaves: spans, metrics), and that field's JSON names."""

    cls: type
    field: str | None = None

    @property
    def number(self) -> int:
        return self.cls.DESCRIPTOR.fields_by_name[self.field].number

    @property
    def json_names(self) -> tuple[str, str]:
        f = self.cls.DESCRIPTOR.fields_by_name[self.field]
        return f.json_name, f.name


_TRACES = (_Level(trace_service_pb2.ExportTraceServiceRequest, "resource_spans"),
           _Level(trace_pb2.ResourceSpans, "scope_spans"), _Level(trace_pb2.ScopeSpans, "spans"),
           _Level(trace_pb2.Span))
_METRICS = (_Level(metrics_service_pb2.ExportMetricsServiceRequest, "resource_metrics"),
            _Level(metrics_pb2.ResourceMetrics, "scope_metrics"), _Level(metrics_pb2.ScopeMetrics, "metrics"),
            _Level(metrics_pb2.Metric))
_LOGS = (_Level(logs_service_pb2.ExportLogsServiceRequest, "resource_logs"),
         _Level(logs_pb2.ResourceLogs, "scope_logs"), _Level(logs_pb2.ScopeLogs, "log_records"),
         _Level(logs_pb2.LogRecord))
_LEVELS = {_TRACES[0].cls: _TRACES, _METRICS[0].cls: _METRICS, _LOGS[0].cls: _LOGS}
_DATA_KINDS = tuple(f for f in metrics_pb2.Metric.DESCRIPTOR.oneofs_by_name["data"].fields)
_DATA_NUMBERS = frozenset(f.number for f in _DATA_KINDS)
_DATA_JSON = tuple(name for f in _DATA_KINDS for name in (f.json_name, f.name))
_POINTS_NUMBER = metrics_pb2.Gauge.DESCRIPTOR.fields_by_name["data_points"].number  # 1 in every kind
_RESOURCE_NUMBER = trace_pb2.ResourceSpans.DESCRIPTOR.fields_by_name["resource"].number
_ATTRIBUTES_NUMBER = resource_pb2.Resource.DESCRIPTOR.fields_by_name["attributes"].number


def _reason(error: BaseException) -> str:
    text = str(error)
    return NESTED_TOO_DEEPLY if isinstance(error, RecursionError) or any(m in text for m in _DEPTH_MARKERS) \
        else UNREADABLE


_PARSE_CHAIN = re.compile(r"(?:Failed to parse \w+ field: )+")


def _short(error: BaseException) -> str:
    """The parser's message on one line; json_format's "Failed to parse x field: " chain
    (one per level) is cut so the cause at its end shows."""
    text = _PARSE_CHAIN.sub("", " ".join(str(error).split())).rstrip(".") or type(error).__name__
    return text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS] + "..."


# --- protobuf ---------------------------------------------------------------------------------


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise DecodeError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _wire_fields(buf: bytes) -> list[tuple[int, int, int, int, int]]:
    """The top-level fields of one encoded message, unparsed: (number, wire type, start of
    the field, start of its payload, end). Raises DecodeError on broken framing."""
    fields, pos, end = [], 0, len(buf)
    while pos < end:
        start = pos
        tag, pos = _varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise DecodeError("field number 0")
        if wire == 0:
            _, pos = _varint(buf, pos)
            payload = start
        elif wire == 1:
            payload, pos = pos, pos + 8
        elif wire == 2:
            size, payload = _varint(buf, pos)
            pos = payload + size
        elif wire == 5:
            payload, pos = pos, pos + 4
        else:
            raise DecodeError(f"unsupported wire type {wire}")
        if pos > end:
            raise DecodeError("truncated field")
        fields.append((number, wire, start, payload, pos))
    return fields


def _pb_count(buf: bytes, levels: tuple[_Level, ...]) -> int:
    """Spans (or data points) inside an encoded part, counted from the framing alone."""
    level = levels[0]
    try:
        fields = _wire_fields(buf)
    except DecodeError:
        return 1 if level.field is None else 0
    if level.field is None:
        if level.cls is not metrics_pb2.Metric:
            return 1
        points = 0
        for number, wire, _, payload, end in fields:
            if number in _DATA_NUMBERS and wire == 2:
                try:
                    points += sum(1 for n, w, *_ in _wire_fields(buf[payload:end]) if n == _POINTS_NUMBER and w == 2)
                except DecodeError:
                    pass
        return max(points, 1)
    number = level.number
    return sum(_pb_count(buf[payload:end], levels[1:]) for n, w, _, payload, end in fields
               if n == number and w == 2)


def _pb_service_name(head: bytes) -> str | None:
    """`service.name` of a ResourceSpans/ResourceMetrics whose resource would not parse whole,
    read from its attributes one by one."""
    try:
        for number, wire, _, payload, end in _wire_fields(head):
            if number != _RESOURCE_NUMBER or wire != 2:
                continue
            resource = head[payload:end]
            for n, w, _, p, e in _wire_fields(resource):
                if n != _ATTRIBUTES_NUMBER or w != 2:
                    continue
                try:
                    kv = common_pb2.KeyValue.FromString(resource[p:e])
                except (DecodeError, RecursionError):
                    continue
                if kv.key == v.RES_SERVICE_NAME and kv.value.WhichOneof("value") == "string_value":
                    return kv.value.string_value
    except DecodeError:
        pass
    return None


def _resource_service(message) -> str | None:
    resource = getattr(message, "resource", None)
    for kv in getattr(resource, "attributes", ()):
        if kv.key == v.RES_SERVICE_NAME and kv.value.WhichOneof("value") == "string_value":
            return kv.value.string_value
    return None


def _pb_part(buf: bytes, levels: tuple[_Level, ...], path: str, service: str | None,
             lost: list[UnreadablePart]):
    """One part parsed on its own; split further when it will not parse whole."""
    level = levels[0]
    try:
        return level.cls.FromString(buf)
    except (DecodeError, RecursionError) as exc:
        error = exc
    if level.field is None:
        lost.append(UnreadablePart(path, service, _pb_count(buf, levels), _reason(error), _short(error)))
        return None
    try:
        fields = _wire_fields(buf)
    except DecodeError as exc:
        lost.append(UnreadablePart(path, service, _pb_count(buf, levels), _reason(error), _short(exc)))
        return None
    number = level.number
    children = [buf[payload:end] for n, w, _, payload, end in fields if n == number and w == 2]
    head = b"".join(buf[start:end] for n, w, start, _, end in fields if not (n == number and w == 2))
    message = level.cls()
    try:
        message.ParseFromString(head)  # the resource (scope) and schema url: all or nothing
    except (DecodeError, RecursionError) as exc:
        name = service if service is not None else _pb_service_name(head)
        lost.append(UnreadablePart(path, name, sum(_pb_count(c, levels[1:]) for c in children),
                                   _reason(exc), _short(exc)))
        return None
    if service is None:
        service = _resource_service(message)
    target = getattr(message, level.field)
    for i, child in enumerate(children):
        part = _pb_part(child, levels[1:], f"{path}.{level.field}[{i}]", service, lost)
        if part is not None:
            target.append(part)
    return message


def _leaves(request, levels: tuple[_Level, ...]) -> int:
    """Spans (metrics) in a salvaged request: containers alone are not data."""
    top, rs_level, scope_level = levels[0], levels[1], levels[2]
    return sum(len(getattr(scope, scope_level.field)) for rs in getattr(request, top.field)
               for scope in getattr(rs, rs_level.field))


def read_otlp_protobuf(body: bytes, message_cls):
    """An OTLP/protobuf export request -> the request (the common case: parsed whole), or a
    `PartlyReadable` when some parts could not be read. Raises DecodeError (or
    RecursionError) when no span (metric) in it can be read."""
    request = message_cls()
    try:
        request.ParseFromString(body)
        return request
    except (DecodeError, RecursionError) as exc:
        error = exc
    levels = _LEVELS[message_cls]
    top = levels[0]
    request = message_cls()
    lost: list[UnreadablePart] = []
    number = top.number
    parts = [(payload, end) for n, w, _, payload, end in _wire_fields(body) if n == number and w == 2]
    target = getattr(request, top.field)
    for i, (payload, end) in enumerate(parts):
        part = _pb_part(body[payload:end], levels[1:], f"{top.field}[{i}]", None, lost)
        if part is not None:
            target.append(part)
    if not _leaves(request, levels):
        raise error  # nothing at all could be read: the body is refused whole, as before
    return PartlyReadable(request, lost)


# --- OTLP/JSON --------------------------------------------------------------------------------

_ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"})
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\],:]')


def _hex_ids_to_base64(node):
    """OTLP/JSON writes trace and span ids as hex; protobuf's JSON mapping wants base64."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _ID_KEYS and isinstance(value, str):
                try:
                    node[key] = base64.b64encode(bytes.fromhex(value)).decode("ascii")
                except ValueError as exc:
                    raise ValueError(f"{key} is not hex: {value[:40]!r}") from exc
            else:
                _hex_ids_to_base64(value)
    elif isinstance(node, list):
        for item in node:
            _hex_ids_to_base64(item)


def _with_base64_ids(node):
    """A copy of `node` with hex ids rewritten (a part read on its own: `node` stays as it was,
    so a part that fails can still be split and its children read)."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key in _ID_KEYS and isinstance(value, str):
                try:
                    out[key] = base64.b64encode(bytes.fromhex(value)).decode("ascii")
                except ValueError as exc:
                    raise ValueError(f"{key} is not hex: {value[:40]!r}") from exc
            else:
                out[key] = _with_base64_ids(value)
        return out
    if isinstance(node, list):
        return [_with_base64_ids(item) for item in node]
    return node


class _Text(str):
    """A JSON value not parsed yet (json.loads would recurse too deep on the whole)."""


def _json_split(text: str):
    """The top-level items of one JSON object or array, without recursion:
    ('{', [(key, value text)...]) or ('[', [element text...]). Raises ValueError."""
    stripped = text.lstrip()
    if not stripped or stripped[0] not in "{[":
        raise ValueError("not a JSON object or array")
    kind, depth, items, key, start = stripped[0], 0, [], None, 0

    def close(end: int) -> None:
        item = stripped[start:end].strip()
        if not item:
            return
        if kind == "{":
            if key is None:
                raise ValueError("object member without a key")
            items.append((key, _Text(item)))
        else:
            items.append(_Text(item))

    for match in _JSON_TOKEN.finditer(stripped):
        token = match.group()
        c = token[0]
        if c in "{[":
            depth += 1
            if depth == 1:
                start = match.end()
        elif c in "}]":
            depth -= 1
            if depth == 0:
                close(match.start())
                return kind, items
        elif depth == 1 and c == ",":
            close(match.start())
            key, start = None, match.end()
        elif depth == 1 and c == ":" and kind == "{":
            key = json.loads(stripped[start:match.start()])
            start = match.end()
    raise ValueError("unterminated JSON value")


def _json_load(node):
    return json.loads(node) if isinstance(node, _Text) else node


def _json_members(node) -> list[tuple[str, object]]:
    if isinstance(node, _Text):
        kind, items = _json_split(node)
        if kind != "{":
            raise ValueError("expected a JSON object")
        return items
    if not isinstance(node, dict):
        raise ValueError(f"expected a JSON object, got {type(node).__name__}")
    return list(node.items())


def _json_elements(node) -> list:
    if isinstance(node, _Text):
        kind, items = _json_split(node)
        if kind != "[":
            raise ValueError("expected a JSON array")
        return items
    if not isinstance(node, list):
        raise ValueError(f"expected a JSON array, got {type(node).__name__}")
    return node


def _json_parse(node, cls):
    from google.protobuf import json_format

    document = _json_load(node)
    if not isinstance(document, dict):
        raise ValueError(f"expected a JSON object, got {type(document).__name__}")
    message = cls()
    json_format.ParseDict(_with_base64_ids(document), message, ignore_unknown_fields=True)
    return message


def _json_count(node, levels: tuple[_Level, ...]) -> int:
    level = levels[0]
    try:
        members = _json_members(node)
        if level.field is None:
            if level.cls is not metrics_pb2.Metric:
                return 1
            points = 0
            for key, value in members:
                if key in _DATA_JSON:
                    for k, val in _json_members(value):
                        if k in ("dataPoints", "data_points"):
                            points += len(_json_elements(val))
            return max(points, 1)
        names = level.json_names
        return sum(_json_count(child, levels[1:]) for key, value in members if key in names
                   for child in _json_elements(value))
    except _JSON_ERRORS:
        return 1 if level.field is None else 0


def _json_service_name(members) -> str | None:
    try:
        for key, value in members:
            if key != "resource":
                continue
            for k, attrs in _json_members(value):
                if k != "attributes":
                    continue
                for kv in _json_elements(attrs):
                    try:
                        kv = _json_load(kv)
                    except (ValueError, RecursionError):
                        continue
                    if isinstance(kv, dict) and kv.get("key") == v.RES_SERVICE_NAME:
                        value_doc = kv.get("value")
                        if isinstance(value_doc, dict) and isinstance(value_doc.get("stringValue"), str):
                            return value_doc["stringValue"]
    except (ValueError, RecursionError):
        pass
    return None


def _json_errors() -> tuple[type[BaseException], ...]:
    from google.protobuf import json_format

    return (ValueError, RecursionError, TypeError, AttributeError, json_format.ParseError)


_JSON_ERRORS = _json_errors()


def _json_part(node, levels: tuple[_Level, ...], path: str, service: str | None, lost: list[UnreadablePart]):
    level = levels[0]
    try:
        return _json_parse(node, level.cls)
    except _JSON_ERRORS as exc:  # json_format.ParseError is a ValueError
        error = exc
    if level.field is None:
        lost.append(UnreadablePart(path, service, _json_count(node, levels), _reason(error), _short(error)))
        return None
    try:
        members = _json_members(node)
    except _JSON_ERRORS as exc:
        lost.append(UnreadablePart(path, service, _json_count(node, levels), _reason(error), _short(exc)))
        return None
    names = level.json_names
    children = [value for key, value in members if key in names]
    try:
        head = {key: _json_load(value) for key, value in members if key not in names}
        message = _json_parse(head, level.cls)
        elements = [child for value in children for child in _json_elements(value)]
    except _JSON_ERRORS as exc:
        name = service if service is not None else _json_service_name(members)
        count = sum(_json_count(child, levels[1:]) for value in children
                    for child in _safe_elements(value))
        lost.append(UnreadablePart(path, name, count, _reason(exc), _short(exc)))
        return None
    if service is None:
        service = _resource_service(message)
    target = getattr(message, level.field)
    for i, child in enumerate(elements):
        part = _json_part(child, levels[1:], f"{path}.{level.field}[{i}]", service, lost)
        if part is not None:
            target.append(part)
    return message


def _safe_elements(node) -> list:
    try:
        return _json_elements(node)
    except _JSON_ERRORS:
        return []


def parse_otlp_json(body: bytes, message):
    """Fill protobuf `message` from an OTLP/JSON body (unknown fields ignored) and return it,
    or return a `PartlyReadable` when some resources could not be read. Raises ValueError
    when the body is not OTLP/JSON or nothing in it can be read."""
    from google.protobuf import json_format  # here: the read side imports this module's cap

    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"body is not JSON: {exc}") from exc
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"body is not JSON: {exc}") from exc
    except RecursionError as exc:
        document, first_error = _Text(text), exc  # too deep somewhere: read it part by part
    else:
        if not isinstance(document, dict):
            raise ValueError("OTLP/JSON body must be an object")
        try:
            _hex_ids_to_base64(document)  # in place: the common case copies nothing
            json_format.ParseDict(document, message, ignore_unknown_fields=True)
            return message
        except (json_format.ParseError, ValueError, RecursionError) as exc:
            first_error = exc
        message.Clear()
        document = json.loads(text)  # afresh: the ids above were rewritten in place
    salvaged = _json_salvage(document, type(message))
    if salvaged is None:
        if isinstance(first_error, RecursionError):
            raise ValueError("OTLP/JSON body is nested too deeply") from None
        raise ValueError(f"not an OTLP/JSON request: {first_error}") from first_error
    return salvaged


def _json_salvage(document, message_cls) -> PartlyReadable | None:
    levels = _LEVELS[message_cls]
    top = levels[0]
    try:
        members = _json_members(document)
        parts = [child for key, value in members if key in top.json_names for child in _json_elements(value)]
    except _JSON_ERRORS:
        return None
    request = message_cls()
    lost: list[UnreadablePart] = []
    target = getattr(request, top.field)
    for i, child in enumerate(parts):
        part = _json_part(child, levels[1:], f"{top.field}[{i}]", None, lost)
        if part is not None:
            target.append(part)
    if not _leaves(request, levels):
        return None
    return PartlyReadable(request, lost)


def otlp_json_response(response) -> bytes:
    """A partial-success response as OTLP/JSON (lowerCamelCase, defaults omitted)."""
    from google.protobuf import json_format

    return json_format.MessageToJson(response, indent=None).encode()


__all__ = ["NESTED_TOO_DEEPLY", "UNREADABLE", "PartlyReadable", "UnreadablePart", "otlp_json_response",
           "parse_otlp_json", "read_otlp_protobuf"]
