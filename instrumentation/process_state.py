"""The process-wide state the training thread reads on every step and region, in slotted holders.

Each holder has one writer and is read on the hot path:

- `session`: whether TraceML is disabled or initialised, its mode, the default
  device, the open `trace_step` and whether steps are inferred. Written by
  `lifecycle` (init, shutdown, fork), by `trace_step` itself (`open_step`) and by
  `step_boundary` (`inferring`); read by `trace_step` and the manual wrappers.
- `recording`: whether recording is on, which thread records, the active
  capture, and `fast`, the one flag the common path of every region, hook and
  patch reads (recording on, the CPU clock, no name held). Written only by
  `step_events`' helpers (`timing`'s policy helpers ask it to recompute `fast`);
  read by every timed region, hook and patch.
- `timing_policy`: which clock a region without an explicit device uses, the
  CUDA event pool, and whether DataLoader waits are timed. Written only by
  `timing`'s helpers (`prepare_gpu_timing`, `configure_gpu_timing`,
  `dataloader_timing_scope`); read by timed regions, hooks and `trace_step`.

Each is one instance that is never replaced (its fields change in place), so a
hot-path module binds it once at import and reads a slot, which is as cheap as
reading a module attribute and says whose state it is. The kill switch is read
(through `settings`) when this module loads, so that a `trace_step` used before
any `init()` already knows whether TraceML is disabled; `init()` reads it again.
"""
from __future__ import annotations

from .settings import kill_switch


class SessionState:
    """What `init()`/`shutdown()` decided, as `trace_step` reads it on every step."""

    __slots__ = ("disabled", "initialized", "mode", "default_device", "open_step", "inferring")

    def __init__(self) -> None:
        self.disabled = kill_switch()
        self.initialized = False
        self.mode: str | None = None  # `auto` or `manual` while initialised
        self.default_device = None  # torch.device("cuda") when CUDA is available, else None
        self.open_step = None  # the trace_step currently open (never nested)
        # True while steps are inferred from optimizer updates (auto mode, no explicit
        # boundary yet): the first trace_step then claims the boundaries (step_boundary).
        self.inferring = False


class RecordingState:
    """Whether the training thread records now, which thread that is, and into which capture."""

    __slots__ = ("recording", "owner", "active", "fast", "loader_fast")

    def __init__(self) -> None:
        self.recording = False
        self.owner: int | None = None  # threading.get_ident() of the training thread
        self.active = None  # the StepCapture events go to (None: created lazily)
        # recording and a region without an explicit device is timed on the CPU clock
        # (`timing_policy`: no CUDA events, none undecided) and no name is held
        # (`step_events.held`): the one condition the common path of every region,
        # hook and patch checks, so that it reads this object only (inside a real step
        # each further object it touches costs it a cache miss; see
        # docs/design/performance-history.md). Recomputed by
        # `step_events.refresh_fast_path()` whenever one of the three changes.
        self.fast = False
        self.loader_fast = False  # fast, and DataLoader waits are timed (`timing_policy`)


class TimingPolicy:
    """How a region that names no device is timed, as every region and hook reads it."""

    __slots__ = ("gpu_default", "gpu_undecided", "pool", "dataloader_timing")

    def __init__(self) -> None:
        self.gpu_default = False  # CUDA event pairs for regions without an explicit device
        # True between init() on a CUDA-capable machine and the first trace_step: regions
        # use CUDA events only once the process initialised CUDA itself (it moved a model
        # or a tensor there), so a CPU-only job on a GPU machine never gets a CUDA
        # context from us.
        self.gpu_undecided = False
        self.pool = None  # the timing.CudaEventPool regions take their events from
        self.dataloader_timing = True  # whether DataLoader next() is timed as input wait


session = SessionState()
recording = RecordingState()
timing_policy = TimingPolicy()
