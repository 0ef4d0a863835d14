"""DDP's gradient all-reduce wait, measured through a communication hook that wraps DDP's own.

DDP launches one all-reduce per gradient bucket from inside backward (on the
autograd engine's threads; on a CPU-only job that is the training thread) and, at
the end of backward, the Reducer waits for all of them. What the training thread
waits for is therefore the tail: from the moment this rank launched its *last*
bucket (its last local gradient was ready) until the last all-reduce completed.
That interval is this rank's collective wait for the step:

    wait = max(bucket completion) - max(bucket launch)

Why this one: a straggler launches its last bucket last, when every other rank is
already waiting inside that all-reduce, so its all-reduce completes almost at once
and its wait is small; every other rank launched earlier and waits until the
straggler arrives, so theirs is large. The rank with the least wait is the one the
others waited for, and `traceml.collective.last_entry` (the last launch, seconds
from the step's first timed event) is latest on it. Earlier buckets overlap with
backward compute and are not waiting. The interval lies inside backward: backward's
wall time still includes it (the processor subtracts it or reports it apart; see
docs/wire-format.md).

The seam (automatic mode; `install` patches `DistributedDataParallel`):
- `_lazy_init`, which DDP runs once on the training thread before a module's first
  forward: unless a hook is already registered, `TimedCommHook(allreduce_hook)` is
  registered, torch's Python allreduce hook that DDP documents as computing the same
  result as no hook at all. The wrapper calls it and returns
  `future.then(...)` whose callback stamps the completion and returns the same
  value: DDP's wait on the returned future returns only after the stamp was taken
  (a done-callback has no such ordering: waiters may wake before it runs), so the
  training thread always finds complete records.
- `register_comm_hook`: a user's hook registered after `init()` is wrapped the same
  way (it runs unchanged, with its own state, and is timed); one registered after
  ours (after the first forward, which DDP allows once) replaces the hook inside
  our wrapper. `_register_builtin_comm_hook` after ours becomes its documented
  Python equivalent inside the wrapper; before the first forward it is left alone and
  the module is not timed (said once: `ddp_comm_hook_not_timed`), as is a module
  whose hook was registered before `init()`.
- Flush: at the end of `Tensor.backward` the backward patch moves the pending bucket
  records into one `RAW_COLLECTIVE_WAIT` event of the training thread's capture.

Clock: CPU stamps always; on a CUDA run (the process timing policy) also a CUDA
event recorded at launch on the current stream and one recorded in the completion
callback, where the current stream already waits for the all-reduce, so their
distance is the GPU-side wait; nothing is synchronised. On NCCL the CPU completion
comes when the work is enqueued, so only the GPU time is meaningful there.
"""
from __future__ import annotations

import time
from collections import deque
from functools import partial

from traceml.schema.vocabulary import RAW_COLLECTIVE_WAIT

from . import step_events as _se
from .process_state import recording as _rec
from .process_state import timing_policy as _policy

_perf_ns = time.perf_counter_ns

pending: deque = deque()
"""Bucket records [launch_ns, done_ns, gpu_launch, gpu_done] not yet flushed (any thread appends)."""

_ATTR = "_traceml_comm_hook"
_BUILTIN_ATTR = "_traceml_builtin_comm_hook"


def _done(entry: list, future):
    """The completion stamp, taken before the future DDP waits on completes; passes the value through."""
    entry[1] = _perf_ns()
    if entry[2] is not None:
        try:
            g1 = _policy.pool.acquire()
            g1.record()
            entry[3] = g1
        except Exception:
            entry[2] = None
    return future.value()


class TimedCommHook:
    """A DDP communication hook that calls `hook(state, bucket)` unchanged and times its bucket."""

    def __init__(self, hook, state, default: bool = False) -> None:
        self.hook = hook
        self.state = state
        self.default = default  # our own default allreduce (a later user hook may replace it)
        self.__name__ = getattr(hook, "__name__", "comm_hook")
        self.__qualname__ = getattr(hook, "__qualname__", self.__name__)

    def __call__(self, state, bucket):
        if not _rec.recording:
            return self.hook(self.state, bucket)
        entry = [_perf_ns(), 0, None, None]
        if _policy.gpu_default and _policy.pool is not None:
            try:
                g0 = _policy.pool.acquire()
                g0.record()
                entry[2] = g0
            except Exception:
                pass
        future = self.hook(self.state, bucket)
        then = getattr(future, "then", None)
        if then is None:  # not a Future (DDP's Python reducer ignores the result): nothing to time
            return future
        pending.append(entry)
        return then(partial(_done, entry))


def flush() -> None:
    """Turn the pending bucket records into this backward's collective-wait event (training thread).

    One loop, no comprehension or key function: each would be another Python frame on
    the training thread at every backward.
    """
    pool = _policy.pool
    last = None
    end = 0
    pop = pending.popleft
    while pending:
        entry = pop()
        if entry[1]:
            if entry[1] > end:
                end = entry[1]
            if last is None or entry[0] > last[0]:
                entry, last = last, entry
        if entry is not None and entry[2] is not None and pool is not None:
            pool.release(entry[2])  # an earlier bucket's events (only the last launch's are kept)
            if entry[3] is not None:
                pool.release(entry[3])
    if last is None:
        return
    g0, g1 = last[2], last[3]
    if g0 is None or g1 is None:
        g0 = g1 = None
    event = (RAW_COLLECTIVE_WAIT, last[0], end if end > last[0] else last[0], g0, g1)
    capture = _rec.active
    if capture is not None and len(capture.events) < _se.MAX_EVENTS_PER_CAPTURE:
        capture.events.append(event)  # record_timing_event's common case, inline
    elif not _se.record_timing_event(event) and g0 is not None and pool is not None:
        pool.release(g0)
        pool.release(g1)


def _not_timed(why: str) -> None:
    _se.warn_once("ddp_comm_hook_not_timed", f"{why}; DDP's gradient all-reduce wait is not "
                  "measured for that module (explicit collectives still are)")


def _builtin_equivalent(comm_hook_type):
    """The Python hook torch documents as computing what a builtin comm hook computes."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
        return default_hooks.allreduce_hook
    if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
        return default_hooks.fp16_compress_hook
    return None


def attach(module) -> bool:
    """Register the timed default hook on a DDP module that has none (its `_lazy_init`)."""
    if module.__dict__.get(_ATTR) is not None:
        return True
    if module.__dict__.get(_BUILTIN_ATTR) or getattr(module, "_comm_hooks", None):
        _not_timed("a DDP module got its communication hook before traceml.init() "
                   "(or a builtin one)")
        return False
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = TimedCommHook(default_hooks.allreduce_hook, module.process_group, default=True)
    dist._register_comm_hook(module.reducer, module.process_group, hook)
    module.__dict__[_ATTR] = hook
    return True


def install(patch) -> bool:
    """Patch DDP's `_lazy_init`, `register_comm_hook` and `_register_builtin_comm_hook`."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return False
        from torch.nn.parallel import DistributedDataParallel as DDP
    except Exception:
        return False
    lazy_init = DDP.__dict__.get("_lazy_init")
    register = DDP.__dict__.get("register_comm_hook")
    register_builtin = DDP.__dict__.get("_register_builtin_comm_hook")
    if lazy_init is None or register is None or not hasattr(dist, "_register_comm_hook"):
        return False

    def _lazy_init(self, *args, **kwargs):
        result = lazy_init(self, *args, **kwargs)
        try:
            attach(self)
        except Exception as exc:  # telemetry never breaks training
            _not_timed(f"registering TraceML's DDP communication hook failed ({exc!r})")
        return result

    def register_comm_hook(self, state, hook):
        ours = self.__dict__.get(_ATTR)
        if ours is not None and ours.default:
            # After our lazy default: DDP would accept this one hook; it runs inside ours.
            self._check_comm_hook(hook)
            ours.hook, ours.state, ours.default = hook, state, False
            ours.__name__ = getattr(hook, "__name__", "comm_hook")
            ours.__qualname__ = getattr(hook, "__qualname__", ours.__name__)
            if self.logger is not None:
                self.logger._set_comm_hook_name(ours.__qualname__)
            self._comm_hooks.append((hook, state))
            return None
        if ours is not None or self.__dict__.get(_BUILTIN_ATTR):
            return register(self, state, hook)  # a second hook: DDP's own error
        self._check_comm_hook(hook)
        timed = TimedCommHook(hook, state)
        result = register(self, state, timed)
        self.__dict__[_ATTR] = timed
        return result

    patch(DDP, "_lazy_init", _lazy_init)
    patch(DDP, "register_comm_hook", register_comm_hook)
    if register_builtin is not None:
        def _register_builtin_comm_hook(self, comm_hook_type):
            ours = self.__dict__.get(_ATTR)
            equivalent = _builtin_equivalent(comm_hook_type) if ours is not None and ours.default else None
            if equivalent is not None:
                ours.hook, ours.state, ours.default = equivalent, self.process_group, False
                if self.logger is not None:
                    self.logger._set_comm_hook_name(str(comm_hook_type))
                return None
            if ours is None:
                self.__dict__[_BUILTIN_ATTR] = True
            return register_builtin(self, comm_hook_type)

        patch(DDP, "_register_builtin_comm_hook", _register_builtin_comm_hook)
    return True
