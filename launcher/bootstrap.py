"""Per-rank entry point that `traceml run` hands to torch's elastic launcher.

    python -m traceml.launcher.bootstrap script.py [args]
    python -m traceml.launcher.bootstrap -m package.module [args]

It turns TraceML on without any change to the user's script: `traceml.init()`
in automatic mode, the Hugging Face / Lightning integrations when those
libraries are installed, then the script runs as `__main__` exactly as
`python script.py` would run it (same `sys.argv`, `sys.path[0]`), and
`traceml.shutdown()` flushes at the end, also after an exception, with how the
script ended (finished, interrupted, failed with its exit code) noted for the
rank's end marker (`traceml.exporter.process_ending`). The
script's exit status and exception propagate unchanged. TraceML's own
failures are reported on stderr and never stop training.
"""
from __future__ import annotations

import importlib.util
import os
import runpy
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Sequence

from traceml.schema.environment import TRACEML_EXIT_AFTER_FLUSH, env_flag

_PREFIX = "[traceml]"


def _warn(message: str) -> None:
    print(f"{_PREFIX} {message}", file=sys.stderr, flush=True)


def _enable_instrumentation() -> bool:
    try:
        import traceml

        traceml.init()
    except Exception as exc:  # telemetry must never stop training
        _warn(f"instrumentation disabled for this rank: {type(exc).__name__}: {exc}")
        return False
    _attach_integrations()
    return True


def _attach_integrations() -> None:
    """Attach the framework integrations whose libraries are installed (no import otherwise)."""
    candidates = (
        ("transformers", "traceml.integrations.huggingface"),
        ("lightning", "traceml.integrations.lightning"),
        ("pytorch_lightning", "traceml.integrations.lightning"),
        ("accelerate", "traceml.integrations.accelerate"),
    )
    attached: set[str] = set()
    for library, module_name in candidates:
        if module_name in attached or importlib.util.find_spec(library) is None:
            continue
        try:
            module = importlib.import_module(module_name)
            auto_attach = getattr(module, "auto_attach")
        except (ImportError, AttributeError) as exc:
            _warn(f"{library} integration unavailable: {exc}")
            continue
        try:
            auto_attach()
            attached.add(module_name)
        except Exception as exc:
            _warn(f"{library} integration failed to attach: {type(exc).__name__}: {exc}")


def _shutdown() -> None:
    try:
        import traceml

        traceml.shutdown()
    except Exception as exc:
        _warn(f"shutdown did not complete: {type(exc).__name__}: {exc}")


def _note_ending(exc: BaseException | None) -> None:
    """Tell the run-end marker how the script ended (finished, interrupted, failed with code N)."""
    try:
        from traceml.exporter.process_ending import ending_of, note_ending

        note_ending(ending_of(exc))
    except Exception as error:  # the marker then says nothing about the ending
        _warn(f"could not note how the script ended: {type(error).__name__}: {error}")


@contextmanager
def _second_interrupt_ignored(exc: BaseException):
    """After a KeyboardInterrupt, a second SIGINT (torch's agent forwards the one it got too)
    must not cut the bounded telemetry flush short; the script's own interrupt still propagates."""
    previous = None
    if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
        try:
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except (ValueError, OSError):
            previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _run_target(argv: Sequence[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m traceml.launcher.bootstrap (script.py | -m module) [args]")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("bootstrap: -m needs a module name")
        module, args = argv[1], list(argv[2:])
        sys.argv = [module, *args]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, args = argv[0], list(argv[1:])
    sys.argv = [script, *args]
    # What `python script.py` puts first on sys.path: the script's own folder.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if sys.path and sys.path[0] in ("", os.getcwd()):
        # `python -m` put the current directory first; the script's folder replaces it.
        sys.path.pop(0)
    _enable_instrumentation()
    try:
        _run_target(argv)
    except BaseException as exc:
        _note_ending(exc)
        with _second_interrupt_ignored(exc):
            _shutdown()
        raise
    _note_ending(None)
    _shutdown()
    if env_flag(os.environ.get(TRACEML_EXIT_AFTER_FLUSH)):
        from traceml.launcher.process_exit import exit_without_teardown

        exit_without_teardown(0)


if __name__ == "__main__":
    main()
