"""Foreign spans -> `ForeignStep`s: which span is a step, which of its descendants are its phases.

The span decoder hands every span that is not TraceML's here (`MappingSet.offer`, per
resource, then `settle` once per request). A span a mapping recognises as a step is
placed with the spans below it; every other span with a parent waits in a bounded buffer,
since an emitter's SDK ends (and exports) children before their parent, often in an
earlier request. When the step span comes, its subtree is read:

- a descendant a phase rule names adds its duration to that phase (microbatches summed,
  the count says how many); one nested inside a span of the same phase is already
  counted (a layer's forward inside a microbatch's);
- a descendant no rule names, inside no placed phase and holding none (a collective
  wait explains no span around it: it is a sub-interval of others), is counted
  unplaced under its name (a forward-backward span without microbatch spans, a garbage
  collection inside the step): its time is left in the step's residual, never guessed
  into a phase;
- the step span itself is the traced step time.

A buffered span whose step never comes is dropped after `max_age_s` (or when the buffer
is full, oldest first) and counted: `unplaced_foreign` if a mapping names it, else
`not_traceml`. Spans of one step reach one processor: with `--workers` above 1 a
connection stays on one worker, and one SDK exporter sends on one connection.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from traceml.processor.decode_attributes import (
    Reject,
    ResourceIdentity,
    attributes,
    resource_identity,
)
from traceml.processor.mapping.builtin import BUILTIN
from traceml.processor.mapping.record import ForeignStep, OwnRanks, PhaseTime, place
from traceml.processor.mapping.spec import UNITS, SpanMapping
from traceml.processor.store_records import IGNORED_FOREIGN, IGNORED_UNPLACED, WRONG_TYPE, DecodedBatch
from traceml.schema.vocabulary import METRIC_COLLECTIVE_WAIT, METRIC_TRACED_STEP_TIME

if TYPE_CHECKING:
    from traceml.processor.admission import RunAdmission
    from traceml.processor.decode import DecodeLimits

TRUNCATED = " (not measured: truncated)"
"""Suffix of the unplaced label of a span its emitter flagged as force-closed."""


@dataclass(slots=True)
class _Pending:
    parent: bytes
    name: str
    start: int
    end: int
    truncated: bool
    received: float


@dataclass(slots=True)
class _Step:
    mapping: SpanMapping
    span: object
    resource: object
    res: ResourceIdentity


class MappingSet:
    """The mappings in force (a declared one first, then the built-ins) and the span buffer."""

    def __init__(self, mappings: Sequence[SpanMapping] = BUILTIN, *, max_pending: int = 200_000,
                 max_age_s: float = 120.0, clock=time.monotonic):
        self.mappings = tuple(mappings)
        self.max_pending = max_pending
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._traces: dict[bytes, dict[bytes, _Pending]] = {}  # trace -> span id -> waiting span
        self._children: dict[bytes, dict[bytes, list[bytes]]] = {}  # trace -> parent id -> its children
        self._pending = 0
        self._last_sweep = clock()
        self._flags = frozenset(m.not_measured_flag for m in self.mappings if m.not_measured_flag)
        self._candidates: dict[str, tuple[SpanMapping, ...]] = {}
        self.own = OwnRanks()  # the span decoder adds the (run, rank)s of TraceML's own step spans

    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.mappings)

    def pending(self) -> int:
        return self._pending

    # --- per request ------------------------------------------------------------------------

    def offer(self, resource, spans: list, batch: DecodedBatch, limits: "DecodeLimits", steps: list) -> None:
        """Buffer one resource's foreign spans; its step spans are queued on `steps` for `settle`."""
        res = None
        now = self._clock()
        candidates_of = self._candidates
        flags = self._flags
        with self._lock:
            traces, children_of = self._traces, self._children
            for span in spans:
                name = span.name
                candidates = candidates_of.get(name)
                if candidates is None:
                    candidates = self._step_candidates(name)
                keys = None
                if span.attributes and (flags or (candidates and candidates[0].step_needs_number)):
                    keys = {kv.key for kv in span.attributes}
                mapping = None
                for m in candidates:  # the mappings whose step globs match the name, in order
                    if not m.step_needs_number or (keys is not None and not keys.isdisjoint(m.step_number)):
                        mapping = m
                        break
                if mapping is not None:
                    if res is None:
                        res = resource_identity(resource.attributes, limits)
                    steps.append(_Step(mapping, span, resource, res))
                    continue
                parent = span.parent_span_id
                if not parent:
                    batch.ignored[IGNORED_FOREIGN] += 1  # a root that is no step holds no step
                    continue
                trace_id, span_id = span.trace_id, span.span_id
                trace = traces.get(trace_id)
                if trace is None:
                    trace = traces[trace_id] = {}
                    children_of[trace_id] = {}
                if span_id in trace:
                    continue  # a resend: the first copy waits already
                self._pending += 1
                truncated = keys is not None and not keys.isdisjoint(flags) and self._truncated(span)
                trace[span_id] = _Pending(parent, name, span.start_time_unix_nano, span.end_time_unix_nano,
                                          truncated, now)
                siblings = children_of[trace_id].get(parent)
                if siblings is None:
                    children_of[trace_id][parent] = [span_id]
                else:
                    siblings.append(span_id)
            if self._pending > self.max_pending or now - self._last_sweep >= 1.0:
                self._sweep(batch, now)

    def settle(self, steps: list, batch: DecodedBatch, limits: "DecodeLimits", admission: "RunAdmission") -> None:
        """Place the request's step spans, each with its buffered subtree."""
        for item in steps:
            with self._lock:
                subtree = self._take_subtree(item.span.trace_id, item.span.span_id)
            try:
                step = self._read_step(item, subtree, limits)
            except Reject as exc:
                batch.reject(exc.reason, f"{item.mapping.name} step span {item.span.name!r}: {exc.detail}")
                continue
            if step is None:  # the step span itself was force-closed: nothing in it is measured
                batch.ignored[IGNORED_UNPLACED] += 1 + len(subtree)
                continue
            place(batch, step, item.res, limits, admission, item.mapping.unmeasured, own=self.own)

    # --- internals ---------------------------------------------------------------------------

    def _step_candidates(self, name: str) -> tuple[SpanMapping, ...]:
        """The mappings whose step globs match `name`, in order (memoised: names repeat every step)."""
        found = tuple(m for m in self.mappings if m.is_step(name))
        if len(self._candidates) < 4096:
            self._candidates[name] = found
        return found

    def _truncated(self, span) -> bool:
        flags = self._flags
        if not flags or not span.attributes:
            return False
        return any(kv.key in flags and kv.value.bool_value for kv in span.attributes)

    def _take_subtree(self, trace_id: bytes, root: bytes) -> list[tuple[bytes, _Pending]]:
        """Remove and return every buffered span below `root` (depth first, parents before children)."""
        trace = self._traces.get(trace_id)
        if not trace:
            return []
        children = self._children[trace_id]
        out, stack = [], [root]
        while stack:
            for child in children.pop(stack.pop(), ()):
                entry = trace.pop(child, None)
                if entry is not None:
                    out.append((child, entry))
                    stack.append(child)
        self._pending -= len(out)
        if not trace:
            del self._traces[trace_id]
            del self._children[trace_id]
        return out

    def _reindex(self, trace_id: bytes) -> None:
        """Rebuild one trace's children index after spans left it (a sweep: rare)."""
        trace = self._traces.get(trace_id)
        if not trace:
            self._traces.pop(trace_id, None)
            self._children.pop(trace_id, None)
            return
        children: dict[bytes, list[bytes]] = {}
        for span_id, entry in trace.items():
            children.setdefault(entry.parent, []).append(span_id)
        self._children[trace_id] = children

    def _read_step(self, item: _Step, subtree: list[tuple[bytes, _Pending]], limits: "DecodeLimits") -> ForeignStep | None:
        mapping, span = item.mapping, item.span
        attrs = attributes(span.attributes, limits)
        if mapping.not_measured_flag and attrs.get(mapping.not_measured_flag) is True:
            return None
        number = _first(attrs, mapping.step_number)
        if number is not None and number.__class__ is not int:
            raise Reject(WRONG_TYPE, f"step number must be an integer, got {number!r}")
        phases, unplaced = _phases(mapping, span.span_id, subtree)
        for phase, source in mapping.phase_attributes.items():
            value = attrs.get(source.key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise Reject(WRONG_TYPE, f"{source.key} must be a number of {source.unit}, got {value!r}")
            phases[phase] = PhaseTime(float(value) * UNITS[source.unit], 1)
        start, end = span.start_time_unix_nano, span.end_time_unix_nano
        phases[METRIC_TRACED_STEP_TIME] = PhaseTime(max(0, end - start) / 1e6, 1)
        run_id = rank = world = None
        if mapping.run_id or mapping.rank or mapping.world_size:
            resource_attrs = None
            for keys, kind in ((mapping.run_id, "run"), (mapping.rank, "rank"), (mapping.world_size, "world")):
                if not keys:
                    continue
                value = _first(attrs, keys)
                if value is None:
                    if resource_attrs is None:
                        resource_attrs = attributes(item.resource.attributes, limits)
                    value = _first(resource_attrs, keys)
                if kind == "run":
                    run_id = value  # a non-string is refused by `place` (wrong_attribute_type)
                elif kind == "rank":
                    rank = _int_or_digits(value)
                else:
                    world = _int_or_digits(value)
        return ForeignStep(mapping=mapping.name, step=number, start_ns=start, end_ns=end, phases=phases,
                           unplaced=dict(unplaced), run_id=run_id, rank=rank, world_size=world)

    def _sweep(self, batch: DecodedBatch, now: float) -> None:
        """Drop buffered spans older than `max_age_s`, then the oldest while over `max_pending`."""
        self._last_sweep = now
        cutoff = now - self.max_age_s
        dropped: list[_Pending] = []
        for trace_id in list(self._traces):
            trace = self._traces[trace_id]
            old = [k for k, e in trace.items() if e.received < cutoff]
            for k in old:
                dropped.append(trace.pop(k))
            if old:
                self._reindex(trace_id)
        if self._pending - len(dropped) > self.max_pending:
            entries = sorted(((e.received, t, k) for t, tr in self._traces.items() for k, e in tr.items()))
            touched = set()
            for _, t, k in entries[: self._pending - len(dropped) - self.max_pending]:
                dropped.append(self._traces[t].pop(k))
                touched.add(t)
            for t in touched:
                self._reindex(t)
        self._pending -= len(dropped)
        for entry in dropped:
            named = any(m.phase_of(entry.name) or m.is_container(entry.name) for m in self.mappings
                        if not m.step_needs_number)
            batch.ignored[IGNORED_UNPLACED if named else IGNORED_FOREIGN] += 1


def _first(attrs: dict, keys: tuple[str, ...]):
    for key in keys:
        value = attrs.get(key)
        if value is not None:
            return value
    return None


def _int_or_digits(value):
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return value


def _phases(mapping: SpanMapping, root: bytes, subtree: list[tuple[bytes, _Pending]]) -> tuple[dict, Counter]:
    """The step's phases (summed) and its unplaced spans, from its buffered subtree."""
    children: dict[bytes, list[tuple[bytes, _Pending]]] = {}
    for span_id, entry in subtree:
        children.setdefault(entry.parent, []).append((span_id, entry))
    sums: dict[str, list] = {}
    unplaced: Counter = Counter()

    def walk(parent: bytes, inside: str | None) -> bool:
        placed_any = False
        for span_id, entry in children.get(parent, ()):
            if entry.truncated:
                unplaced[entry.name + TRUNCATED] += 1
                continue
            phase = mapping.phase_of(entry.name)
            if phase is not None and phase != inside:
                acc = sums.get(phase)
                if acc is None:
                    acc = sums[phase] = [0.0, 0]
                acc[0] += max(0, entry.end - entry.start) / 1e6
                acc[1] += 1
                inner = walk(span_id, phase)
                # Collective wait is a sub-interval other phases may hold (docs/wire-format.md): it
                # explains no span around it, so a span holding only waits still counts unplaced.
                placed_any = placed_any or inner or phase != METRIC_COLLECTIVE_WAIT
            elif walk(span_id, inside):
                placed_any = True
            elif inside is None:
                unplaced[entry.name] += 1
        return placed_any

    walk(root, None)
    return {phase: PhaseTime(ms, n) for phase, (ms, n) in sums.items()}, unplaced
