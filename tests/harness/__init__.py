"""Shared plumbing for the tests and the benchmarks: ports, waiting, processes.

Imported as `tests.harness` (pytest's `pythonpath` holds the repository root; a
benchmark runs as `python -m benchmarks.<name>` from the root). One module per
piece, named for it; the three everyone needs are re-exported here:

- `ports.free_port`: a free loopback port;
- `waiting.wait_until`: bounded polling;
- `processor_process.ProcessorProcess`: `traceml-processor` as a real subprocess;
- `processor_service`: the processor service in this process (most processor tests);
- `child_python`: child processes that import `tests.*` helpers (`-m`, PYTHONPATH);
- `prometheus_server`: a real Prometheus on loopback;
- `otlp_receiver`: a real OTLP receiver (gRPC and HTTP) that can be told to misbehave.
"""
from tests.harness.ports import free_port
from tests.harness.processor_process import ProcessorProcess
from tests.harness.waiting import wait_until

__all__ = ["ProcessorProcess", "free_port", "wait_until"]
