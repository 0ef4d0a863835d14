"""Sampler threads are daemons, and what was published is flushed at interpreter exit."""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import sys, threading
    sys.modules["torch"] = None  # the manual CPU path needs no torch at all
    import traceml

    out = open(sys.argv[1], "w")

    class FileSink:
        def on_step_time(self, record):
            out.write(f"time {record.step}\\n"); out.flush()
        def on_step_memory(self, record):
            out.write(f"memory {record.step} {record.peak_allocated_bytes}\\n"); out.flush()

    traceml.register_sink(FileSink())
    traceml.init(mode="manual")
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("traceml-"))
    for _ in range(3):
        with traceml.trace_step():
            with traceml.timed_forward():
                pass
    # no traceml.shutdown(): the atexit hook must drain both samplers
''')


def test_published_steps_are_flushed_at_interpreter_exit(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    result = tmp_path / "records.txt"
    proc = subprocess.run([sys.executable, str(script), str(result)], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    lines = result.read_text().splitlines()
    assert sorted(line for line in lines if line.startswith("time")) == ["time 0", "time 1", "time 2"]
    assert sorted(line for line in lines if line.startswith("memory")) == [
        "memory 0 None", "memory 1 None", "memory 2 None"]
