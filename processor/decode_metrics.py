"""OTLP metric export requests -> resource samples, drop reports and legacy memory rows.

Resource metrics (`schema.resources`) leave as `ResourceIngestRecord`s, one value per
(sender, host, device, time) in the convention's unit: a rank's own (run and rank
set), the Collector's `hostmetrics` receiver's and DCGM's exporter's (through the
Collector's Prometheus receiver; run and rank None, joined to runs by host when
stored and read). Per-mode and per-state points are folded here (CPU busy fraction,
`used` memory, CPU seconds busy and total), so a stored value never needs another
point of the same request to mean something. Every value is finite, non-negative and
under its cap (`_RESOURCE_CAPS`: a utilisation at most `MAX_UTILIZATION`, stored at
most 1.0; bytes at most `max_memory_bytes`; temperature, power, CPU counts and CPU
seconds plausible), with a non-zero time.

A rank's own metric points also carry its queues' drop counts
(`traceml.telemetry.dropped`) and, from exporters before peak memory moved onto the
step span, per-step memory gauges. A point with a bad value is rejected with its
reason (`store_records`), the rest of the request kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from traceml.processor.decode_attributes import (
    Reject,
    ResourceIdentity,
    attributes,
    int_attr,
    resource_identity,
    span_identity,
)
from traceml.processor.resource_folding import ResourceFolder, SampleKey
from traceml.processor.step_time.model import ResourceIngestRecord, StepMemoryIngestRecord
from traceml.processor.store_records import (
    ABSURD,
    ATTRIBUTE_TOO_LARGE,
    IGNORED_FOREIGN,
    IGNORED_NO_VALUE,
    IGNORED_UNUSED_METRIC,
    MISSING_STEP,
    MISSING_TIMESTAMP,
    NEGATIVE,
    NON_FINITE,
    WRONG_TYPE,
    DecodedBatch,
    DropReport,
)
from traceml.schema import resources as sr
from traceml.schema import vocabulary as v

if TYPE_CHECKING:
    from traceml.processor.admission import RunAdmission
    from traceml.processor.decode import DecodeLimits

MAX_UTILIZATION = 1.5
"""Highest utilisation accepted (a fraction): a figure over elapsed time sampled by a busy
host's scheduler can land a little above 1 (a late tick), and is stored as 1.0; one above
1.5 is a sender that did not divide by its CPUs or sent percent, and is rejected."""
MAX_TEMPERATURE_C = 1000.0
MAX_POWER_W = 10_000.0
"""Per device; the largest GPUs draw about a tenth of it."""
MAX_CPU_COUNT = float(1 << 20)
MAX_CPU_SECONDS = 1e13
"""Cumulative CPU seconds summed over a host's CPUs: a thousand CPUs for three centuries."""
_BYTES = None  # cap: `DecodeLimits.max_memory_bytes`

_RESOURCE_CAPS: Mapping[str, float | None] = {
    sr.PROCESS_CPU_UTILIZATION: MAX_UTILIZATION, sr.SYSTEM_CPU_UTILIZATION: MAX_UTILIZATION,
    sr.GPU_UTILIZATION: MAX_UTILIZATION,
    sr.PROCESS_MEMORY_USAGE: _BYTES, sr.SYSTEM_MEMORY_USAGE: _BYTES, sr.SYSTEM_MEMORY_LIMIT: _BYTES,
    sr.GPU_MEMORY_USAGE: _BYTES, sr.GPU_MEMORY_LIMIT: _BYTES,
    sr.CUDA_MEMORY_ALLOCATED: _BYTES, sr.CUDA_MEMORY_RESERVED: _BYTES,
    sr.SYSTEM_CPU_TIME: MAX_CPU_SECONDS, sr.SYSTEM_CPU_TIME_BUSY: MAX_CPU_SECONDS,
    sr.SYSTEM_CPU_TIME_TOTAL: MAX_CPU_SECONDS,
    sr.SYSTEM_CPU_LOGICAL_COUNT: MAX_CPU_COUNT,
    sr.HW_TEMPERATURE: MAX_TEMPERATURE_C, sr.HW_POWER: MAX_POWER_W,
}
"""Every stored resource metric (and `system.cpu.time` as sent) -> its highest plausible value."""
_UTILIZATIONS = frozenset(name for name, cap in _RESOURCE_CAPS.items() if cap == MAX_UTILIZATION)

_RESOURCE_WIRE_NAMES = frozenset(
    (set(sr.STORED_METRICS) - {sr.SYSTEM_CPU_TIME_BUSY, sr.SYSTEM_CPU_TIME_TOTAL})
    | {sr.SYSTEM_CPU_TIME} | set(sr.DCGM_METRICS))
"""Metric names read as resource samples (the stored names as sent, `system.cpu.time`, DCGM's)."""
_HOSTMETRICS_NAMES = frozenset({
    sr.SYSTEM_CPU_UTILIZATION, sr.SYSTEM_CPU_TIME, sr.SYSTEM_CPU_LOGICAL_COUNT, sr.SYSTEM_MEMORY_USAGE,
    sr.SYSTEM_MEMORY_LIMIT, sr.PROCESS_CPU_UTILIZATION, sr.PROCESS_MEMORY_USAGE,
})
"""The names also read from a sender that is not TraceML (the Collector's `hostmetrics`)."""
_GPU_NAMES = frozenset(sr.GPU_METRICS)
_ALLOCATOR_NAMES = frozenset({sr.CUDA_MEMORY_ALLOCATED, sr.CUDA_MEMORY_RESERVED})
_LEGACY_OF = {new: old for old, new in sr.LEGACY_ATTRIBUTES.items()}
_CPU_MODE_KEYS = (sr.ATTR_CPU_MODE, _LEGACY_OF[sr.ATTR_CPU_MODE])
_CPU_NUMBER_KEYS = (sr.ATTR_CPU_LOGICAL_NUMBER, _LEGACY_OF[sr.ATTR_CPU_LOGICAL_NUMBER])
_MEMORY_STATE_KEYS = (sr.ATTR_MEMORY_STATE, _LEGACY_OF[sr.ATTR_CPU_MODE])  # older `state` on memory too
_FLAG_NO_RECORDED_VALUE = 1  # DataPointFlags.DATA_POINT_FLAGS_NO_RECORDED_VALUE_MASK
_MAX_PID = 2**31 - 1


@dataclass(frozen=True, slots=True)
class _Sender:
    """What a resource-metric resource says about its sender, read leniently: a foreign
    resource is judged only on the attributes used (`host.name`, `process.pid`)."""

    traceml: bool  # it names a TraceML run (its points are a rank's own)
    host: str | None
    host_error: Reject | None
    pid: int | None  # `process.pid` when an int


def _sender(kvs, limits: "DecodeLimits") -> _Sender:
    traceml, host, error, pid = False, None, None, None
    for kv in kvs:
        key = kv.key
        if key == v.ATTR_RUN_ID or v.RESOURCE_ALIASES.get(key) == v.ATTR_RUN_ID:
            traceml = True
        elif key == v.RES_HOST_NAME:
            if kv.value.WhichOneof("value") == "string_value":
                text = kv.value.string_value
                if len(text) > limits.max_attribute_bytes:
                    error = Reject(ATTRIBUTE_TOO_LARGE, f"{key} is {len(text)} characters "
                                                         f"(cap {limits.max_attribute_bytes})")
                else:
                    host = text.strip() or None
        elif key == sr.RES_PROCESS_PID:
            if kv.value.WhichOneof("value") == "int_value" and 0 <= kv.value.int_value <= _MAX_PID:
                pid = kv.value.int_value
    return _Sender(traceml, host, error, pid)


def _str_attr(attrs: Mapping, keys: tuple[str, ...]) -> str | None:
    """The first of `keys` present, a non-empty string (stripped); None when absent or empty."""
    for key in keys:
        value = attrs.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise Reject(WRONG_TYPE, f"{key} must be a string, got {value!r}")
        return value.strip() or None
    return None


def _label_attr(attrs: Mapping, keys: tuple[str, ...]) -> str | int | None:
    """The first of `keys` present, a string or an integer (a CPU or GPU number, as sent)."""
    for key in keys:
        value = attrs.get(key)
        if value is None:
            continue
        if isinstance(value, str):
            return value.strip()
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise Reject(WRONG_TYPE, f"{key} must be a string or an integer, got {value!r}")
    return None


def _judged_resource_value(metric: str, value: float, limits: "DecodeLimits") -> float:
    """A finite, non-negative value (checked by the caller) under its metric's cap; a
    utilisation up to `MAX_UTILIZATION` leaves as at most 1.0."""
    cap = _RESOURCE_CAPS[metric]
    if cap is None:
        cap = limits.max_memory_bytes
    if not value <= cap:
        raise Reject(ABSURD, f"{metric} is {value:g} (cap {cap:g})")
    if value < 0:
        raise Reject(NEGATIVE, f"{metric} is {value:g}")
    value = float(value)
    return min(value, 1.0) if metric in _UTILIZATIONS else value


def _resource_record(key: SampleKey, device: str, metric: str, value: float) -> ResourceIngestRecord:
    return ResourceIngestRecord(run_id=key.run_id, global_rank=key.global_rank, host=key.host, device=device,
                                metric=metric, sample_time=key.time_ns / 1e9, value=value,
                                source=key.source, pid=key.pid, attempt=key.attempt)


class MetricDecoder:
    """Stateless per request except for the shared run/rank admission caps."""

    def __init__(self, limits: "DecodeLimits", admission: "RunAdmission"):
        self.limits = limits
        self.admission = admission

    def decode_metrics(self, request) -> DecodedBatch:
        """`ExportMetricsServiceRequest` -> drop counts, resource samples (`schema.resources`:
        a rank's own, `hostmetrics`' and DCGM's), and per-step memory rows from the
        step-keyed gauges that exporters sent before peak memory moved onto the step span."""
        batch = DecodedBatch(v.SIGNAL_METRICS)
        limits = self.limits
        for part in getattr(request, "unreadable", ()):  # `otlp_read.PartlyReadable`
            batch.reject(part.reason, part.describe("data points"), part.items)
        memory_names = v.LEGACY_MEMORY_METRICS
        unused = (v.METRIC_EXPORT_FAILURES, v.METRIC_EXPORT_RETRIES)
        folder = ResourceFolder()  # split points of the whole request, folded at its end
        for resource_metrics in request.resource_metrics:
            res = None
            sender = None
            # (run, rank, step, device) -> [allocated, reserved, time]; the two gauges merge.
            memory: dict[tuple[str, int, int, str], list] = {}
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    name = metric.name
                    points = _data_points(metric)
                    if name in _RESOURCE_WIRE_NAMES:
                        if sender is None:
                            sender = _sender(resource_metrics.resource.attributes, limits)
                            if sender.traceml:
                                res = res or resource_identity(resource_metrics.resource.attributes, limits)
                        self._resource_metric(metric, name, points, sender, res, resource_metrics, folder, batch)
                        continue
                    if name not in memory_names and name != v.METRIC_TELEMETRY_DROPPED:
                        n = max(1, len(points))
                        batch.ignored[IGNORED_UNUSED_METRIC if name in unused else IGNORED_FOREIGN] += n
                        continue
                    if res is None:
                        res = resource_identity(resource_metrics.resource.attributes, limits)
                    if metric.WhichOneof("data") not in ("gauge", "sum"):
                        for _ in points or [None]:
                            batch.reject(WRONG_TYPE, f"{name} must be a gauge or sum, "
                                                     f"got {metric.WhichOneof('data')}")
                        continue
                    for point in points:
                        try:
                            if res.error is not None:
                                raise res.error
                            if name == v.METRIC_TELEMETRY_DROPPED:
                                batch.drops.append(self._drop_point(point, res))
                            else:
                                self._memory_point(point, res, name, memory)
                        except Reject as exc:
                            batch.reject(exc.reason, f"{name} point: {exc.detail}")
            for (run_id, rank, step, device), (alloc, reserved, when) in memory.items():
                batch.memory_records.append(StepMemoryIngestRecord(
                    run_id=run_id, global_rank=rank, step=step, device=device,
                    peak_allocated_bytes=alloc, peak_reserved_bytes=reserved, sample_time=when))
        folded, unused_points = folder.fold()
        if unused_points:
            batch.ignored[IGNORED_UNUSED_METRIC] += unused_points
        for item in folded:
            try:
                value = _judged_resource_value(item.metric, item.value, limits)
            except Reject as exc:
                batch.reject(exc.reason, f"{item.metric} (folded over {item.points} points): {exc.detail}",
                             max(1, item.points))
                continue
            batch.resource_records.append(_resource_record(item.key, "", item.metric, value))
        return batch

    # --- resource metrics (schema.resources) -----------------------------------------------

    def _resource_metric(self, metric, name: str, points: list, sender: "_Sender", res: "ResourceIdentity | None",
                         resource_metrics, folder: ResourceFolder, batch: DecodedBatch) -> None:
        """One resource metric's points -> records (or, split by mode or state, into `folder`)."""
        kind = metric.WhichOneof("data")
        if kind not in ("gauge", "sum"):
            for _ in points or [None]:
                batch.reject(WRONG_TYPE, f"{name} must be a gauge or sum, got {kind}")
            return
        for point in points:
            if point.flags & _FLAG_NO_RECORDED_VALUE:
                batch.ignored[IGNORED_NO_VALUE] += 1
                continue
            try:
                attrs = attributes(point.attributes, self.limits)
                if res is None and not sender.traceml and attrs.get(v.ATTR_RUN_ID) is not None:
                    res = resource_identity(resource_metrics.resource.attributes, self.limits)
                ignored = self._resource_point(point, name, attrs, sender, res, folder, batch)
                if ignored is not None:
                    batch.ignored[ignored] += 1
            except Reject as exc:
                batch.reject(exc.reason, f"{name} point: {exc.detail}")

    def _resource_point(self, point, name: str, attrs: dict, sender: "_Sender", res: "ResourceIdentity | None",
                        folder: ResourceFolder, batch: DecodedBatch) -> str | None:
        """Judge one point and store or fold it; returns the reason it was ignored, if it was."""
        dcgm = sr.DCGM_METRICS.get(name)
        if dcgm is not None:
            return self._dcgm_point(point, name, dcgm, attrs, sender, batch)
        if sender.traceml or attrs.get(v.ATTR_RUN_ID) is not None:
            if res.error is not None:
                raise res.error
            run_id, identity = span_identity(attrs, res, self.limits, self.admission)
            if sender.host_error is not None:
                raise sender.host_error
            key_head = (sr.SOURCE_TRACEML, run_id, identity.global_rank, sender.host or "", sender.pid,
                        res.attempt)
        elif name in _HOSTMETRICS_NAMES:
            if sender.host_error is not None:
                raise sender.host_error
            if not sender.host:
                return IGNORED_FOREIGN  # nothing to join it to a run by
            key_head = (sr.SOURCE_HOSTMETRICS, None, None, sender.host, sender.pid, 0)
        else:
            return IGNORED_FOREIGN  # a GPU or allocator figure only a rank's own sampler sends
        time_ns = point.time_unix_nano
        if time_ns == 0:
            raise Reject(MISSING_TIMESTAMP, "time is zero")
        value = _judged_resource_value(name, self._point_value(point, name), self.limits)
        key = SampleKey(*key_head, time_ns)
        if name == sr.SYSTEM_CPU_UTILIZATION or name == sr.SYSTEM_CPU_TIME:
            mode = _str_attr(attrs, _CPU_MODE_KEYS)
            cpu = _label_attr(attrs, _CPU_NUMBER_KEYS)
            add = folder.add_cpu_utilization if name == sr.SYSTEM_CPU_UTILIZATION else folder.add_cpu_time
            add(key, cpu, mode, value)
        elif name == sr.SYSTEM_MEMORY_USAGE:
            state = _str_attr(attrs, _MEMORY_STATE_KEYS)
            if state is None:
                return IGNORED_UNUSED_METRIC  # which part of the memory: unknown
            folder.add_memory_usage(key, state, value)
        elif name == sr.PROCESS_CPU_UTILIZATION:
            folder.add_process_cpu(key, _str_attr(attrs, _CPU_MODE_KEYS), value)
        else:
            device = ""
            if name in _GPU_NAMES:
                hw_type = attrs.get(sr.ATTR_HW_TYPE)
                if hw_type is not None and hw_type != sr.HW_TYPE_GPU:
                    return IGNORED_UNUSED_METRIC  # another component's temperature or power
                device = _str_attr(attrs, (sr.ATTR_HW_ID,)) or ""
            elif name in _ALLOCATOR_NAMES:
                device = _str_attr(attrs, (v.ATTR_DEVICE,)) or ""
            if name == sr.SYSTEM_MEMORY_LIMIT:
                folder.saw_memory_limit(key)
            batch.resource_records.append(_resource_record(key, device, name, value))
        return None

    def _dcgm_point(self, point, name: str, dcgm: tuple[str, float], attrs: dict, sender: "_Sender",
                    batch: DecodedBatch) -> str | None:
        """A DCGM exporter field as the Collector's Prometheus receiver passes it on: the host
        from its `Hostname` label (else the resource's `host.name`), the device from `UUID`
        (else `index:<gpu>`), the value scaled to the convention's unit."""
        metric, factor = dcgm
        host = _str_attr(attrs, (sr.DCGM_LABEL_HOST,))
        if host is None:
            if sender.host_error is not None:
                raise sender.host_error
            host = sender.host
        if not host:
            return IGNORED_FOREIGN
        device = _str_attr(attrs, (sr.DCGM_LABEL_UUID,))
        if device is None:
            index = _label_attr(attrs, (sr.DCGM_LABEL_INDEX,))
            if index is None:
                return IGNORED_UNUSED_METRIC  # a GPU figure that names no GPU
            device = f"{sr.DEVICE_INDEX_PREFIX}{index}"
        if point.time_unix_nano == 0:
            raise Reject(MISSING_TIMESTAMP, "time is zero")
        value = _judged_resource_value(metric, self._point_value(point, name) * factor, self.limits)
        key = SampleKey(sr.SOURCE_DCGM, None, None, host, None, 0, point.time_unix_nano)
        batch.resource_records.append(_resource_record(key, device, metric, value))
        return None

    def _point_value(self, point, name: str) -> float:
        kind = point.WhichOneof("value")
        if kind == "as_int":
            value = point.as_int
        elif kind == "as_double":
            value = point.as_double
        else:
            raise Reject(WRONG_TYPE, f"{name} data point has no value")
        if isinstance(value, float) and not math.isfinite(value):
            raise Reject(NON_FINITE, f"{name} is {value}")
        if value < 0:
            raise Reject(NEGATIVE, f"{name} is {value}")
        return value

    def _memory_point(self, point, res: ResourceIdentity, name: str, memory: dict) -> None:
        limits = self.limits
        attrs = attributes(point.attributes, limits)
        run_id, identity = span_identity(attrs, res, self.limits, self.admission)
        step = int_attr(attrs, v.ATTR_STEP, allow_string=False, minimum=0, maximum=limits.max_step)
        if step is None:
            raise Reject(MISSING_STEP, f"no {v.ATTR_STEP} attribute")
        value = self._point_value(point, name)
        if value > limits.max_memory_bytes:
            raise Reject(ABSURD, f"{name} is {value} bytes")
        device = attrs.get(v.ATTR_DEVICE, "")
        if not isinstance(device, str):
            raise Reject(WRONG_TYPE, f"{v.ATTR_DEVICE} must be a string, got {device!r}")
        if point.time_unix_nano == 0:
            raise Reject(MISSING_TIMESTAMP, "time is zero")
        key = (run_id, identity.global_rank, step, device)
        slot = memory.setdefault(key, [None, None, 0.0])
        slot[0 if name == v.METRIC_MEMORY_PEAK_ALLOCATED else 1] = int(value)
        slot[2] = max(slot[2], point.time_unix_nano / 1e9)

    def _drop_point(self, point, res: ResourceIdentity) -> DropReport:
        attrs = attributes(point.attributes, self.limits)
        run_id, identity = span_identity(attrs, res, self.limits, self.admission)
        queue = attrs.get(v.ATTR_QUEUE)
        if not isinstance(queue, str) or queue not in v.QUEUE_NAMES:
            raise Reject(WRONG_TYPE, f"{v.ATTR_QUEUE} must be one of {list(v.QUEUE_NAMES)}, got {queue!r}")
        value = self._point_value(point, v.METRIC_TELEMETRY_DROPPED)
        if value > 2**53:
            raise Reject(ABSURD, f"dropped count {value}")
        return DropReport(run_id, identity.global_rank, queue, int(value), point.time_unix_nano / 1e9)


def _data_points(metric) -> list:
    kind = metric.WhichOneof("data")
    if kind == "gauge":
        return list(metric.gauge.data_points)
    if kind == "sum":
        return list(metric.sum.data_points)
    if kind == "histogram":
        return list(metric.histogram.data_points)
    if kind == "exponential_histogram":
        return list(metric.exponential_histogram.data_points)
    if kind == "summary":
        return list(metric.summary.data_points)
    return []
