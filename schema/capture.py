"""The deep-capture wire (issue 33): what a processor asks a rank to profile and what comes back.

A confirmed finding (or a person, through `traceml capture` or the web view) asks the culprit
rank and one reference rank to record `torch.profiler` over their next few steps. The ranks
learn of it off the training thread by polling the processor's control endpoint, record on
the step boundaries the instrumentation owns, and upload one `RankCaptureSummary` each (plus,
size-capped, the raw trace that Perfetto and TensorBoard open). The processor turns the two
summaries into the finding's digest. Both sides import this module, so the paths, the JSON
keys and the operator kinds have one owner. Standard library only.

Paths (all on the processor's OTLP/HTTP listener, with its token, TLS and admission):
- `GET  CONTROL_PATH?run_id=R&rank=N`: 204 when nothing is pending for that rank, else 200 and
  a `CaptureRequest` (JSON). Handing it out marks it delivered to that rank.
- `POST CAPTURES_PATH`: a person's request, `ManualRequest` JSON -> 202 `{"capture_id": ...}`;
  404 when the run is not held by this processor (a scale-out replica that does not own it);
  409 while another capture of the run is in progress.
- `GET  CAPTURES_PATH?run_id=R`: the run's captures; `GET CAPTURES_PATH/<id>`: one, with its
  digest once both ranks answered.
- `POST CAPTURES_PATH/<id>/ranks/<rank>/summary`: a `RankCaptureSummary` (JSON);
  `.../trace`: the gzip'd Chrome trace (at most the request's `max_trace_bytes`);
  `.../failure`: `{"reason": "..."}` when the rank could not record.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

CONTROL_PATH = "/v1/traceml/control"
CAPTURES_PATH = "/v1/traceml/captures"
PART_SUMMARY = "summary"
PART_TRACE = "trace"
PART_FAILURE = "failure"
CAPTURE_PARTS: tuple[str, ...] = (PART_SUMMARY, PART_TRACE, PART_FAILURE)

ROLE_CULPRIT = "culprit"
ROLE_REFERENCE = "reference"
ROLES: tuple[str, ...] = (ROLE_CULPRIT, ROLE_REFERENCE)

# --- What an entry of a summary is (the digest calls the input path and collectives out) ------
KIND_OP = "op"
"""A CPU operator (aten::..., a custom op) or a user annotation that is none of the below."""
KIND_KERNEL = "kernel"
"""A device kernel or memcpy/memset on the GPU (CUDA activities only)."""
KIND_INPUT = "input"
"""The input path: DataLoader iteration (torch annotates `enumerate(DataLoader)#...__next__`)
and TraceML's own input annotation (`ANNOTATION_INPUT`)."""
KIND_COLLECTIVE = "collective"
"""Communication: c10d / gloo / nccl collectives, DDP's reducer, FSDP's all-gathers."""
KIND_HOST = "host"
"""Time inside the captured steps that no recorded operator covers: Python, the GIL, sleeps,
a generator's or memmap's fetch. Computed, never recorded: its name is `HOST_NAME`."""
OP_KINDS: tuple[str, ...] = (KIND_OP, KIND_KERNEL, KIND_INPUT, KIND_COLLECTIVE, KIND_HOST)

ANNOTATION_INPUT = "traceml::input"
"""The profiler range TraceML opens around input it times (timed_input, the DataLoader patch,
the inferred before-forward wait) while, and only while, a capture records."""
HOST_NAME = "(outside any operator)"

_INPUT = re.compile(r"^(enumerate\(DataLoader\)|traceml::input)")
_COLLECTIVE = re.compile(r"(c10d::|gloo:|nccl:|nccl[A-Z]|ProcessGroup|allreduce|all_reduce|allgather|"
                         r"all_gather|reduce_scatter|broadcast_|barrier|Reducer|record_param_comms)",
                         re.IGNORECASE)


def classify(name: str, on_device: bool = False) -> str:
    """The kind of one profiler entry (one owner: the rank labels, the digest trusts the label)."""
    if name == HOST_NAME:
        return KIND_HOST
    if _COLLECTIVE.search(name):
        return KIND_COLLECTIVE
    if on_device:
        return KIND_KERNEL
    if _INPUT.match(name):
        return KIND_INPUT
    return KIND_OP


# --- Bounds ----------------------------------------------------------------------------
MAX_OPS = 300
"""Entries a rank summary keeps (the largest by self time); the rest are counted, not sent."""
MAX_NAME_CHARS = 200
"""An operator name longer than this is cut (templated kernel names run to kilobytes)."""
MAX_SUMMARY_BYTES = 1 << 20
MAX_STEPS = 50
"""The most steps one capture may record (requests ask for a handful)."""
DEFAULT_STEPS = 5
DEFAULT_MAX_TRACE_BYTES = 32 << 20

# --- Capture states (the processor's book; public values in final_summary.json) --------------
STATUS_REQUESTED = "requested"
STATUS_CAPTURING = "capturing"
STATUS_DONE = "done"
STATUS_FAILED = "failed"
STATUS_REFUSED = "refused"
CAPTURE_STATUSES: tuple[str, ...] = (STATUS_REQUESTED, STATUS_CAPTURING, STATUS_DONE, STATUS_FAILED,
                                     STATUS_REFUSED)
TRIGGER_MANUAL = "manual"
"""A person asked; otherwise a capture's trigger is the diagnosis kind of its finding."""


class CaptureFormatError(ValueError):
    """A capture document that does not follow this module: the message says which key and why."""


def _need(doc: dict, key: str, kinds, what: str):
    value = doc.get(key)
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise CaptureFormatError(f"{what}: {key!r} must be {_kind_names(kinds)}, got a boolean")
    if not isinstance(value, kinds):
        raise CaptureFormatError(f"{what}: {key!r} must be {_kind_names(kinds)}, got {type(value).__name__}")
    return value


def _kind_names(kinds) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(k.__name__ for k in kinds)


def _ms(doc: dict, key: str, what: str) -> float:
    value = float(_need(doc, key, (int, float), what))
    if not math.isfinite(value) or value < 0:
        raise CaptureFormatError(f"{what}: {key!r} must be a finite number >= 0, got {value!r}")
    return value


def _whole(doc: dict, key: str, what: str, lo: int, hi: int | None = None) -> int:
    """An integer (never a boolean) in lo..hi (or >= lo)."""
    value = _need(doc, key, int, what)
    if value < lo or (hi is not None and value > hi):
        span = f">= {lo}" if hi is None else f"{lo}..{hi}"
        raise CaptureFormatError(f"{what}: {key!r} must be {span}, got {value}")
    return value


def _role(doc: dict, what: str) -> str:
    role = _need(doc, "role", str, what)
    if role not in ROLES:
        raise CaptureFormatError(f"{what}: 'role' must be one of {', '.join(ROLES)}, got {role!r}")
    return role


def _load(raw: bytes | str, what: str) -> dict:
    if len(raw) > MAX_SUMMARY_BYTES:
        raise CaptureFormatError(f"{what}: {len(raw)} bytes, over the {MAX_SUMMARY_BYTES} allowed")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CaptureFormatError(f"{what}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CaptureFormatError(f"{what}: must be a JSON object")
    return doc


@dataclass(frozen=True)
class CaptureRequest:
    """What a rank is asked to record: its answer goes to `CAPTURES_PATH/<capture_id>/ranks/<rank>/...`."""

    capture_id: str
    run_id: str
    rank: int
    role: str
    steps: int = DEFAULT_STEPS
    max_trace_bytes: int = DEFAULT_MAX_TRACE_BYTES

    def to_json(self) -> bytes:
        return json.dumps({"capture_id": self.capture_id, "run_id": self.run_id, "rank": self.rank,
                           "role": self.role, "steps": self.steps,
                           "max_trace_bytes": self.max_trace_bytes}).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> "CaptureRequest":
        what = "capture request"
        doc = _load(raw, what)
        role = _role(doc, what)
        steps = _whole(doc, "steps", what, 1, MAX_STEPS)
        max_bytes = _whole(doc, "max_trace_bytes", what, 0)
        return cls(capture_id=_capture_id(doc, what), run_id=_need(doc, "run_id", str, what),
                   rank=_rank(doc, what), role=role, steps=steps, max_trace_bytes=max_bytes)


@dataclass(frozen=True)
class ManualRequest:
    """A person's request (`traceml capture`, the web view's button)."""

    run_id: str
    rank: int
    reference: int | None = None
    steps: int = DEFAULT_STEPS

    def to_json(self) -> bytes:
        return json.dumps({"run_id": self.run_id, "rank": self.rank, "reference": self.reference,
                           "steps": self.steps}).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> "ManualRequest":
        what = "capture request"
        doc = _load(raw, what)
        reference = doc.get("reference")
        if reference is not None:
            reference = _rank({"rank": reference}, what + " 'reference'")
        steps = _whole({"steps": doc.get("steps", DEFAULT_STEPS)}, "steps", what, 1, MAX_STEPS)
        return cls(run_id=_need(doc, "run_id", str, what), rank=_rank(doc, what), reference=reference,
                   steps=steps)


@dataclass(frozen=True)
class OpTime:
    """One entry of a rank's capture, summed over the captured steps (self times: no double count)."""

    name: str
    kind: str
    count: int
    self_ms: float
    """Host (CPU) self time; for a kernel, 0."""
    device_ms: float = 0.0
    """Device self time (kernels, CUDA activities only)."""


@dataclass(frozen=True)
class RankCaptureSummary:
    """One rank's answer: what it recorded over its captured steps."""

    capture_id: str
    run_id: str
    rank: int
    role: str
    first_step: int
    """The step number (the step span's) of the first captured step."""
    step_ms: tuple[float, ...]
    """Each captured step's wall time, as the instrumentation measured it."""
    activities: tuple[str, ...]
    """`cpu`, and `cuda` when device activities were recorded."""
    ops: tuple[OpTime, ...]
    """At most MAX_OPS entries, largest self time first; KIND_HOST holds the uncovered time."""
    ops_left_out: int = 0
    trace_bytes: int | None = None
    """Size of the trace uploaded beside it; None when none was kept."""
    trace_note: str | None = None
    """Why the trace was not kept (over the cap, export failed), when it was not."""
    torch_version: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """What this rank could not see (for example: "no CUDA activities: the rank runs on CPU")."""

    def to_json(self) -> bytes:
        return json.dumps({
            "capture_id": self.capture_id, "run_id": self.run_id, "rank": self.rank, "role": self.role,
            "first_step": self.first_step, "step_ms": list(self.step_ms),
            "activities": list(self.activities),
            "ops": [{"name": op.name, "kind": op.kind, "count": op.count, "self_ms": op.self_ms,
                     "device_ms": op.device_ms} for op in self.ops],
            "ops_left_out": self.ops_left_out, "trace_bytes": self.trace_bytes,
            "trace_note": self.trace_note, "torch_version": self.torch_version,
            "notes": list(self.notes)}).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> "RankCaptureSummary":
        what = "capture summary"
        doc = _load(raw, what)
        role = _role(doc, what)
        steps = _need(doc, "step_ms", list, what)
        if not 1 <= len(steps) <= MAX_STEPS:
            raise CaptureFormatError(f"{what}: 'step_ms' must hold 1..{MAX_STEPS} steps, got {len(steps)}")
        step_ms = tuple(_ms({"step_ms": s}, "step_ms", what) for s in steps)
        activities = tuple(_need(doc, "activities", list, what))
        if not activities or any(a not in ("cpu", "cuda") for a in activities):
            raise CaptureFormatError(f"{what}: 'activities' must list 'cpu' and/or 'cuda'")
        raw_ops = _need(doc, "ops", list, what)
        if len(raw_ops) > MAX_OPS:
            raise CaptureFormatError(f"{what}: {len(raw_ops)} ops, over the {MAX_OPS} allowed")
        ops = []
        for i, entry in enumerate(raw_ops):
            where = f"{what} ops[{i}]"
            if not isinstance(entry, dict):
                raise CaptureFormatError(f"{where}: must be an object")
            kind = _need(entry, "kind", str, where)
            if kind not in OP_KINDS:
                raise CaptureFormatError(f"{where}: 'kind' must be one of {', '.join(OP_KINDS)}, got {kind!r}")
            count = _whole(entry, "count", where, 0)
            ops.append(OpTime(name=_need(entry, "name", str, where)[:MAX_NAME_CHARS], kind=kind, count=count,
                              self_ms=_ms(entry, "self_ms", where),
                              device_ms=_ms(entry, "device_ms", where) if "device_ms" in entry else 0.0))
        trace_bytes = None if doc.get("trace_bytes") is None else _whole(doc, "trace_bytes", what, 0)
        first_step = _need(doc, "first_step", int, what)
        left_out = _whole({"ops_left_out": doc.get("ops_left_out", 0)}, "ops_left_out", what, 0)
        notes = doc.get("notes", [])
        if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
            raise CaptureFormatError(f"{what}: 'notes' must be a list of strings")
        trace_note = doc.get("trace_note")
        if trace_note is not None and not isinstance(trace_note, str):
            raise CaptureFormatError(f"{what}: 'trace_note' must be null or a string")
        torch_version = doc.get("torch_version", "")
        if not isinstance(torch_version, str):
            raise CaptureFormatError(f"{what}: 'torch_version' must be a string")
        return cls(capture_id=_capture_id(doc, what), run_id=_need(doc, "run_id", str, what),
                   rank=_rank(doc, what), role=role, first_step=first_step, step_ms=step_ms,
                   activities=activities, ops=tuple(ops), ops_left_out=left_out, trace_bytes=trace_bytes,
                   trace_note=trace_note, torch_version=torch_version[:64], notes=tuple(n[:300] for n in notes[:20]))


_CAPTURE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _capture_id(doc: dict, what: str) -> str:
    value = _need(doc, "capture_id", str, what)
    if not _CAPTURE_ID.match(value):
        raise CaptureFormatError(f"{what}: 'capture_id' must be 1-64 of [A-Za-z0-9_-], got {value[:80]!r}")
    return value


def valid_capture_id(value: str) -> bool:
    """True when `value` can name a capture (and so a folder): one owner of the id's shape."""
    return bool(_CAPTURE_ID.match(value))


def _rank(doc: dict, what: str) -> int:
    return _whole(doc, "rank", what, 0)


def trace_file_name(run_label: str, capture_id: str, rank: int) -> str:
    """The raw trace's file name: `.pt.trace.json.gz` is what TensorBoard's profiler plugin lists
    and Perfetto opens as a gzip'd Chrome trace."""
    return f"{run_label}.{capture_id}.rank{rank}.pt.trace.json.gz"
