"""A TelemetrySink that keeps what it receives, for tests and the CUDA check.

The samplers publish to registered sinks; a test or a check asserts on the records
they delivered. One class for every suite (instrumentation, integrations, the GPU
check) so a change to the sink protocol is made in one place. Stdlib only: the GPU
check imports it without pytest.
"""
from __future__ import annotations


class RecordingSink:
    """Keeps every step-time, step-memory and resource record it is handed, in arrival order."""

    def __init__(self) -> None:
        self.steps = []
        self.memory = []
        self.resources = []

    def on_step_time(self, record) -> None:
        self.steps.append(record)

    def on_step_memory(self, record) -> None:
        self.memory.append(record)

    def on_resources(self, snapshot) -> None:
        self.resources.append(snapshot)
