"""Generated OTLP requests with a known right answer, and a client that sends them.

Every bad span or data point carries exactly one defect whose refusal reason is
known from the documented bad-input table (docs/processor.md), so the oracle is
the contract, not the decoder: each request's partial-success count and reasons
must match, and every valid record beside the bad ones must be in SQLite.

Used by tests/reliability/test_bad_input_fuzz.py (CI size) and
checks/fuzz.py (longer).
"""
from __future__ import annotations

import base64
import gzip
import http.client
import json
import math
import re
import socket
import zlib
from collections import Counter
from dataclasses import dataclass, field

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_svc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_svc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2 as metric_data
from opentelemetry.proto.trace.v1 import trace_pb2 as span_data

from harness.reliability import reliability_helpers as h
from traceml.schema import vocabulary as v

# Reasons as documented in docs/processor.md ("Behaviour on bad input").
MISSING_RUN_ID, MISSING_RANK, MISSING_STEP = "missing_run_id", "missing_rank", "missing_step"
MISSING_TIMESTAMP, WRONG_TYPE, NON_FINITE = "missing_timestamp", "wrong_attribute_type", "non_finite_value"
NEGATIVE, ABSURD, NO_EVENTS = "negative_value", "absurd_value", "no_events"
TOO_LARGE, TOO_MANY = "attribute_too_large", "too_many_attributes"

# Run ids of the mixed requests: SQL metacharacters, path traversal, unicode, padding.
RUN_POOL = (
    "fuzz-a",
    "fuzz'; DROP TABLE step_time_samples; --",
    "../../../../etc/passwd",
    "runs/%2e%2e/ünïcødé ✓",
    "  padded run\t",
    'quote"s and \\ back\\slash',
)
CPU = v.event_attribute(v.RAW_FORWARD, v.EVENT_FIELD_CPU)
GPU = v.event_attribute(v.RAW_FORWARD, v.EVENT_FIELD_GPU)
COUNT = v.event_attribute(v.RAW_FORWARD, v.EVENT_FIELD_COUNT)


def _set(key, value):
    def apply(attrs, ts):
        attrs[key] = value
    return apply


def _drop_events(attrs, ts):
    for key in [k for k in attrs if k.startswith(v.EVENT_ATTR_PREFIX)]:
        del attrs[key]


def _many(attrs, ts):
    for i in range(600):
        attrs[f"extra.{i}"] = i


def _ts(**values):
    def apply(attrs, ts):
        ts.update(values)
    return apply


_ARRAY = common_pb2.AnyValue(array_value=common_pb2.ArrayValue(values=[common_pb2.AnyValue(int_value=1)]))
_KVLIST = common_pb2.AnyValue(kvlist_value=common_pb2.KeyValueList(values=[common_pb2.KeyValue(key="a")]))

# One defect per span: name -> (documented reason, mutation of (attributes, timestamps)).
SPAN_MUTATIONS = {
    "no_step": (MISSING_STEP, lambda a, t: a.pop(v.ATTR_STEP)),
    "step_string": (WRONG_TYPE, _set(v.ATTR_STEP, "12")),
    "step_double": (WRONG_TYPE, _set(v.ATTR_STEP, 12.0)),
    "step_bool": (WRONG_TYPE, _set(v.ATTR_STEP, True)),
    "step_kvlist": (WRONG_TYPE, _set(v.ATTR_STEP, _KVLIST)),
    "step_negative": (NEGATIVE, _set(v.ATTR_STEP, -5)),
    "step_over_2_53": (ABSURD, _set(v.ATTR_STEP, 2**53 + 1)),
    "step_int64_max": (ABSURD, _set(v.ATTR_STEP, 2**63 - 1)),
    "cpu_nan": (NON_FINITE, _set(CPU, math.nan)),
    "cpu_inf": (NON_FINITE, _set(CPU, math.inf)),
    "cpu_minus_inf": (NON_FINITE, _set(CPU, -math.inf)),
    "gpu_nan": (NON_FINITE, _set(GPU, math.nan)),
    "cpu_negative": (NEGATIVE, _set(CPU, -1.5)),
    "cpu_huge": (ABSURD, _set(CPU, 1e12)),
    "cpu_max_double": (ABSURD, _set(CPU, 1.7976931348623157e308)),
    "cpu_string": (WRONG_TYPE, _set(CPU, "30.0")),
    "cpu_bool": (WRONG_TYPE, _set(CPU, False)),
    "cpu_array": (WRONG_TYPE, _set(CPU, _ARRAY)),
    "cpu_empty_value": (WRONG_TYPE, _set(CPU, None)),
    "count_double": (WRONG_TYPE, _set(COUNT, 1.0)),
    "count_negative": (NEGATIVE, _set(COUNT, -1)),
    "count_huge": (ABSURD, _set(COUNT, 10**8)),
    "no_events": (NO_EVENTS, _drop_events),
    "zero_start": (MISSING_TIMESTAMP, _ts(start=0)),
    "zero_end": (MISSING_TIMESTAMP, _ts(end=0)),
    "end_before_start": (NEGATIVE, _ts(swap=True)),
    "long_string_value": (TOO_LARGE, _set("user.note", "x" * 5000)),
    "long_key": (TOO_LARGE, _set("k" * 5000, 1)),
    "too_many_attributes": (TOO_MANY, _many),
    "span_rank_string": (WRONG_TYPE, _set(v.ATTR_RANK, "0")),
    "span_rank_negative": (NEGATIVE, _set(v.ATTR_RANK, -1)),
}


def _res_set(key, value):
    def apply(res, span_attrs):
        res[key] = value
    return apply


def _res_no_run(res, span_attrs):
    res.pop(v.ATTR_RUN_ID, None)


def _res_no_rank(res, span_attrs):
    for key in (v.ATTR_RANK, v.ATTR_LOCAL_RANK, v.ATTR_NODE_RANK):
        res.pop(key, None)
    span_attrs.pop(v.ATTR_RANK, None)


def _res_many(res, span_attrs):
    for i in range(600):
        res[f"extra.{i}"] = i


# One defect per resource: every TraceML span under it is refused with the reason.
RESOURCE_MUTATIONS = {
    "no_run_id": (MISSING_RUN_ID, _res_no_run),
    "no_rank": (MISSING_RANK, _res_no_rank),
    "run_id_int": (WRONG_TYPE, _res_set(v.ATTR_RUN_ID, 7)),
    "run_id_too_long": (TOO_LARGE, _res_set(v.ATTR_RUN_ID, "r" * 300)),
    "rank_text": (WRONG_TYPE, _res_set(v.ATTR_RANK, "abc")),
    "rank_double": (WRONG_TYPE, _res_set(v.ATTR_RANK, 1.0)),
    "world_size_zero": (NEGATIVE, _res_set(v.ATTR_WORLD_SIZE, 0)),
    "rank_absurd": (ABSURD, _res_set(v.ATTR_RANK, 2**40)),
    "too_many_attributes": (TOO_MANY, _res_many),
}

MEMORY_MUTATIONS = ("no_step", "step_string", "nan", "negative", "over_1_pib", "no_value", "zero_time",
                    "device_int", "rank_string")
MEMORY_REASON = {"no_step": MISSING_STEP, "step_string": WRONG_TYPE, "nan": NON_FINITE, "negative": NEGATIVE,
                 "over_1_pib": ABSURD, "no_value": WRONG_TYPE, "zero_time": MISSING_TIMESTAMP,
                 "device_int": WRONG_TYPE, "rank_string": WRONG_TYPE}


# --- specs (what hypothesis or a seeded loop draws) ------------------------------------------


@dataclass(frozen=True)
class GroupSpec:
    run: int  # index into RUN_POOL
    rank: int
    resource_defect: str | None
    alias: bool  # NeMo/Megatron resource keys instead of TraceML's
    valid: int
    huge_valid_step: bool  # one valid span with a step near 2**53
    defects: tuple[str, ...]
    foreign: int
    phase: int
    duplicate: bool  # one valid span twice in the same request


@dataclass(frozen=True)
class MemorySpec:
    run: int
    rank: int
    valid: int
    defects: tuple[str, ...]
    histogram_points: int
    foreign_metric: bool
    drop_queue: str | None  # a valid queue, or a bad one


@dataclass
class Expected:
    """The right answer for one request."""

    rejected: Counter = field(default_factory=Counter)
    steps: set = field(default_factory=set)  # (run, rank, step) that must be stored
    memory: set = field(default_factory=set)  # (run, rank, step, device)
    ignored: int = 0


class Ledger:
    """Hands out fresh step numbers and remembers everything that must be stored."""

    def __init__(self, base: int = 0):
        self._next: Counter = Counter()
        self._huge = 0
        self._base = base
        self.steps: set = set()
        self.memory: set = set()
        self.requests: Counter = Counter()  # transport -> requests sent
        self.rejected_expected = 0

    def step(self, run_id: str, rank: int) -> int:
        self._next[(run_id, rank)] += 1
        return self._base + self._next[(run_id, rank)]

    def huge_step(self) -> int:
        self._huge += 1
        return 2**53 - self._base - self._huge

    def expect(self, expected: Expected) -> None:
        self.steps |= expected.steps
        self.memory |= expected.memory
        self.rejected_expected += sum(expected.rejected.values())

    @property
    def total(self) -> int:
        return sum(self.requests.values())


def build_trace_request(groups: list[GroupSpec], ledger: Ledger):
    expected = Expected()
    out = []
    for g in groups:
        run_id = RUN_POOL[g.run]
        stored_run = run_id.strip()
        res = h.resource_attrs(run_id, g.rank, world_size=64)
        if g.alias:
            res.pop(v.ATTR_RUN_ID), res.pop(v.ATTR_RANK), res.pop(v.ATTR_LOCAL_RANK)
            res.update({"nemo.run.id": run_id, "dl.rank": g.rank, "dl.local_rank": g.rank % 8})
        spans = []
        reason = None
        defects = () if g.resource_defect else g.defects  # one defect per span, never two
        if g.resource_defect:
            reason, res_mutation = RESOURCE_MUTATIONS[g.resource_defect]
            if g.alias and g.resource_defect in ("no_run_id", "no_rank", "run_id_int", "rank_text"):
                for alias, key in v.RESOURCE_ALIASES.items():  # keep the defect visible through aliases
                    if alias in res:
                        res[key] = res.pop(alias)
            res_mutation(res, {})
        valid_steps = [ledger.step(stored_run, g.rank) for _ in range(g.valid)]
        if g.huge_valid_step:
            valid_steps.append(ledger.huge_step())
        for step in valid_steps:
            attrs = h.step_attrs(step, g.rank)
            if g.resource_defect:
                res_mutation(res, attrs)
            spans.append(h.step_span(run_id, g.rank, step, attrs=attrs))
            if reason:
                expected.rejected[reason] += 1
            else:
                expected.steps.add((stored_run, g.rank, step))
        if g.duplicate and spans:
            spans.append(spans[0])
            if reason:
                expected.rejected[reason] += 1
        for defect in defects:
            step = ledger.step(stored_run, g.rank)
            attrs = h.step_attrs(step, g.rank)
            attrs[GPU] = 20.0
            span_reason, mutate = SPAN_MUTATIONS[defect]
            ts = {}
            mutate(attrs, ts)
            end = int((h.BASE_TIME_S + step * 0.1) * 1e9)
            start, end = end - 95_000_000, end
            if ts.get("swap"):
                start, end = end, start
            start, end = ts.get("start", start), ts.get("end", end)
            spans.append(h.step_span(run_id, g.rank, step, attrs=attrs, start_ns=start, end_ns=end))
            expected.rejected[reason or span_reason] += 1
        for i in range(g.foreign):
            spans.append(span_data.Span(trace_id=b"\x01" * 16, span_id=bytes([i + 1]) * 8,
                                        name=f"GET /items/{i}", start_time_unix_nano=1, end_time_unix_nano=2))
        for i in range(g.phase):
            spans.append(span_data.Span(trace_id=b"\x02" * 16, span_id=bytes([i + 1]) * 8,
                                        name=v.SPAN_PHASE_PREFIX + "forward", start_time_unix_nano=1,
                                        end_time_unix_nano=2))
        expected.ignored += g.foreign + g.phase
        out.append(h.resource_spans(res, spans))
    return h.trace_request(out), expected


def _mem_point(rank, step, value, *, device="cuda:0", time_ns=1_790_000_000_000_000_000, **overrides):
    attrs = {v.ATTR_RANK: rank, v.ATTR_STEP: step, v.ATTR_DEVICE: device}
    attrs.update(overrides)
    attrs = {k: val for k, val in attrs.items() if val is not _DROP}
    point = metric_data.NumberDataPoint(time_unix_nano=time_ns, attributes=h.kvs(attrs))
    if isinstance(value, float):
        point.as_double = value
    elif isinstance(value, int):
        point.as_int = value
    return point


_DROP = object()


def build_metrics_request(spec: MemorySpec, ledger: Ledger):
    expected = Expected()
    run_id = RUN_POOL[spec.run]
    stored_run = run_id.strip()
    allocated, reserved = [], []
    for _ in range(spec.valid):
        step = ledger.step(stored_run, spec.rank)
        allocated.append(_mem_point(spec.rank, step, 1 << 30))
        reserved.append(_mem_point(spec.rank, step, 2 << 30))
        expected.memory.add((stored_run, spec.rank, step, "cuda:0"))
    for defect in spec.defects:
        step = ledger.step(stored_run, spec.rank)
        kwargs = {}
        value = 1 << 30
        if defect == "no_step":
            kwargs[v.ATTR_STEP] = _DROP
        elif defect == "step_string":
            kwargs[v.ATTR_STEP] = str(step)
        elif defect == "nan":
            value = math.nan
        elif defect == "negative":
            value = -1
        elif defect == "over_1_pib":
            value = 2**51
        elif defect == "no_value":
            value = None
        elif defect == "zero_time":
            kwargs["time_ns"] = 0
        elif defect == "device_int":
            kwargs[v.ATTR_DEVICE] = 0
        elif defect == "rank_string":
            kwargs[v.ATTR_RANK] = str(spec.rank)
        time_ns = kwargs.pop("time_ns", 1_790_000_000_000_000_000)
        allocated.append(_mem_point(spec.rank, step, value, time_ns=time_ns, **kwargs))
        expected.rejected[MEMORY_REASON[defect]] += 1
    metrics = [h.memory_metric(v.METRIC_MEMORY_PEAK_ALLOCATED, allocated),
               h.memory_metric(v.METRIC_MEMORY_PEAK_RESERVED, reserved)]
    if spec.histogram_points:
        step = ledger.step(stored_run, spec.rank)
        metrics.append(h.memory_metric(v.METRIC_MEMORY_PEAK_ALLOCATED,
                                       [_mem_point(spec.rank, step, 1)] * spec.histogram_points, kind="histogram"))
        expected.rejected[WRONG_TYPE] += spec.histogram_points
    if spec.foreign_metric:
        metrics.append(metric_data.Metric(name="http.server.duration", unit="s", gauge=metric_data.Gauge(
            data_points=[metric_data.NumberDataPoint(time_unix_nano=1, as_double=0.1)])))
        expected.ignored += 1
    if spec.drop_queue is not None:
        point = metric_data.NumberDataPoint(time_unix_nano=1_790_000_000_000_000_000, as_int=3,
                                            attributes=h.kvs({v.ATTR_RANK: spec.rank, v.ATTR_QUEUE: spec.drop_queue}))
        metrics.append(metric_data.Metric(name=v.METRIC_TELEMETRY_DROPPED, unit="{record}", sum=metric_data.Sum(
            data_points=[point], is_monotonic=True,
            aggregation_temporality=metric_data.AGGREGATION_TEMPORALITY_CUMULATIVE)))
        if spec.drop_queue not in v.QUEUE_NAMES:
            expected.rejected[WRONG_TYPE] += 1
    res = h.resource_attrs(run_id, spec.rank, world_size=64)
    return h.metrics_request(res, metrics), expected


# --- sending ---------------------------------------------------------------------------------

TRACES, METRICS = "/v1/traces", "/v1/metrics"
GRPC_METHOD = {TRACES: "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
               METRICS: "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"}
RESPONSE = {TRACES: trace_svc.ExportTraceServiceResponse, METRICS: metrics_svc.ExportMetricsServiceResponse}
REQUEST = {TRACES: trace_svc.ExportTraceServiceRequest, METRICS: metrics_svc.ExportMetricsServiceRequest}
HTTP_VARIANTS = ("protobuf", "protobuf+gzip", "json", "json+gzip")


@dataclass
class Answer:
    status: object  # HTTP status int, gRPC StatusCode, or "disconnected: ..."
    rejected: int = 0
    message: str = ""


def to_otlp_json(request) -> bytes:
    """Protobuf -> OTLP/JSON (hex trace and span ids, as the OTLP spec writes them)."""
    doc = json_format.MessageToDict(request)

    def hexify(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("traceId", "spanId", "parentSpanId") and isinstance(value, str):
                    node[key] = base64.b64decode(value).hex()
                else:
                    hexify(value)
        elif isinstance(node, list):
            for item in node:
                hexify(item)

    hexify(doc)
    return json.dumps(doc).encode()


class OtlpClient:
    """One gRPC channel and one keep-alive HTTP connection, reused for every request."""

    def __init__(self, grpc_port: int, http_port: int, ledger: Ledger | None = None, *, quickack: bool = False):
        self.http_port = http_port
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=[
            ("grpc.max_send_message_length", 256 * 1024 * 1024),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        self.trace_stub = trace_service_pb2_grpc.TraceServiceStub(self.channel)
        self.metrics_stub = metrics_service_pb2_grpc.MetricsServiceStub(self.channel)
        self.raw = {path: self.channel.unary_unary(method) for path, method in GRPC_METHOD.items()}
        self.conn = None
        self.ledger = ledger or Ledger()
        self.quickack = quickack and hasattr(socket, "TCP_QUICKACK")

    def close(self) -> None:
        self.channel.close()
        if self.conn is not None:
            self.conn.close()

    # gRPC ------------------------------------------------------------------------------------

    def grpc(self, path: str, request, *, compression=None, timeout: float = 60.0) -> Answer:
        self.ledger.requests["grpc"] += 1
        stub = self.trace_stub if path == TRACES else self.metrics_stub
        try:
            response = stub.Export(request, timeout=timeout, compression=compression)
        except grpc.RpcError as exc:
            return Answer(exc.code(), message=exc.details() or "")
        return _from_response(path, response)

    def grpc_bytes(self, path: str, body: bytes, timeout: float = 60.0) -> Answer:
        self.ledger.requests["grpc"] += 1
        try:
            data = self.raw[path](body, timeout=timeout)
        except grpc.RpcError as exc:
            return Answer(exc.code(), message=exc.details() or "")
        return _from_response(path, RESPONSE[path].FromString(data))

    # HTTP ------------------------------------------------------------------------------------

    def reset_http(self) -> None:
        """Drop the keep-alive connection (after the server may have closed it without saying so)."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def http(self, path: str, request, variant: str = "protobuf") -> Answer:
        if variant.startswith("json"):
            body, content_type = to_otlp_json(request), "application/json"
        else:
            body, content_type = request.SerializeToString(), "application/x-protobuf"
        headers = {}
        if variant.endswith("+gzip"):
            body = gzip.compress(body, compresslevel=1)
            headers["Content-Encoding"] = "gzip"
        return self.http_raw(path, body, content_type, headers)

    def http_raw(self, path: str, body: bytes, content_type: str = "application/x-protobuf",
                 headers: dict | None = None, method: str = "POST", chunked: bool = False) -> Answer:
        self.ledger.requests["http"] += 1
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=120)
        try:
            self.conn.request(method, path, body=body, headers={"Content-Type": content_type, **(headers or {})},
                              encode_chunked=chunked)
            if self.quickack:
                # Ack the answer's header segment at once. Not needed since the receiver sets
                # TCP_NODELAY (the ~40 ms Nagle + delayed-ACK stall is gone); kept off by default
                # so that checks/fuzz.py can show both clients answer equally fast.
                self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            response = self.conn.getresponse()
            data = response.read()
            close = response.getheader("Connection", "").lower() == "close"
        except (OSError, http.client.HTTPException) as exc:
            self.conn.close()
            self.conn = None
            return Answer(f"disconnected: {type(exc).__name__}: {exc}")
        if close:
            self.conn.close()
            self.conn = None
        if response.status != 200 or path not in RESPONSE:
            return Answer(response.status, message=data[:300].decode(errors="replace"))
        if (response.getheader("Content-Type") or "").startswith("application/json"):
            doc = json.loads(data or b"{}")
            partial = doc.get("partialSuccess", {})
            count = partial.get("rejectedSpans", partial.get("rejectedDataPoints", 0))
            return Answer(200, int(count), partial.get("errorMessage", ""))
        return _from_response(path, RESPONSE[path].FromString(data), status=200)


def _from_response(path: str, response, status=grpc.StatusCode.OK) -> Answer:
    partial = response.partial_success
    count = partial.rejected_spans if path == TRACES else partial.rejected_data_points
    return Answer(status, int(count), partial.error_message)


REASONS = re.compile(r"rejected (\d+) \(([^)]*)\)")


def reasons_in(message: str) -> Counter:
    """`rejected 3 (missing_step=1, negative_value=2); ...` -> Counter of reasons."""
    m = REASONS.search(message or "")
    if not m:
        return Counter()
    return Counter({k: int(n) for k, n in (part.split("=") for part in m.group(2).split(", "))})


def check_answer(answer: Answer, expected: Expected, ok_status) -> None:
    """The status is OK, the rejected count and every reason are the documented ones."""
    want = sum(expected.rejected.values())
    assert answer.status == ok_status, f"status {answer.status}: {answer.message}"
    assert answer.rejected == want, (answer.rejected, dict(expected.rejected), answer.message)
    if want:
        assert reasons_in(answer.message) == expected.rejected, (answer.message, dict(expected.rejected))
    if expected.ignored:
        assert "ignored" in answer.message, answer.message


# --- undecodable bodies ----------------------------------------------------------------------


def decodes(path: str, body: bytes) -> bool:
    """Whether protobuf can parse `body` as the request type, whole or, failing that, some of its
    spans (metrics) each on its own (the oracle for raw bytes: the processor keeps what it can
    read and rejects the rest in a partial success, `processor/otlp_read.py`)."""
    from traceml.processor.otlp_read import read_otlp_protobuf

    try:
        read_otlp_protobuf(body, REQUEST[path])
        return True
    except (DecodeError, RecursionError, ValueError):
        return False


def gunzips(body: bytes) -> bool:
    try:
        gzip.decompress(body)
        return True
    except (OSError, EOFError, zlib.error):
        return False


def gzip_bomb(inflated_bytes: int) -> bytes:
    """A small gzip body that inflates to `inflated_bytes` of zeros, built in chunks."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    chunk = bytes(1 << 20)
    parts = [comp.compress(chunk) for _ in range(inflated_bytes >> 20)]
    parts.append(comp.flush())
    return b"".join(parts)
