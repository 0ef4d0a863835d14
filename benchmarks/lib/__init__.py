"""The benchmarks' library: everything more than one benchmark or check uses, by public names.

A benchmark (`benchmarks/bench_*.py`) or a check (`checks/*.py`) imports shared code from
here and from nowhere else among the benchmarks: never another benchmark's module, never
a private (`_name`) of this library, never a test module (tests may import this library,
not the other way round). The plumbing they share with the tests (the processor as a
subprocess, OTLP payloads, stored rows) is `harness/`, beside the tests.
tests/benchmarks/test_benchmark_library.py holds the rule.
Importing this package loads nothing; each module is small and named for what it holds:

- `checkout`: makes `import traceml` work from a plain copy of the tree (import it first);
- `json_output`: `--json`, one object of figures on stdout, the same shape everywhere;
- `estimators`: seeded shuffled rounds of interleaved variants and the estimators read
  from them (paired medians, the pooled ratio with its interval), the steady allocator;
- `attribution`: what background work costs the steps it lands in;
- `workload`: bench_overhead's CPU training job (model, optimizer, loader) and its plain
  step loop, built without TraceML (bench_peers' workers run it under other tools);
- `traced_steps`: the same loop under each TraceML mode, the empty traced step, the
  synchronous sampler drain;
- `peers`: the peer tools' virtual environment and one `traceml run` under either tool.
"""
