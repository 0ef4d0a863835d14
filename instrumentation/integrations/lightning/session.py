"""One fit of one trainer: the open accumulation group and the regions timed in it.

The session holds the group state (open regions, forward nesting, the memory
window) and turns Lightning's events into regions: the callback's hooks call the
public methods below, the wrappers around Lightning's own calls (`seams.py`) call
the bookkeeping ones. It lives on the training thread only and is created at
`on_train_start`, after checkpoint restore and any EMA copy of the module.
"""
from __future__ import annotations

import threading

from traceml.schema.vocabulary import (
    RAW_BACKWARD,
    RAW_DATALOADER_NEXT,
    RAW_FORWARD,
    RAW_H2D,
    RAW_OPTIMIZER_STEP,
    RAW_STEP_TIME,
)
from traceml.step_events import RegionHold

from . import seams
from .accumulation import accumulation_rule
from .reporting import warn_once


def _graph_task_probe():
    """A function returning True inside the autograd engine (where activation
    checkpointing recomputes forward), or None when this torch has no such probe."""
    import torch

    task_id = getattr(torch._C, "_current_graph_task_id", None)
    if task_id is None:
        warn_once("no_graph_task_id", "torch has no _current_graph_task_id; forward calls "
                  "during backward are excluded only inside Lightning's backward hooks")
        return None
    return lambda: task_id() != -1


class TrainSession:
    """Group state and timed regions for one `fit` of one trainer (training thread only)."""

    def __init__(self, trainer, pl_module) -> None:
        from traceml.memory import StepMemoryTracker

        self.trainer = trainer
        self.module = pl_module
        self.thread = threading.get_ident()
        self.manual = not getattr(pl_module, "automatic_optimization", True)
        self.memory = StepMemoryTracker(getattr(trainer.strategy, "root_device", None))
        self.installed = False
        self.failed = False
        self.regions: list = []  # open timed regions, innermost last
        self.batch_region = None
        self.backward_region = None
        self.optimizer_region = None
        self.fetch_region = None
        self.forward_region = None
        self.optimizer_hold: RegionHold | None = None
        self.forward_depth = 0
        self.forward_stack: list[bool] = []
        self.armed = 0
        self.in_backward = False
        self.group_open = False
        self.handles: list = []  # forward hook handles
        self.patches: list = []  # patching.Patch records, undone in reverse
        self.should_accumulate = accumulation_rule(trainer)
        self.in_autograd = _graph_task_probe() or (lambda: False)

    # -- installation ----------------------------------------------------------------------

    def install(self) -> None:
        seams.install(self)
        self.installed = True

    def uninstall(self) -> None:
        self.installed = False
        seams.uninstall(self)

    def on_training_thread(self) -> bool:
        return self.installed and threading.get_ident() == self.thread

    def disarm(self) -> None:
        """A wrapper's bookkeeping failed: every wrapper passes straight through from now
        on, and the callback drops this session at its next hook."""
        self.installed = False
        self.failed = True

    # -- regions -------------------------------------------------------------------------

    def _open(self, raw_event: str, device=None):
        from traceml.timing import timed_region

        region = timed_region(raw_event, device=device)
        region.start()
        self.regions.append(region)
        return region

    def close(self, region) -> None:
        if region is None:
            return
        try:
            self.regions.remove(region)
        except ValueError:
            return
        region.stop()

    def _release_optimizer_hold(self) -> None:
        hold, self.optimizer_hold = self.optimizer_hold, None
        if hold is not None:
            hold.release()

    def _close_all(self) -> None:
        self._release_optimizer_hold()
        while self.regions:
            self.regions.pop().stop()
        self.batch_region = self.backward_region = self.optimizer_region = None
        self.fetch_region = self.forward_region = None
        self.forward_depth = 0
        self.forward_stack.clear()
        self.in_backward = False

    # -- what the wrappers around Lightning's calls do ------------------------------------------

    def transfer_start(self):
        # The micro-batch's traced region starts here, so it covers its transfer.
        self.open_batch_region()
        return self._open(RAW_H2D)

    def optimizer_call_start(self) -> None:
        # The closure (training_step and backward) runs inside optimizer.step():
        # keep global optimizer hooks inert until on_before_optimizer_step.
        if self.optimizer_hold is None:
            self.optimizer_hold = RegionHold((RAW_OPTIMIZER_STEP,))

    def optimizer_call_end(self) -> None:
        self._release_optimizer_hold()
        if self.optimizer_region is not None:
            self.close(self.optimizer_region)
            self.optimizer_region = None

    def fetch_start(self) -> None:
        # device policy as for every phase: on CUDA the event pair gives the GPU-clock
        # input wait (how long the stream sat idle waiting for the batch)
        self.fetch_region = self._open(RAW_DATALOADER_NEXT)

    def fetch_end(self, exhausted: bool) -> None:
        region, self.fetch_region = self.fetch_region, None
        if not exhausted:
            self.close(region)
        elif region in self.regions:
            # the epoch-ending next() delivered no batch: not input wait
            self.regions.remove(region)
            region.discard()

    def close_forward(self) -> None:
        """A forward that raised left its region open."""
        self.close(self.forward_region)
        self.forward_region = None
        self.forward_depth = 0
        self.forward_stack.clear()

    def forward_enter(self) -> None:
        counted = self.armed > 0 and not self.in_backward and not self.in_autograd()
        self.forward_stack.append(counted)
        if counted:
            if self.forward_depth == 0:
                self.forward_region = self._open(RAW_FORWARD)
            self.forward_depth += 1

    def forward_exit(self) -> None:
        if self.forward_stack.pop() and self.forward_depth:
            self.forward_depth -= 1
            if self.forward_depth == 0:
                self.close(self.forward_region)
                self.forward_region = None

    # -- callback events ---------------------------------------------------------------------

    def open_batch_region(self) -> None:
        """Start a micro-batch's traced region (and the group's memory window if new)."""
        if not self.group_open:
            self.group_open = True
            self.memory.reset()
        if self.batch_region is not None:  # a batch skipped without its end hook
            self.close(self.batch_region)
        self.batch_region = self._open(RAW_STEP_TIME)

    def batch_start(self) -> None:
        if self.batch_region is None:  # no transfer seen (e.g. a dataloader_iter step)
            self.open_batch_region()

    def batch_end(self, batch_idx: int) -> None:
        self.close(self.batch_region)
        self.batch_region = None
        if self.manual or not self.should_accumulate(batch_idx):
            self._complete_group()

    def backward_start(self) -> None:
        self.in_backward = True
        if self.backward_region is None:
            self.backward_region = self._open(RAW_BACKWARD)

    def backward_end(self) -> None:
        self.close(self.backward_region)
        self.backward_region = None
        self.in_backward = False

    def optimizer_start(self) -> None:
        self._release_optimizer_hold()
        if self.optimizer_region is None:
            self.optimizer_region = self._open(RAW_OPTIMIZER_STEP)

    def epoch_end(self) -> None:
        # A group still open here never reached an update Lightning performs at a
        # group boundary (a skipped batch, a stop request, or a strategy that owns
        # accumulation and carries the remainder over): it is not published.
        if self.group_open or self.regions:
            self._discard()

    def _complete_group(self) -> None:
        from traceml.step_events import complete_step_capture

        self._close_all()
        self.memory.read()
        complete_step_capture()
        self.group_open = False

    def _discard(self) -> None:
        from traceml.step_events import abort_step_capture

        self._close_all()
        abort_step_capture()
        self.group_open = False

    def finish(self) -> None:
        """Normal end of training (or teardown): drop an unfinished group, remove hooks."""
        try:
            self._discard()
        finally:
            self.uninstall()

    def fail(self) -> None:
        """An exception: abort everything since the last completed group, remove hooks."""
        self.finish()
