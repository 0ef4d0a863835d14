"""Per-step peak memory of the tracked device (contract, "Timing and memory").

`reset()` at the start of a step (or accumulation group) resets the CUDA allocator's
peak counters; `read()` at its end reads peak allocated/reserved bytes and records
them in the active capture, which publishes them with the step number it assigns.
On a non-CUDA device both values are None: memory is unavailable, not zero.
Neither call synchronises the device.
"""
from __future__ import annotations

import time

from . import step_events as _se
from .process_state import recording as _rec

_new = object.__new__


def _device_label(device) -> tuple[str, bool, int | None]:
    """(label, is_cuda, cuda index) without importing torch for CPU devices."""
    if device is None:
        return "cpu", False, None
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"  # a bare ordinal names a CUDA device, as in torch
    kind = getattr(device, "type", None)
    index = getattr(device, "index", None)
    if kind is None:
        text = str(device)
        kind, _, rest = text.partition(":")
        index = int(rest) if rest.isdigit() else None
    if kind != "cuda":
        return kind, False, None
    if index is None:
        import torch

        index = torch.cuda.current_device()
    return f"cuda:{index}", True, index


class StepMemoryTracker:
    """Resets and reads the PyTorch allocator peaks of one device for one step."""

    __slots__ = ("device", "_cuda", "_index", "_torch")

    def __init__(self, device=None) -> None:
        self.device, cuda, self._index = _device_label(device)
        self._torch = None
        if cuda:
            import torch

            cuda = torch.cuda.is_available()
            self._torch = torch
        self._cuda = cuda

    @property
    def is_cuda(self) -> bool:
        return self._cuda

    @property
    def cuda_index(self) -> int | None:
        return self._index if self._cuda else None

    def reset(self) -> None:
        """Start a new peak window (CUDA only)."""
        if self._cuda:
            try:
                try:
                    self._torch._C._cuda_resetPeakMemoryStats(self._index)
                except AttributeError:
                    self._torch.cuda.reset_peak_memory_stats(self._index)
            except Exception as exc:  # telemetry never breaks the training step
                _se.warn_once("memory_failed", f"resetting CUDA peak memory failed ({exc!r})")

    def _cuda_peaks(self) -> tuple[int, int]:
        """(peak allocated, peak reserved) from one allocator-stats call.

        `torch.cuda.max_memory_allocated()` flattens every allocator statistic into
        a sorted dictionary in Python, twice per step for both values; reading the
        nested statistics once is the same numbers for a fraction of the cost.
        """
        torch = self._torch
        try:
            stats = torch._C._cuda_memoryStats(self._index)
            return int(stats["allocated_bytes"]["all"]["peak"]), int(stats["reserved_bytes"]["all"]["peak"])
        except (AttributeError, KeyError, TypeError):
            cuda = torch.cuda
            return int(cuda.max_memory_allocated(self._index)), int(cuda.max_memory_reserved(self._index))

    def read(self, step: int | None = None) -> _se.MemoryReading:
        """Read the peaks since `reset()` and record them in the active capture.

        `step` is accepted for symmetry with the design notes but unused: the step
        number is assigned when the capture completes.
        """
        if self._cuda:
            try:
                allocated, reserved = self._cuda_peaks()
            except Exception as exc:  # unavailable this step, never a crash
                _se.warn_once("memory_failed", f"reading CUDA peak memory failed ({exc!r})")
                allocated = reserved = None
        else:
            allocated = reserved = None  # memory is unavailable off CUDA, not zero
        # MemoryReading(...) without its __init__ frame (once per step, training thread).
        reading = _new(_se.MemoryReading)
        reading.device = self.device
        reading.peak_allocated_bytes = allocated
        reading.peak_reserved_bytes = reserved
        reading.time_ns = time.time_ns()
        if _rec.recording:
            capture = _rec.active
            if capture is None:
                capture = _se.current_capture()
            capture.memory = reading  # StepCapture.record(), inlined
        return reading
