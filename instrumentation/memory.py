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


def _device_label(device) -> tuple[str, bool, int | None]:
    """(label, is_cuda, cuda index) without importing torch for CPU devices."""
    if device is None:
        return "cpu", False, None
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

    def reset(self) -> None:
        """Start a new peak window (CUDA only)."""
        if self._cuda:
            self._torch.cuda.reset_peak_memory_stats(self._index)

    def read(self, step: int | None = None) -> _se.MemoryReading:
        """Read the peaks since `reset()` and record them in the active capture.

        `step` is accepted for symmetry with the design notes but unused: the step
        number is assigned when the capture completes.
        """
        if self._cuda:
            cuda = self._torch.cuda
            reading = _se.MemoryReading(self.device, int(cuda.max_memory_allocated(self._index)),
                                        int(cuda.max_memory_reserved(self._index)), time.time_ns())
        else:
            reading = _se.MemoryReading(self.device, None, None, time.time_ns())
        if _se._recording:
            capture = _se._active
            if capture is None:
                capture = _se.current_capture()
            capture.memory = reading  # StepCapture.record(), inlined
        return reading
