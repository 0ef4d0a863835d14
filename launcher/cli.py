"""The `traceml` command: one entry point, one module per subcommand.

`run` hands its arguments to torch's own torchrun parser (extended with TraceML
flags), so it is dispatched before argparse sees anything; the other
subcommands parse their own flags. Heavy imports (torch, rich) happen inside
the subcommand that needs them, so `traceml --help` and `traceml compare` stay
quick and work without torch.
"""
from __future__ import annotations

import sys
from typing import Callable, Sequence

USAGE = """\
usage: traceml <command> [options]

Step-time profiling for PyTorch training over OpenTelemetry.

commands:
  run       launch a script with torchrun options and TraceML on every rank
            (embedded processor, final summary, --live view)
  demo      a self-contained CPU run with an injected bottleneck (< 1 minute)
  summary   rebuild final_summary.json and the card from a run folder or database
  compare   compare two final summaries (step time, phases, diagnosis, memory)
  top       watch a processor database live from another terminal
  fleet     hosts and GPUs that keep being a run's straggler (runs flagged, time lost)
  capture   profile a few steps of one rank of a live run against a reference rank: the digest

`traceml <command> --help` describes each command; docs/cli.md has them all.
"""


def _run(argv: Sequence[str]) -> int:
    from traceml.launcher import run

    return run.main(argv)


def _demo(argv: Sequence[str]) -> int:
    from traceml.launcher import demo

    return demo.main(argv)


def _summary(argv: Sequence[str]) -> int:
    from traceml.launcher import summary

    return summary.main(argv)


def _compare(argv: Sequence[str]) -> int:
    from traceml.launcher import compare

    return compare.main(argv)


def _top(argv: Sequence[str]) -> int:
    from traceml.launcher import top

    return top.main(argv)


def _fleet(argv: Sequence[str]) -> int:
    from traceml.launcher import fleet

    return fleet.main(argv)


def _capture(argv: Sequence[str]) -> int:
    from traceml.launcher import capture

    return capture.main(argv)


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "run": _run,
    "demo": _demo,
    "summary": _summary,
    "compare": _compare,
    "top": _top,
    "fleet": _fleet,
    "capture": _capture,
}

NEEDS_PROCESSOR_SIDE = frozenset({"demo", "summary", "compare", "top", "fleet"})
"""Subcommands that always run processor code (`run` needs it only for its embedded processor,
and checks that itself): refused with the install line when the `processor` extra is missing."""


def _asks_for_help(args: Sequence[str]) -> bool:
    """-h/--help among the command's own options (before the script: after it they are the script's)."""
    for arg in args:
        if arg in ("-h", "--help"):
            return True
        if arg.endswith(".py"):
            return False
    return False


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] == "--version":
        from traceml.schema.distribution import package_version

        print(f"traceml {package_version()}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"traceml: unknown command {argv[0]!r}\n", file=sys.stderr)
        print(USAGE, end="", file=sys.stderr)
        return 2
    from traceml.schema.version_floors import refusal

    # A component below its floor: one line each, before anything starts (help still answers).
    refused = None if _asks_for_help(argv[1:]) else refusal("traceml")
    if refused:
        print(refused, file=sys.stderr)
        return 2
    if argv[0] in NEEDS_PROCESSOR_SIDE and not {"-h", "--help"} & set(argv[1:]):
        from traceml.schema.distribution import processor_side_missing_message

        missing = processor_side_missing_message(f"traceml {argv[0]}")
        if missing:  # a core-only install (what a rank needs): say so, no ImportError traceback
            print(f"traceml: {missing}", file=sys.stderr)
            return 2
    try:
        return int(command(argv[1:]) or 0)
    except KeyboardInterrupt:
        return 130


def console_main() -> None:
    """The `traceml` console script: `main`, then, when the command imported torch (`run`,
    `demo`), an exit without the interpreter's teardown (`process_exit`): the launcher holds
    nothing it would save. A non-daemon thread still running gets the normal exit, which waits
    for it."""
    code = main()
    if "torch" in sys.modules:
        from traceml.launcher.process_exit import exit_without_teardown, others_still_running

        if not others_still_running():
            exit_without_teardown(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
