"""`traceml-processor`: flags first, then TRACEML_PROCESSOR_* / OTEL_* environment, then defaults.

Every flag, its variable, default, range and help come from `traceml.processor.settings`,
which also validates them: a bad value exits 2 with a message naming the flag or
variable, before anything starts. Loopback by default. SIGTERM and SIGINT stop
the receivers, commit what is queued, summarise open runs and exit 0.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sqlite3
import sys

from traceml.processor import settings as s
from traceml.schema.distribution import package_version


def build_parser() -> argparse.ArgumentParser:
    """One flag per declared setting, its help derived from the declaration.

    Flags are taken as text and read by `settings.resolve`, the one place that
    checks every value, so a flag and its variable are judged alike.
    """
    p = argparse.ArgumentParser(
        prog="traceml-processor",
        description="Receive TraceML OTLP, store it in SQLite, diagnose live, re-export summary metrics.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(["variables without a flag:"]
                         + [f"  {' / '.join(x.variables)}: {x.help_text(variables=False)}"
                            for x in s.SETTINGS if x.flag is None]
                         + ["flags win over environment variables, which win over defaults (docs/processor.md)"]))
    for setting in s.SETTINGS:
        if setting.flag is None:
            continue
        choices = setting.kind.choices if isinstance(setting.kind, s.Choice) else None
        p.add_argument(setting.flag, dest=setting.name, metavar=None if choices else setting.metavar,
                       choices=choices, help=setting.help_text())
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    return p


def config_from_args(argv=None, environ=None):
    """Flags + environment -> (ProcessorConfig, ProcessorSettings).

    Raises `settings.SettingError` (a ValueError) for a bad value, `TokenFileError`
    for an unusable token file.
    """
    from traceml.processor.service import ProcessorConfig

    args = build_parser().parse_args(argv)
    resolved = s.resolve(vars(args), environ)
    return ProcessorConfig.from_settings(resolved, environ), resolved


def main(argv=None) -> int:
    from traceml.schema.version_floors import PROCESSOR, refusal

    refused = refusal("traceml-processor", PROCESSOR)  # before any of them is imported
    if refused:
        print(refused, file=sys.stderr)
        return 2
    from traceml.schema.distribution import processor_side_missing_message

    missing = processor_side_missing_message("traceml-processor")
    if missing:  # a core-only (training side) install: the install line, not an ImportError traceback
        print(f"traceml-processor: {missing}", file=sys.stderr)
        return 2
    from traceml.processor.security import TokenFileError

    try:
        config, resolved = config_from_args(argv)
    except TokenFileError as exc:  # a file that is there to be used, as a missing TLS file: cannot start
        print(f"traceml-processor: cannot start: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:  # argparse's own form: usage, then the flag or variable and why
        build_parser().print_usage(sys.stderr)
        print(f"traceml-processor: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, resolved[s.LOG_LEVEL]), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from traceml.processor.service import ProcessorService
    from traceml.processor.signal_stop import SignalStop

    stopping = SignalStop().install(signal.SIGTERM, signal.SIGINT)  # noted only: see signal_stop
    try:
        service = ProcessorService(config).start()
    except (ValueError, OSError, RuntimeError, sqlite3.Error) as exc:  # database problems: sqlite_guard
        print(f"traceml-processor: cannot start: {exc}", file=sys.stderr)
        return 1
    # One line on stdout that launchers and tests can wait for.
    print(f"traceml-processor ready grpc={service.grpc_port} http={service.http_port} "
          f"prometheus={service.prometheus_port} ui={service.ui_port}", flush=True)
    signum = stopping.wait()
    logging.getLogger("traceml.processor").info("signal %d: stopping", signum)
    service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
