"""The training side of a deep capture (issue 33): `torch.profiler` over a few whole steps, on request.

The exporter's control client (`traceml.exporter.control`) hands a `CaptureRequest` to `arm()`
on its own thread. Arming sets `step_events.step_end_hook`, so at the next step end (on the
training thread, inside `complete_step_capture`, the boundary every way of marking steps goes
through) the profiler starts; after `request.steps` more completed steps it stops, at a step
end too: a capture never cuts a step. While it records, every TraceML input region entered
(timed_input, the DataLoader patch, a wrapped loader) opens a profiler range named
`ANNOTATION_INPUT`, and an inferred step with no DataLoader gets one from its start to its first
timed phase (the wait `step_boundary.before_forward_wait` measures), so the input path is named
even for a generator or a memory-mapped loop. The summary and the gzip'd trace are built by a
short-lived daemon thread, never the training thread, and handed to the `deliver` callback the
control client gave, which uploads them from the exporter's thread.

What this module deliberately does not do: poll, talk HTTP, or decide what to capture. When
no capture is pending nothing here runs (a step end reads one global, `step_end_hook`), and
`torch.profiler` is imported only when a request arrives, on the control client's thread.
"""
from __future__ import annotations

import gzip
import io
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

from traceml.schema.capture import (
    ANNOTATION_INPUT,
    HOST_NAME,
    KIND_HOST,
    MAX_NAME_CHARS,
    MAX_OPS,
    CaptureRequest,
    OpTime,
    RankCaptureSummary,
    classify,
)
from traceml.schema.vocabulary import RAW_DATALOADER_NEXT

from . import step_events as _se
from .process_state import timing_policy as _policy
from .step_boundary import INFERRED_STEP

_perf_ns = time.perf_counter_ns
_PROFILER_STEP = "ProfilerStep#"
"""torch.profiler's own range around a profiled window: not an operator; its self time is what no
operator covers, which the summary counts as KIND_HOST itself."""


@dataclass(frozen=True)
class CaptureResult:
    """A rank's answer to one request: a summary (and the trace when kept), or why there is none."""

    request: CaptureRequest
    summary: RankCaptureSummary | None = None
    trace: bytes | None = None
    """The gzip'd Chrome trace, at most `request.max_trace_bytes`; None when not kept."""
    failure: str | None = None


Deliver = Callable[[CaptureResult], None]


class _Recording:
    """A capture that records: the profiler, the steps measured so far, the open before-forward range."""

    __slots__ = ("request", "deliver", "profiler", "cuda", "first_step", "step_ms", "t_prev", "before",
                 "before_ns", "tail_input_ms")

    def __init__(self, request: CaptureRequest, deliver: Deliver, profiler, cuda: bool, first_step: int) -> None:
        self.request = request
        self.deliver = deliver
        self.profiler = profiler
        self.cuda = cuda
        self.first_step = first_step
        self.step_ms: list[float] = []
        self.t_prev = _perf_ns()
        self.before = None  # the ANNOTATION_INPUT range of an inferred step's time before forward
        self.before_ns = 0  # when it opened
        self.tail_input_ms = 0.0  # a range still open when the run ended: after the last step, so not input


_lock = threading.Lock()
_pending: tuple[CaptureRequest, Deliver] | None = None  # armed, waiting for the next step end
_recording: _Recording | None = None  # written on the training thread only
_busy = False  # armed, recording or building: one capture at a time per rank
_record_function = None  # torch.autograd.profiler.record_function, bound by arm()


def arm(request: CaptureRequest, deliver: Deliver) -> str | None:
    """Record `request` from the next step end on; None when armed, else why not (nothing armed).

    Called on the control client's thread. `deliver(CaptureResult)` is called exactly once per
    armed request, on the builder thread (or the training thread, for a profiler that fails to
    start or stop), and must not block.
    """
    global _pending, _busy, _record_function
    with _lock:
        if _busy:
            return "another capture is in progress on this rank"
        if not _se.is_recording():
            return "TraceML is not recording on this rank"
        # Kineto (torch 2.13) prints "USDT:... profiler_start/stop" on the rank's stderr at each
        # capture, in the middle of the job's own output; level 6 silences it (5 and below still
        # print). Read when the profiler is first used, so set here, before that; a user's own
        # KINETO_LOG_LEVEL is kept.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        try:
            import torch.profiler  # noqa: F401  (here, off the training thread: it loads the profiler)
            from torch.autograd.profiler import record_function
        except Exception as exc:
            return f"torch.profiler is not available: {type(exc).__name__}: {exc}"
        _record_function = record_function
        _pending = (request, deliver)
        _busy = True
        _se.step_end_hook = _on_step_end
    return None


def busy() -> bool:
    """Whether a capture is armed, records or is being summarised (its answer not yet delivered)."""
    return _busy


def cancel_pending(reason: str) -> bool:
    """Drop an armed capture that has not started (any thread); its answer is a failure with `reason`."""
    global _pending
    with _lock:
        pending, _pending = _pending, None
        if pending is None:
            return False
        if _recording is None:
            _se.step_end_hook = None
    _answer(pending[0], pending[1], failure=reason)
    return True


def end_of_run() -> None:
    """The run ends (`traceml.shutdown`, on the training thread): a capture that records stops now and
    answers with the steps it has, or a failure when it has none; one armed but not started fails."""
    cancel_pending("the run ended before the capture began")
    rec = _recording
    if rec is None:
        return
    done, asked = len(rec.step_ms), rec.request.steps
    if rec.before is not None:  # opened at the last step's end for a step that never came
        rec.tail_input_ms = (_perf_ns() - rec.before_ns) / 1e6
    if done:
        _stop(rec, note=f"the run ended after {done} of {asked} captured steps")
    else:
        _stop(rec, failure="the run ended before the first captured step completed")


# --- the training thread ------------------------------------------------------------------


def _on_step_end(step: int, events: list) -> None:
    """`step_events.step_end_hook`: step `step` just completed (its events are `events`)."""
    now = _perf_ns()
    rec = _recording
    if rec is None:
        _start(step, events)
        return
    _close_before(rec)
    rec.step_ms.append((now - rec.t_prev) / 1e6)
    rec.t_prev = now
    if len(rec.step_ms) >= rec.request.steps:
        _stop(rec)
    else:
        _open_before(rec, events)


def _start(step: int, events: list) -> None:
    global _pending, _recording
    with _lock:
        pending, _pending = _pending, None
    if pending is None:
        _se.step_end_hook = None
        return
    request, deliver = pending
    try:
        from torch.profiler import ProfilerActivity, profile

        cuda = _rank_on_cuda()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        profiler = profile(activities=activities, record_shapes=False, profile_memory=False, with_stack=False)
        profiler.start()
    except Exception as exc:
        _se.step_end_hook = None
        _answer(request, deliver, failure=f"the profiler did not start: {type(exc).__name__}: {exc}")
        return
    rec = _recording = _Recording(request, deliver, profiler, cuda, step + 1)
    _se.region_annotation = _open_range
    _se.refresh_fast_path()  # the fast paths off: every region passes `_open_range`
    _open_before(rec, events)


def _stop(rec: _Recording, note: str | None = None, failure: str | None = None) -> None:
    """Stop recording (at a step end, or at the run's end); the summary is built on a daemon thread."""
    global _recording
    _recording = None
    _se.step_end_hook = None
    _se.region_annotation = None
    _se.refresh_fast_path()
    _close_before(rec)
    try:
        rec.profiler.stop()
    except Exception as exc:
        failure = failure or f"the profiler did not stop cleanly: {type(exc).__name__}: {exc}"
    if failure is not None:
        _answer(rec.request, rec.deliver, failure=failure)
        return
    threading.Thread(target=_build_and_deliver, args=(rec, note), name="traceml-deep-capture",
                     daemon=True).start()


def _open_range(raw_event: str):
    """`step_events.region_annotation`: a region opens; an input region gets an ANNOTATION_INPUT range.

    The first region of an inferred step also ends that step's before-forward range."""
    rec = _recording
    if rec is None:
        return None
    if rec.before is not None:
        _close_before(rec)
    if raw_event != RAW_DATALOADER_NEXT:
        return None
    return _enter_input_range()


def _open_before(rec: _Recording, events: list) -> None:
    """After an inferred step with no DataLoader, the next step's time before its first phase is input."""
    inferred = loader = False
    for event in events:
        name = event[0]
        if name == INFERRED_STEP:
            inferred = True
        elif name == RAW_DATALOADER_NEXT:
            loader = True
    if inferred and not loader:
        rec.before = _enter_input_range()
        rec.before_ns = _perf_ns()


def _close_before(rec: _Recording) -> None:
    rng, rec.before = rec.before, None
    if rng is not None:
        try:
            rng.__exit__(None, None, None)
        except Exception:
            pass


def _enter_input_range():
    try:
        rng = _record_function(ANNOTATION_INPUT)
        rng.__enter__()
        return rng
    except Exception:
        return None


def _rank_on_cuda() -> bool:
    """The rank's steps run on a GPU: regions use CUDA events, or the process initialised CUDA."""
    from .timing import cuda_in_use

    return bool(_policy.gpu_default) or cuda_in_use()


# --- off the training thread ----------------------------------------------------------------


def _answer(request: CaptureRequest, deliver: Deliver, *, failure: str | None = None,
            summary: RankCaptureSummary | None = None, trace: bytes | None = None) -> None:
    global _busy
    result = CaptureResult(request, summary=summary, trace=trace, failure=failure)
    with _lock:
        _busy = _pending is not None or _recording is not None
    try:
        deliver(result)
    except Exception:
        pass


def _build_and_deliver(rec: _Recording, note: str | None) -> None:
    try:
        import torch

        ops, left_out = summary_ops(rec.profiler.key_averages(), rec.step_ms, rec.tail_input_ms)
        trace, trace_note = gzip_trace(rec.profiler, rec.request.max_trace_bytes)
        notes = [] if rec.cuda else ["no CUDA activities: the rank runs on CPU"]
        if note:
            notes.append(note)
        request = rec.request
        summary = RankCaptureSummary(
            capture_id=request.capture_id, run_id=request.run_id, rank=request.rank, role=request.role,
            first_step=rec.first_step, step_ms=tuple(round(ms, 4) for ms in rec.step_ms),
            activities=("cpu", "cuda") if rec.cuda else ("cpu",), ops=ops, ops_left_out=left_out,
            trace_bytes=None if trace is None else len(trace), trace_note=trace_note,
            torch_version=str(torch.__version__)[:64], notes=tuple(notes))
    except Exception as exc:
        _answer(rec.request, rec.deliver,
                failure=f"the capture could not be summarised: {type(exc).__name__}: {exc}"[:300])
        return
    finally:
        rec.profiler = None  # the recorded events go with the last reference
    _answer(rec.request, rec.deliver, summary=summary, trace=trace)


def summary_ops(averages, step_ms, tail_input_ms: float = 0.0) -> tuple[tuple[OpTime, ...], int]:
    """The entries of a rank summary from `key_averages()` (grouped by name, self times), and how many
    were left out: the largest first, at most MAX_OPS, the KIND_HOST entry (the captured steps' wall
    time that no recorded host operator covers, never below 0) always among them.

    `tail_input_ms`: an input range the end of the run closed (opened at the last step's end for a
    step that never came) lies outside the captured steps: its time and occurrence are taken out."""
    merged: dict[tuple[str, str], list] = {}
    covered_ms = 0.0
    for avg in averages:
        name = str(avg.key)
        if name.startswith(_PROFILER_STEP):
            continue
        if tail_input_ms and name == ANNOTATION_INPUT:
            avg = _Trimmed(avg, tail_input_ms)
        on_device = str(getattr(avg, "device_type", "")).rsplit(".", 1)[-1] == "CUDA"
        if on_device and getattr(avg, "is_user_annotation", False):
            continue  # a range's GPU span overlaps the kernels it holds: they are counted themselves
        name = name[:MAX_NAME_CHARS]
        if on_device:
            self_ms = 0.0
            device_us = getattr(avg, "self_device_time_total", None)
            if device_us is None:
                device_us = getattr(avg, "self_cuda_time_total", 0.0)
            device_ms = max(0.0, float(device_us)) / 1000.0
        else:
            self_ms = max(0.0, float(avg.self_cpu_time_total)) / 1000.0
            device_ms = 0.0
            covered_ms += self_ms
        entry = merged.setdefault((name, classify(name, on_device)), [0, 0.0, 0.0])
        entry[0] += int(avg.count)
        entry[1] += self_ms
        entry[2] += device_ms
    host = OpTime(name=HOST_NAME, kind=KIND_HOST, count=len(step_ms),
                  self_ms=round(max(0.0, sum(step_ms) - covered_ms), 4))
    ops = [OpTime(name=name, kind=kind, count=count, self_ms=round(self_ms, 4), device_ms=round(device_ms, 4))
           for (name, kind), (count, self_ms, device_ms) in merged.items()]
    ops.append(host)
    ops.sort(key=lambda op: op.self_ms + op.device_ms, reverse=True)
    kept = ops[:MAX_OPS]
    if host not in kept:
        kept[-1] = host
    return tuple(kept), len(ops) - len(kept)


class _Trimmed:
    """An average less one occurrence of `ms` (CPU self time), the rest as it is."""

    def __init__(self, avg, ms: float) -> None:
        self.key, self.device_type = avg.key, getattr(avg, "device_type", "")
        self.count = max(0, int(avg.count) - 1)
        self.self_cpu_time_total = max(0.0, float(avg.self_cpu_time_total) - ms * 1000.0)


def gzip_trace(profiler, max_bytes: int) -> tuple[bytes | None, str | None]:
    """The profiler's Chrome trace, gzip'd, when it fits `max_bytes`; else None and why not."""
    if max_bytes <= 0:
        return None, "no raw trace was asked for (max_trace_bytes is 0)"
    try:
        with tempfile.TemporaryDirectory(prefix="traceml-capture-") as folder:
            path = os.path.join(folder, "trace.json")
            profiler.export_chrome_trace(path)
            out = io.BytesIO()
            with open(path, "rb") as source, gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6, mtime=0) as gz:
                while True:
                    chunk = source.read(1 << 20)
                    if not chunk:
                        break
                    gz.write(chunk)
                    if out.tell() > max_bytes:
                        return None, f"the raw trace is over the {max_bytes}-byte cap (gzip'd): not kept"
            data = out.getvalue()
    except Exception as exc:
        return None, f"the raw trace could not be exported: {type(exc).__name__}: {exc}"[:300]
    if len(data) > max_bytes:
        return None, f"the raw trace is over the {max_bytes}-byte cap (gzip'd): not kept"
    return data, None


def reset() -> None:
    """Forget every capture (the test seam, `traceml._testing`): no hook, no range, nothing armed."""
    global _pending, _recording, _busy
    rec = _recording
    with _lock:
        _pending = None
        _recording = None
        _busy = False
    _se.step_end_hook = None
    _se.region_annotation = None
    _se.refresh_fast_path()
    if rec is not None:
        _close_before(rec)
        try:
            rec.profiler.stop()
        except Exception:
            pass
