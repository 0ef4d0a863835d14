"""The `traceml` console script's exit after a command that imported torch: no interpreter
teardown, but everything a normal exit owes (atexit handlers, flushed output, the status, and
waiting for a non-daemon thread). A stand-in `torch` module takes the path without paying for
torch's import; the real one is taken by every `traceml run` in the suite."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def _console(argv: list[str], before: str = "") -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import atexit, sys, types
        sys.modules["torch"] = types.ModuleType("torch")  # as after `traceml run`'s import of torch
        atexit.register(lambda: print("atexit ran", flush=False))
        class Torn:  # its finaliser runs in the interpreter's teardown, and only there
            def __del__(self):
                print("torn down", flush=True)
        kept = Torn()
        {before}
        sys.argv = ["traceml", *{argv!r}]
        from traceml.launcher.cli import console_main
        console_main()
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_atexit_handlers_run_buffered_output_is_flushed_and_the_status_is_kept():
    done = _console(["--version"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("traceml ") and done.stdout.rstrip().endswith("atexit ran")
    assert "torn down" not in done.stdout  # the teardown was skipped
    refused = _console(["no-such-command"])
    assert refused.returncode == 2 and "unknown command" in refused.stderr
    assert refused.stdout.rstrip().endswith("atexit ran")


def test_a_non_daemon_thread_still_running_is_waited_for():
    late = """
import threading, time
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", flush=True))).start()
"""
    done = _console(["--version"], before=late.strip().replace("\n", "; "))
    assert done.returncode == 0, done.stderr
    assert "thread finished" in done.stdout and "atexit ran" in done.stdout
    assert "torn down" in done.stdout  # the normal exit, teardown included
