"""`OtlpStepExporter`: the TelemetrySink that turns finished steps into OTLP on its own thread.

The samplers call `on_step_time` / `on_step_memory` on their threads; each call only
appends the record to a bounded queue of ours (drop-new-when-full, counted) and
returns. One daemon thread builds the protobuf messages, sends them, counts
failures and retries, periodically exports the drop/failure/retry counters, and
at shutdown drains, sends final counters and the `traceml.run.end` marker, all
within a bounded time. No method raises into the caller.

A step's peak memory travels on its step span. Timing and memory reach us from two
sampler threads, so the worker joins them by step number: a measured snapshot waits
for its step (`_memory_by_step`), and while the job's snapshots carry measured peaks
a step waits up to `MEMORY_JOIN_WAIT_S` for its snapshot. Snapshots come from one
sampler thread in step order, so once its own or a later step's snapshot has arrived, a
step still without one will not get it (the instrumentation lost or never took it): it leaves
at once instead of waiting, and a run of such steps cannot hold the queue
`MEMORY_JOIN_WAIT_S` per step until it overflows. A measured snapshot whose step was
already sent is counted as dropped (queue `metrics`, the memory queue).

Resource snapshots (`on_resources`, from the resource sampler's thread) wait in a bounded
queue of their own, dropped and counted under the same `metrics` queue when it is full,
and leave as one OTLP metrics request per drain (`OtlpEncoder.add_resource_points`).

The worker is woken by work, not by a clock. Everything that gives it something to do
(a record queued, a batch full, a flush, shutdown) sets one event, `_wake`, through
`_notify`; the deep-capture control client (`control`) shares it the same way: it polls on
the rounds that run while steps arrive and wakes the worker only when a capture's answer is
ready to upload. While
records arrive it exports every `export_interval_s` (the bound on how long a queued
record waits) or as soon as a batch is full. A round that finds nothing to send parks
the worker: it sleeps with no timeout, and the next record queued wakes it and is sent
at once. A parked worker keeps a timed wake-up only while its counters changed since they were
last sent (they go out `telemetry_interval_s` after the previous ones), and one to
release its transport after `TRANSPORT_IDLE_S` (an open gRPC channel keeps grpc's own
threads waking), so an idle job's exporter costs nothing. The records are handed over on the samplers' threads,
so the wake-up (one `Event.set` after a park) is never the training thread's.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from .identity import RunIdentity
from traceml.records import ResolvedStepTime, ResourceSnapshot, StepMemorySnapshot
from traceml.schema import vocabulary as v

from .control import ControlClient, ControlStats
from .encoding import EncodedRequest, OtlpEncoder
from .process_ending import noted_ending
from .settings import DEFAULT_SHUTDOWN_TIMEOUT_S, ExporterSettings
from .transport import ExportOutcome, make_transport

_log = logging.getLogger("traceml.exporter")

QUEUE_SPANS = "spans"
QUEUE_METRICS = "metrics"  # the memory snapshots' and resource snapshots' queue (the vocabulary's name)

RESOURCE_QUEUE_SIZE = 1024
"""Resource snapshots held at most (or the queue size, if smaller) while the endpoint is away:
over an hour at the default 5 s interval, about 1 kB each."""

TRANSPORT_IDLE_S = 5.0
"""After this long parked (at least 6 s after the last record: a round that found nothing comes
first), the worker releases its transport: an open gRPC channel's grpc threads cost about 0.1 %
of a core. The next export connects again, a few milliseconds on this thread, so a job whose
steps are more than about 6 s apart pays that per step instead: about what the open channel
would have cost it."""

MEMORY_JOIN_WAIT_S = 2.0
"""How long a step waits for its memory snapshot: a few sampler intervals (both
samplers publish the step at the same moment, each on its own thread)."""


@dataclass(frozen=True, slots=True)
class ExporterStats:
    """Counts since start; `dropped` holds this exporter's queues and the instrumentation's."""

    steps_received: int
    steps_exported: int
    spans_exported: int
    memory_exported: int  # measured memory snapshots delivered on their step spans
    dropped: Mapping[str, int]
    failures: Mapping[str, int]
    retries: Mapping[str, int]
    queued_steps: int
    queued_memory: int
    resources_exported: int = 0  # resource snapshots delivered (one OTLP metrics request per drain)
    queued_resources: int = 0
    control: ControlStats | None = None  # the deep-capture control client's counts; None when not configured


def _instrumentation_drops() -> Mapping[str, int]:
    """`traceml.step_events.dropped_counts()` when the instrumentation is importable."""
    try:
        from traceml import step_events
    except Exception:
        return {}
    try:
        return dict(step_events.dropped_counts())
    except Exception:
        return {}


class OtlpStepExporter:
    """Implements `traceml.records.TelemetrySink`; see the module docstring."""

    def __init__(self, identity: RunIdentity, settings: ExporterSettings, *,
                 instrumentation_drops: Callable[[], Mapping[str, int]] | None = None,
                 transport=None):
        self.identity = identity
        self.settings = settings
        self._encoder = OtlpEncoder(identity, settings)
        self._instrumentation_drops = instrumentation_drops or _instrumentation_drops
        self._stop = threading.Event()  # aborts retry backoff (shutdown deadline reached)
        self._transport = transport or make_transport(settings, self._stop)
        self._steps: collections.deque[ResolvedStepTime] = collections.deque()
        self._memory: collections.deque[StepMemorySnapshot] = collections.deque()
        self._memory_by_step: dict[int, StepMemorySnapshot] = {}  # measured, waiting for their step
        self._resources: collections.deque[ResourceSnapshot] = collections.deque()
        self._resource_capacity = min(RESOURCE_QUEUE_SIZE, settings.queue_size)
        self._resources_exported = 0
        self._expect_memory = False  # the latest snapshot had a measured peak: steps wait for theirs
        self._memory_high: int | None = None  # the highest step a measured snapshot arrived for
        self._head_since: float | None = None  # when the step at the queue's head began waiting
        self._capacity = settings.queue_size
        self._wake_at = max(1, min(settings.max_batch, settings.queue_size // 2))
        self._wake = threading.Event()  # set by `_notify`: work arrived (see the module docstring)
        self._parked = False  # the worker sleeps until `_notify`; producers read it after queueing
        self._parked_since: float | None = None  # monotonic; None while not parked
        self._transport_held = True  # False once released while idle, until the next export
        self.parks = 0  # rounds that ended parked (tests, benchmarks)
        self._flush_waiters: list[threading.Event] = []
        self._closing = False
        self._shutdown_deadline: float | None = None
        self._start_ns = time.time_ns()
        self._dropped = {QUEUE_SPANS: 0, QUEUE_METRICS: 0}
        self._failures = {s: 0 for s in v.EXPORTED_SIGNALS}
        self._retries = {s: 0 for s in v.EXPORTED_SIGNALS}
        self._steps_received = 0
        self._steps_exported = 0
        self._spans_exported = 0
        self._memory_exported = 0
        self._last_step: int | None = None
        self._failure_logs = 0
        self._last_counters: tuple | None = None
        self._run_end_sent = False
        self._final_steps: int | None = None
        self._final_step_boundary: str | None = None
        self._final_instrumentation_drops: Mapping[str, int] | None = None
        self._control = self._control_client(identity, settings)
        self._thread = threading.Thread(target=self._run, name="traceml-otlp-exporter", daemon=True)
        self._thread.start()

    def _control_client(self, identity: RunIdentity, settings: ExporterSettings) -> ControlClient | None:
        """The deep-capture control client when an endpoint is configured; one that cannot be built
        (an unusable TLS file, say) is logged and left out: export goes on without it."""
        if not settings.control_endpoints:
            return None
        try:
            return ControlClient(identity, settings, self._notify)
        except Exception as exc:
            _log.error("traceml: deep-capture control off (%s: %s)", type(exc).__name__, exc)
            return None

    # --- TelemetrySink (sampler threads) -------------------------------------------------

    def on_step_time(self, record: ResolvedStepTime) -> None:
        if self._closing or len(self._steps) >= self._capacity:
            self._dropped[QUEUE_SPANS] += 1
            return
        self._steps.append(record)
        self._steps_received += 1
        if self._parked or len(self._steps) >= self._wake_at:
            self._notify()

    def on_step_memory(self, record: StepMemorySnapshot) -> None:
        if self._closing or len(self._memory) >= self._capacity:
            self._dropped[QUEUE_METRICS] += 1
            return
        self._memory.append(record)
        if self._parked or len(self._memory) >= self._wake_at:
            self._notify()

    def on_resources(self, snapshot: ResourceSnapshot) -> None:
        """One resource sampler tick; sent with the next drain (they are seconds apart)."""
        if self._closing or len(self._resources) >= self._resource_capacity:
            self._dropped[QUEUE_METRICS] += 1
            return
        self._resources.append(snapshot)
        if self._parked:
            self._notify()

    def _notify(self) -> None:
        """Wake the worker: there is something to do (every producer of work calls this)."""
        self._parked = False
        self._wake.set()

    def on_run_end(self, steps_completed: int, dropped_counts: Mapping[str, int],
                   step_boundary: str | None = None) -> None:
        """Final counts from the instrumentation (called by `traceml.shutdown()` before `shutdown`).

        `step_boundary`: how the steps were delimited (`vocabulary.STEP_BOUNDARIES`), sent
        on the run-end marker as `traceml.steps.boundary`."""
        if step_boundary in v.STEP_BOUNDARIES:
            self._final_step_boundary = step_boundary
        try:
            self._final_steps = int(steps_completed)
            self._final_instrumentation_drops = {k: int(n) for k, n in dict(dropped_counts).items()}
        except Exception as exc:
            self._note_failure(f"bad run-end counts ignored: {exc}")

    # --- control -----------------------------------------------------------------------

    def stats(self) -> ExporterStats:
        return ExporterStats(
            steps_received=self._steps_received, steps_exported=self._steps_exported,
            spans_exported=self._spans_exported, memory_exported=self._memory_exported,
            dropped=self._all_drops(), failures=dict(self._failures), retries=dict(self._retries),
            queued_steps=len(self._steps), queued_memory=len(self._memory) + len(self._memory_by_step),
            resources_exported=self._resources_exported, queued_resources=len(self._resources),
            control=None if self._control is None else self._control.stats())

    def force_flush(self, timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> bool:
        """Export everything queued so far; True when done within `timeout_s`."""
        if not self._thread.is_alive():
            return False
        done = threading.Event()
        self._flush_waiters.append(done)
        self._notify()
        return done.wait(timeout_s)

    def shutdown(self, timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> bool:
        """Drain, send final counters and the run-end marker; returns within about `timeout_s`.

        True when everything queued was handed to the endpoint (delivered or counted as failed)
        and the worker finished in time.
        """
        if self._closing:
            self._thread.join(max(0.0, timeout_s))
            return not self._thread.is_alive()
        self._shutdown_deadline = time.monotonic() + max(0.0, timeout_s)
        self._closing = True
        self._notify()
        self._thread.join(max(0.0, timeout_s))
        if self._thread.is_alive():
            self._stop.set()  # cut any retry backoff short
            self._thread.join(1.0)
        finished = not self._thread.is_alive()
        self._transport.close()  # also cancels a gRPC call still in flight (the worker is a daemon)
        if self._control is not None:
            self._control.close()
        return finished

    @property
    def run_end_sent(self) -> bool:
        return self._run_end_sent

    # --- worker --------------------------------------------------------------------------

    def _run(self) -> None:
        next_counters = time.monotonic() + self.settings.telemetry_interval_s
        sent = 0  # nothing queued yet: park (until the first counters are due)
        while True:
            if not self._closing:
                self._wake.wait(self._next_wait(sent, next_counters))
                self._wake.clear()
            waiters, self._flush_waiters = self._flush_waiters, []
            closing = self._closing
            sent = 0
            if self._parked and not closing and not waiters:
                self._release_transport_if_idle()
            try:
                sent = self._drain(final=closing or bool(waiters))
                if closing:
                    if self._control is not None:
                        self._control.finish(self._control_deadline())
                    self._send_counters(force=True)
                    self._send_run_end()
                elif time.monotonic() >= next_counters:
                    self._send_counters(force=False)
                    next_counters = time.monotonic() + self.settings.telemetry_interval_s
                if self._control is not None and not closing:
                    self._control.on_round(self._steps_received)
            except Exception as exc:  # the worker must survive anything a record can do
                self._note_failure(f"exporter worker error: {type(exc).__name__}: {exc}")
            finally:
                for w in waiters + (self._flush_waiters if closing else []):
                    w.set()
            if closing:
                return

    def _control_deadline(self) -> float:
        """Shutdown: a capture's answer may use half the time left, so the final counters and the
        run-end marker keep the other half."""
        now = time.monotonic()
        end = self._shutdown_deadline if self._shutdown_deadline is not None else now
        return now + max(0.0, end - now) / 2

    def _queued(self) -> bool:
        return bool(self._steps or self._memory or self._memory_by_step or self._resources)

    def _next_wait(self, sent: int, next_counters: float) -> float | None:
        """How long the worker may sleep: an export interval while records arrive or wait;
        after a round that sent nothing and with nothing queued, until `_notify` (parked), or
        until the counters are due when they changed since they were last sent, or until the
        transport is to be released."""
        if sent or self._queued() or self._flush_waiters:
            self._parked_since = None
            return self.settings.export_interval_s
        self._parked = True
        if self._queued() or self._flush_waiters or self._closing:  # queued while parking: do not sleep
            self._parked = False
            self._parked_since = None
            return 0.0
        self.parks += 1
        now = time.monotonic()
        if self._parked_since is None:
            self._parked_since = now
        waits = []
        if self._counters_snapshot() != self._last_counters:
            waits.append(max(0.0, next_counters - now))
        if self._transport_held:
            waits.append(max(0.0, self._parked_since + TRANSPORT_IDLE_S - now))
        return min(waits) if waits else None

    def _release_transport_if_idle(self) -> None:
        """Parked for `TRANSPORT_IDLE_S`: let the transport go (it reconnects on the next export)."""
        since = self._parked_since
        if not self._transport_held or since is None or time.monotonic() - since < TRANSPORT_IDLE_S:
            return
        release = getattr(self._transport, "release", None)
        if release is not None:
            try:
                release()
            except Exception as exc:
                self._note_failure(f"releasing the idle transport failed: {type(exc).__name__}: {exc}")
        self._transport_held = False

    def _deadline(self) -> float:
        deadline = time.monotonic() + self.settings.timeout_s
        if self._shutdown_deadline is not None:
            deadline = min(deadline, self._shutdown_deadline)
        return deadline

    def _drain(self, final: bool = False) -> None:
        """Send what is queued, in batches of at most `max_batch`; returns the records taken.

        Steps leave in order; one whose memory may still come waits (see the module
        docstring) unless `final` (shutdown or a flush), which sends everything.
        """
        batch = self.settings.max_batch
        sent = 0
        while True:
            if self._shutdown_deadline is not None and time.monotonic() >= self._shutdown_deadline:
                self._abandon_queued()
                return sent
            self._collect_memory()
            ready = self._ready_steps(batch, final)
            if not ready:
                break
            self._send_steps(ready)
            sent += len(ready)
        self._forget_unmatched_memory(final)
        return sent + self._send_resources()

    def _collect_memory(self) -> None:
        """Queued snapshots -> `_memory_by_step`; unmeasured ones (non-CUDA) carry nothing."""
        memory, by_step = self._memory, self._memory_by_step
        while memory:
            record = memory.popleft()
            measured = record.peak_allocated_bytes is not None or record.peak_reserved_bytes is not None
            self._expect_memory = measured
            if not measured:
                continue
            high = self._memory_high
            if high is None or record.step > high:
                self._memory_high = record.step
            if self._last_step is not None and record.step <= self._last_step:
                self._dropped[QUEUE_METRICS] += 1  # its step span has left already
                continue
            if len(by_step) >= self._capacity:
                by_step.pop(next(iter(by_step)))
                self._dropped[QUEUE_METRICS] += 1
            by_step[record.step] = record

    def _ready_steps(self, limit: int, final: bool) -> list[tuple[ResolvedStepTime, StepMemorySnapshot | None]]:
        steps, by_step, high = self._steps, self._memory_by_step, self._memory_high
        ready = []
        while steps and len(ready) < limit:
            head = steps[0]
            memory = by_step.pop(head.step, None)
            # A snapshot for this step or a later one has arrived and is not here (they arrive in
            # order; its own was dropped): none will come for this step.
            if memory is None and self._expect_memory and not final and (high is None or head.step > high):
                now = time.monotonic()
                if self._head_since is None:
                    self._head_since = now
                if now - self._head_since < MEMORY_JOIN_WAIT_S:
                    break
            self._head_since = None
            ready.append((steps.popleft(), memory))
        return ready

    def _forget_unmatched_memory(self, final: bool) -> None:
        """Snapshots no step span can carry any more (their step has left, or shutdown)."""
        by_step, last = self._memory_by_step, self._last_step
        stale = list(by_step) if final and self._closing else \
            ([s for s in by_step if s <= last] if last is not None else [])
        for step in stale:
            del by_step[step]
        self._dropped[QUEUE_METRICS] += len(stale)

    def _abandon_queued(self) -> None:
        """Shutdown ran out of time: what is still queued is counted as failed, not encoded."""
        self._failures[v.SIGNAL_TRACES] += len(self._steps)
        self._note_failure(f"shutdown deadline reached with {len(self._steps)} steps unsent")
        self._steps.clear()
        self._memory.clear()
        self._memory_by_step.clear()
        if self._resources:
            self._failures[v.SIGNAL_METRICS] += len(self._resources)
            self._resources.clear()

    def _send_steps(self, records: list[tuple[ResolvedStepTime, StepMemorySnapshot | None]]) -> None:
        spans: list[bytes] = []  # serialised spans: the request is written as bytes (encoding.py)
        steps = memory = 0
        for record, snapshot in records:
            before = len(spans)
            try:
                self._encoder.encode_step_spans(spans, record, snapshot)
                steps += 1
                memory += snapshot is not None
                self._last_step = record.step if self._last_step is None else max(self._last_step, record.step)
            except Exception as exc:
                del spans[before:]
                self._failures[v.SIGNAL_TRACES] += 1
                self._note_failure(f"step record not encodable ({type(exc).__name__}: {exc}): {record!r:.200}")
        if not steps:
            return
        n_spans = len(spans)
        # Failures are counted in steps (one `traceml.step` span each); phase children ride along.
        request = EncodedRequest(self._encoder.trace_request_bytes(spans))
        outcome = self._export(v.SIGNAL_TRACES, request, steps, rejected_unit=n_spans // steps)
        if outcome.delivered:
            self._steps_exported += steps - min(steps, outcome.rejected)
            self._spans_exported += n_spans - outcome.rejected
            if not outcome.rejected:
                self._memory_exported += memory

    def _send_resources(self) -> None:
        """The queued resource snapshots, up to `max_batch` of them per metrics request.

        Failures are counted in points, as for the telemetry counters; a snapshot that
        cannot be encoded counts as one (it adds no point: `add_resource_points`).
        """
        queue = self._resources
        taken = len(queue)
        while queue:
            batch = self._encoder.new_metrics_batch()
            points = snapshots = 0
            while queue and snapshots < self.settings.max_batch:
                snapshot = queue.popleft()
                try:
                    points += self._encoder.add_resource_points(batch, snapshot, self._start_ns)
                    snapshots += 1
                except Exception as exc:
                    self._failures[v.SIGNAL_METRICS] += 1
                    self._note_failure(f"resource snapshot not encodable ({type(exc).__name__}: {exc}): "
                                       f"{snapshot!r:.200}")
            if not points:
                continue
            outcome = self._export(v.SIGNAL_METRICS, batch.request, points)
            if outcome.delivered and not outcome.rejected:
                self._resources_exported += snapshots
        return taken

    def _all_drops(self) -> dict[str, int]:
        drops = {q: 0 for q in v.QUEUE_NAMES}
        instrumentation = self._final_instrumentation_drops
        if instrumentation is None:
            try:
                instrumentation = self._instrumentation_drops()
            except Exception:
                instrumentation = {}
        for queue, count in instrumentation.items():
            if queue in drops:
                drops[queue] += int(count)
        for queue, count in self._dropped.items():
            drops[queue] += count
        return drops

    def _counters_snapshot(self, drops: Mapping[str, int] | None = None) -> tuple:
        drops = self._all_drops() if drops is None else drops
        return tuple(drops.items()), tuple(self._failures.items()), tuple(self._retries.items())

    def _send_counters(self, force: bool) -> None:
        drops = self._all_drops()
        snapshot = self._counters_snapshot(drops)
        if not force and snapshot == self._last_counters:
            return
        now = time.time_ns()
        enc = self._encoder
        batch = enc.new_metrics_batch()
        points = enc.add_counter_points(batch, v.METRIC_TELEMETRY_DROPPED, v.ATTR_QUEUE, drops, self._start_ns, now)
        points += enc.add_counter_points(batch, v.METRIC_EXPORT_FAILURES, v.ATTR_SIGNAL, dict(self._failures),
                                         self._start_ns, now)
        points += enc.add_counter_points(batch, v.METRIC_EXPORT_RETRIES, v.ATTR_SIGNAL, dict(self._retries),
                                         self._start_ns, now)
        outcome = self._export(v.SIGNAL_METRICS, batch.request, points)
        if outcome.delivered:
            self._last_counters = snapshot

    def _send_run_end(self) -> None:
        span = self._encoder.run_end_span(
            self._start_ns, time.time_ns(),
            self._steps_received if self._final_steps is None else self._final_steps,
            self._last_step, self._all_drops(),
            sum(self._failures.values()), sum(self._retries.values()), noted_ending())
        if self._final_step_boundary is not None:
            span.attributes.add(key=v.ATTR_STEP_BOUNDARY).value.string_value = self._final_step_boundary
        outcome = self._export(v.SIGNAL_TRACES, self._encoder.trace_request([span]), 1)
        self._run_end_sent = outcome.delivered

    def _export(self, signal: str, request, items: int, rejected_unit: int = 1) -> ExportOutcome:
        self._transport_held = True  # the transport connects again if it was released
        try:
            outcome = self._transport.export(signal, request, self._deadline())
        except Exception as exc:
            outcome = ExportOutcome(False, 0, error=f"{type(exc).__name__}: {exc}")
        self._retries[signal] += outcome.retries
        if not outcome.delivered:
            self._failures[signal] += items
            self._note_failure(f"OTLP {signal} export to {self.settings.endpoint} failed: {outcome.error}")
        elif outcome.rejected:
            self._failures[signal] += min(items, -(-outcome.rejected // max(1, rejected_unit)))
            self._note_failure(f"OTLP receiver rejected {outcome.rejected} of {items} {signal} items")
        return outcome

    def _note_failure(self, message: str) -> None:
        """First failure at WARNING, then every 100th: a dead endpoint must not flood the log."""
        if self._failure_logs % 100 == 0:
            _log.warning("traceml: %s (failures so far: %d)", message, self._failure_logs + 1)
        else:
            _log.debug("traceml: %s", message)
        self._failure_logs += 1
