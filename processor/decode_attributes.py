"""What both decoders read the same way: OTLP attribute values, a sender's run and rank, refusals.

The span decoder (`decode_spans`) and the metric decoder (`decode_metrics`) judge
attributes by one set of rules, kept here: a value too long, too many attributes,
an integer or a duration of the wrong type or out of range, a resource's run id and rank
identity (TraceML keys win over the NeMo/Megatron aliases), and a point's or
span's run and rank admitted under the run caps (`admission.RunAdmission`). A
rule broken raises `Reject` with its reason word (`store_records`); the decoder
counts it against the span or point and keeps the rest of the request.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from traceml.processor.step_time.model import RankIdentity
from traceml.processor.store_records import (
    ATTRIBUTE_TOO_LARGE,
    MISSING_RANK,
    MISSING_RUN_ID,
    NEGATIVE,
    NON_FINITE,
    ABSURD,
    TOO_MANY_ATTRIBUTES,
    WRONG_TYPE,
)
from traceml.schema import vocabulary as v

if TYPE_CHECKING:
    from traceml.processor.admission import RunAdmission
    from traceml.processor.decode import DecodeLimits


class Reject(Exception):
    """A span or data point refused whole: `reason` is a `store_records` reason word."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class Unsupported:
    """An array, map or bytes value where TraceML reads scalars (kept to say what it was)."""

    __slots__ = ("kind",)

    def __init__(self, kind: str):
        self.kind = kind

    def __repr__(self) -> str:
        return f"<{self.kind}>"


MISS = object()
"""An absent attribute (None is a present attribute with no value)."""


def any_value(value, limits: "DecodeLimits", key: str):
    """protobuf AnyValue -> Python scalar; arrays/maps/bytes come back as `Unsupported`."""
    kind = value.WhichOneof("value")
    if kind == "string_value":
        s = value.string_value
        if len(s) > limits.max_attribute_bytes:
            raise Reject(ATTRIBUTE_TOO_LARGE, f"{key} is {len(s)} characters (cap {limits.max_attribute_bytes})")
        return s
    if kind == "int_value":
        return value.int_value
    if kind == "double_value":
        return value.double_value
    if kind == "bool_value":
        return value.bool_value
    if kind is None:
        return None
    return Unsupported(kind)


def attributes(kvs, limits: "DecodeLimits") -> dict:
    """A repeated KeyValue -> {key: scalar}, within the attribute count and size caps."""
    if len(kvs) > limits.max_attributes:
        raise Reject(TOO_MANY_ATTRIBUTES, f"{len(kvs)} attributes (cap {limits.max_attributes})")
    out = {}
    for kv in kvs:
        key = kv.key
        if len(key) > limits.max_attribute_bytes:
            raise Reject(ATTRIBUTE_TOO_LARGE, f"attribute key of {len(key)} characters")
        out[key] = any_value(kv.value, limits, key)
    return out


def ms_value(value, key: str, limits: "DecodeLimits", to_ms: float = 1.0) -> float:
    """A duration attribute in its wire unit (`to_ms` milliseconds each) -> milliseconds, checked."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Reject(WRONG_TYPE, f"{key} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise Reject(NON_FINITE, f"{key} is {value}")
    if value < 0:
        raise Reject(NEGATIVE, f"{key} is {value}")
    ms = value * to_ms
    if ms > limits.max_event_ms:
        raise Reject(ABSURD, f"{key} is {value} ({ms:g} ms, cap {limits.max_event_ms:g} ms)")
    return ms


def int_attr(attrs: Mapping, key: str, *, allow_string: bool, minimum: int, maximum: int) -> int | None:
    """An integer attribute; strings of digits only where OTel env config makes them strings.

    An exact int in range (the common case on the hot path) returns at once; anything
    else is checked and rejected with its precise reason.
    """
    value = attrs.get(key, MISS)
    if value is MISS:
        return None
    if value.__class__ is int and minimum <= value <= maximum:
        return value
    if isinstance(value, bool) or value is None:
        raise Reject(WRONG_TYPE, f"{key} must be an integer, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if not allow_string or not text.lstrip("-").isdigit():
            raise Reject(WRONG_TYPE, f"{key} must be an integer, got string {value[:64]!r}")
        value = int(text)
    elif isinstance(value, float):
        raise Reject(WRONG_TYPE, f"{key} must be an integer, got double {value!r}")
    elif not isinstance(value, int):
        raise Reject(WRONG_TYPE, f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise Reject(NEGATIVE, f"{key} is {value} (must be >= {minimum})")
    if value > maximum:
        raise Reject(ABSURD, f"{key} is {value} (must be <= {maximum})")
    return value


@dataclass(frozen=True, slots=True)
class ResourceIdentity:
    """What a resource says about its sender's run and rank (or why it cannot be used)."""

    run_id: str | None
    identity: RankIdentity | None
    strategy: str | None
    error: Reject | None
    attempt: int = 0  # `traceml.run.attempt` (elastic restart); absent: 0


def resource_identity(kvs, limits: "DecodeLimits") -> ResourceIdentity:
    """Run and rank identity of one resource; TraceML keys win over NeMo/Megatron aliases."""
    try:
        attrs = attributes(kvs, limits)
        for alias, key in v.RESOURCE_ALIASES.items():
            if key not in attrs and alias in attrs:
                attrs[key] = attrs[alias]
        run_id = attrs.get(v.ATTR_RUN_ID)
        if run_id is not None:
            if not isinstance(run_id, str):
                raise Reject(WRONG_TYPE, f"{v.ATTR_RUN_ID} must be a string, got {run_id!r}")
            run_id = run_id.strip()
            if len(run_id) > limits.max_run_id_chars:
                raise Reject(ATTRIBUTE_TOO_LARGE,
                             f"{v.ATTR_RUN_ID} is {len(run_id)} characters (cap {limits.max_run_id_chars})")
            run_id = run_id or None
        rank_cap = limits.max_ranks_per_run * 64
        rank = int_attr(attrs, v.ATTR_RANK, allow_string=True, minimum=0, maximum=rank_cap)
        identity = None
        if rank is not None:
            hostname = attrs.get(v.RES_HOST_NAME)
            identity = RankIdentity(
                global_rank=rank,
                local_rank=int_attr(attrs, v.ATTR_LOCAL_RANK, allow_string=True, minimum=0, maximum=rank_cap),
                node_rank=int_attr(attrs, v.ATTR_NODE_RANK, allow_string=True, minimum=0, maximum=rank_cap),
                world_size=int_attr(attrs, v.ATTR_WORLD_SIZE, allow_string=True, minimum=1, maximum=rank_cap),
                local_world_size=int_attr(attrs, v.ATTR_LOCAL_WORLD_SIZE, allow_string=True,
                                          minimum=1, maximum=rank_cap),
                hostname=hostname if isinstance(hostname, str) else None,
            )
        strategy = attrs.get(v.ATTR_TRAINING_STRATEGY)
        if strategy is not None and not isinstance(strategy, str):
            raise Reject(WRONG_TYPE, f"{v.ATTR_TRAINING_STRATEGY} must be a string, got {strategy!r}")
        attempt = int_attr(attrs, v.ATTR_RUN_ATTEMPT, allow_string=True, minimum=0, maximum=1_000_000)
        return ResourceIdentity(run_id, identity, strategy, None, attempt or 0)
    except Reject as exc:
        return ResourceIdentity(None, None, None, exc)


def span_identity(attrs: Mapping, res: ResourceIdentity, limits: "DecodeLimits",
                  admission: "RunAdmission") -> tuple[str, RankIdentity]:
    """The run and rank of a span or data point (the resource's, else its own attributes),
    admitted under the run caps."""
    run_id = res.run_id
    if run_id is None:
        span_run = attrs.get(v.ATTR_RUN_ID)
        if isinstance(span_run, str) and span_run.strip():
            if len(span_run) > limits.max_run_id_chars:
                raise Reject(ATTRIBUTE_TOO_LARGE, f"{v.ATTR_RUN_ID} is too long")
            run_id = span_run.strip()
        elif span_run is not None and not isinstance(span_run, str):
            raise Reject(WRONG_TYPE, f"{v.ATTR_RUN_ID} must be a string, got {span_run!r}")
    if run_id is None:
        raise Reject(MISSING_RUN_ID, f"no {v.ATTR_RUN_ID} (or nemo.run.id) on the resource")
    rank_cap = limits.max_ranks_per_run * 64
    span_rank = int_attr(attrs, v.ATTR_RANK, allow_string=False, minimum=0, maximum=rank_cap)
    identity = res.identity
    if identity is None:
        if span_rank is None:
            raise Reject(MISSING_RANK, f"no {v.ATTR_RANK} (or dl.rank) on the resource or span")
        identity = RankIdentity(global_rank=span_rank)
    admission.admit(run_id, identity.global_rank)
    return run_id, identity
