"""Shared plumbing for the tests, the benchmarks and the checks: ports, waiting, processes, payloads.

Imported as `harness` (pytest's `pythonpath` holds the repository root; a benchmark
or a check runs as `python -m benchmarks.<name>` / `checks.<name>` from the root). It
sits beside `tests/` rather than in it so that benchmarks and checks use it without
importing a test module (tests/benchmarks/test_benchmark_library.py holds that); it
imports nothing of `tests`. One module per piece, named for it; the three everyone
needs are re-exported here:

- `ports.free_port`: a free loopback port;
- `waiting.wait_until`: bounded polling;
- `processor_process.ProcessorProcess`: `traceml-processor` as a real subprocess;
- `processor_service`: the processor service in this process (most processor tests);
- `child_python`: child processes that import `tests.*` helpers (`-m`, PYTHONPATH);
- `prometheus_server`: a real Prometheus on loopback;
- `otlp_receiver`: a real OTLP receiver (gRPC and HTTP) that can be told to misbehave;
- `stored_rows`: what a processor's store holds, read back for assertions;
- `sinks.RecordingSink`: a sink that keeps every record the samplers deliver;
- `otlp_payloads`, `exporter_records`: OTLP requests and TraceML records, built by hand;
- `tiny_training`: the small training step, plain or traced;
- `sort_straggler_job`: the deep-capture job (`traceml run -m`), with `capture_watch` (rank 0 watches
  the run's captures; every rank stops at the same update);
- `reliability`: the reliability scenarios tests/reliability runs and checks/ runs longer.
"""
from harness.ports import free_port
from harness.processor_process import ProcessorProcess
from harness.waiting import wait_until

__all__ = ["ProcessorProcess", "free_port", "wait_until"]
