"""The original TraceML's log records read one by one (`mapping/traceml_logs.read_step`), no server.

The end-to-end claims (real rank processes, both transports, a relay, the verdicts) are in
test_original_traceml_logs.py; here each rule of the reading, including hostile values.
"""
from __future__ import annotations

import math

import pytest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.logs.v1 import logs_pb2

from traceml.processor.decode import DecodeLimits
from traceml.processor.decode_attributes import Reject
from traceml.processor.mapping import traceml_logs as m
from traceml.processor.store_records import NEGATIVE, NON_FINITE, TOO_MANY_ATTRIBUTES, WRONG_TYPE

LIMITS = DecodeLimits()
IDENTITY = {"traceml.session_id": "s", "traceml.global_rank": 3, "traceml.world_size": 4, "host.name": "h"}


def _any(value) -> common_pb2.AnyValue:
    out = common_pb2.AnyValue()
    if isinstance(value, dict):
        for key, val in value.items():
            out.kvlist_value.values.add(key=key).value.CopyFrom(_any(val))
    elif isinstance(value, list):
        out.array_value.values.extend(_any(v) for v in value)
    elif isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, int):
        out.int_value = value
    elif isinstance(value, float):
        out.double_value = value
    else:
        out.string_value = value
    return out


def _record(body, kind="step_timing", version=1, time_ns=0, **attrs) -> logs_pb2.LogRecord:
    record = logs_pb2.LogRecord(time_unix_nano=time_ns)
    for key, value in {"traceml.record_kind": kind, "traceml.schema_version": version, **attrs}.items():
        record.attributes.add(key=key).value.CopyFrom(_any(value))
    record.body.CopyFrom(_any(body))
    return record


WINDOWED = {"step": 9, "timestamp": 1000.5, "data_wait_ms": 4.0, "forward_ms": 30.0, "backward_ms": 45.0,
            "optimizer_ms": 10.0, "step_wall_ms": 87.0,
            "window": {"start_step": 5, "end_step": 9, "step_count": 5, "start_timestamp": 1000.0,
                       "end_timestamp": 1000.5, "flush_reason": "steps"}}


def test_a_window_is_one_row_of_its_means_at_its_first_step():
    step = m.read_step(_record(WINDOWED), IDENTITY, LIMITS)
    assert (step.step, step.start_ns, step.end_ns) == (5, 1000 * 10**9, 1000_500_000_000)
    assert {k: p.ms for k, p in step.phases.items()} == {
        "input_wait": 4.0, "forward": 30.0, "backward": 45.0, "optimizer_step": 10.0, "traced_step_time": 87.0}
    assert "h2d" not in step.phases and "collective_wait" not in step.phases  # unmeasured: null, never 0
    assert (step.run_id, step.rank, step.world_size, step.hostname) == ("s", 3, 4, "h")
    assert step.mapping == m.MAPPING_NAME and m.UNMEASURED == ("collective_wait",)
    assert step.steps == 5  # the row stands for the window's five steps


def test_a_record_without_a_window_ended_at_its_timestamp_and_lasted_its_wall_time():
    body = {k: v for k, v in WINDOWED.items() if k != "window"}
    step = m.read_step(_record(body, **{"traceml.global_rank": 1}), IDENTITY, LIMITS)
    assert (step.step, step.end_ns, step.steps) == (9, 1000_500_000_000, 1)
    assert step.end_ns - step.start_ns == pytest.approx((87.0 + 4.0) * 1e6)
    assert step.rank == 1  # the record's own attribute wins over its resource's


@pytest.mark.parametrize(("body", "step"), [
    ({k: v for k, v in WINDOWED.items() if k != "step"}, 5),
    ({**WINDOWED, "window": {k: v for k, v in WINDOWED["window"].items() if k != "start_step"}}, 5),
    ({k: v for k, v in WINDOWED.items() if k != "step"} | {"window": {"end_step": 9, "step_count": 5}}, 5),
    ({**WINDOWED, "window": {"end_timestamp": 1000.5}}, 9),  # no window size: the record's step
])
def test_a_window_row_is_keyed_by_its_first_step_however_the_window_says_it(body, step):
    assert m.read_step(_record(body), IDENTITY, LIMITS).step == step


@pytest.mark.parametrize(("record", "unused"), [
    (_record(WINDOWED, kind="step_memory"), True),
    (_record(WINDOWED, kind="runtime_context"), True),
    (_record(WINDOWED, kind="gradient_norms"), False),
    (_record(WINDOWED, version=2), False),
    (_record(WINDOWED, version="1"), False),
    (_record("step 9 took 87 ms"), False),
    (_record({"forward_ms": 30.0}), False),
    (_record({**WINDOWED, "window": 5}), False),
])
def test_what_builds_no_row_says_why(record, unused):
    result = m.read_step(record, IDENTITY, LIMITS)
    assert isinstance(result, m.NotPlaced) and result.unused is unused and result.detail


@pytest.mark.parametrize(("body", "reason"), [
    ({**WINDOWED, "timestamp": math.nan, "window": {}}, NON_FINITE),
    ({**WINDOWED, "window": {**WINDOWED["window"], "end_timestamp": math.inf}}, NON_FINITE),
    ({**WINDOWED, "window": {**WINDOWED["window"], "start_timestamp": -5.0}}, NEGATIVE),
    ({**WINDOWED, "forward_ms": math.nan}, NON_FINITE),
    ({**WINDOWED, "forward_ms": "30"}, WRONG_TYPE),
    ({**WINDOWED, "forward_ms": [30.0]}, WRONG_TYPE),
    ({**WINDOWED, "window": {**WINDOWED["window"], "start_step": 5.0}}, WRONG_TYPE),
    ({**WINDOWED, "step": 9.0, "window": {}}, WRONG_TYPE),
    ({f"k{i}": 1.0 for i in range(LIMITS.max_attributes + 1)}, TOO_MANY_ATTRIBUTES),
])
def test_hostile_values_are_refused_with_their_reason(body, reason):
    with pytest.raises(Reject) as caught:
        m.read_step(_record(body), IDENTITY, LIMITS)
    assert caught.value.reason == reason
