"""`traceml run [torchrun options] script.py [args]`: torchrun with TraceML turned on.

Options are parsed by torch's own torchrun parser (so every torchrun flag and
its `PET_*` environment form work unchanged) extended with a few TraceML flags,
and ranks are spawned by torch's elastic launcher. Each rank runs
`python -m traceml.launcher.bootstrap script.py args`, which enables the
instrumentation and then runs the script as `__main__`.

Without an OTLP endpoint (`--endpoint`, `TRACEML_OTLP_ENDPOINT` or the
`OTEL_EXPORTER_OTLP_*ENDPOINT` variables) an embedded `traceml-processor` receives
the ranks' telemetry on loopback and the run ends with `final_summary.json` and
the text card under `./traceml_runs/<run id>/`, also when the script fails. With
an endpoint the ranks only export. The ranks' exporter is pointed at the processor
(or at `--endpoint`) through TraceML's own variables (`TRACEML_OTLP_ENDPOINT`,
`_PROTOCOL`, `_HEADERS`), never the `OTEL_*` ones: the job's own OpenTelemetry SDK
keeps the destination it had. On several nodes the embedded processor runs once, on the
node hosting the rendezvous store, and every node's ranks export to it
(`launcher/multinode.py`); the other nodes start none.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Mapping, Sequence, TextIO

from traceml.launcher import multinode
from traceml.launcher import run_dir as rd
from traceml.launcher.embedded import EmbeddedProcessor, EmbeddedProcessorError
from traceml.schema import environment as env
from traceml.schema.run_id import SOURCE_GENERATED

if TYPE_CHECKING:
    from traceml.launcher.finalize import FinalReport
    from traceml.processor.api import LauncherEnding

BOOTSTRAP_MODULE = "traceml.launcher.bootstrap"
DESCRIPTION = ("Launch a PyTorch script with torchrun's options and TraceML enabled on every rank. "
               "Without an OTLP endpoint an embedded traceml-processor collects the telemetry and the "
               "run ends with final_summary.json and a text card under ./traceml_runs/<run id>/.")


@dataclass(frozen=True, slots=True)
class RunOptions:
    """The TraceML flags of `traceml run` (everything else belongs to torchrun)."""

    live: bool = False
    refresh_s: float = 1.0
    endpoint: str | None = None
    protocol: str | None = None
    run_id: str | None = None
    runs_dir: str = rd.DEFAULT_RUNS_DIR
    print_summary: bool = True
    ui: tuple[str, int] | None = None  # serve the live web view here (port 0: a free one)
    html_report: bool = False  # write <run dir>/report.html at the end
    processor_port: int = multinode.DEFAULT_PROCESSOR_PORT  # the job's processor on several nodes
    processor_token_file: str | None = None  # bearer token of that processor, one file per node


def build_parser(prog: str = "traceml run") -> argparse.ArgumentParser:
    """torchrun's parser, renamed, plus a TraceML option group."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = prog
    parser.description = DESCRIPTION
    add_traceml_options(parser)
    return parser


def add_traceml_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TraceML")
    group.add_argument("--live", action="store_true",
                       help="show the live Step Time view while training (plain periodic lines when "
                            "stdout is not a terminal); rank output goes to <run dir>/logs")
    group.add_argument("--refresh", dest="traceml_refresh", type=float, default=1.0, metavar="SECONDS",
                       help="live view refresh interval (default 1.0)")
    group.add_argument("--endpoint", dest="traceml_endpoint", default=None, metavar="URL",
                       help="export TraceML's OTLP to this endpoint instead of starting the embedded "
                            "processor (default: $TRACEML_OTLP_ENDPOINT, else the OTEL_EXPORTER_OTLP_*"
                            "ENDPOINT variables); the job's own OpenTelemetry keeps its own")
    group.add_argument("--protocol", dest="traceml_protocol", default=None,
                       choices=(env.PROTOCOL_GRPC, env.PROTOCOL_HTTP),
                       help="OTLP protocol for --endpoint (default: $TRACEML_OTLP_PROTOCOL, else "
                            "$OTEL_EXPORTER_OTLP_PROTOCOL, else grpc)")
    group.add_argument("--run-id", dest="traceml_run_id", default=None, metavar="ID",
                       help="run id shared by all ranks (default: $TRACEML_RUN_ID, --rdzv-id, "
                            "$SLURM_JOB_ID, else generated)")
    group.add_argument("--runs-dir", dest="traceml_runs_dir", default=rd.DEFAULT_RUNS_DIR, metavar="DIR",
                       help="where the embedded processor keeps <run id>/ (default ./traceml_runs)")
    group.add_argument("--no-summary-print", dest="traceml_print_summary", action="store_false",
                       help="write the final summary without printing the card")
    group.add_argument("--ui", dest="traceml_ui", action="store_true",
                       help="serve the live web view from the embedded processor and print its address "
                            "(no browser is opened; default address 127.0.0.1 on a free port)")
    group.add_argument("--ui-address", dest="traceml_ui_address", default=None, metavar="HOST:PORT",
                       help="where --ui serves (implies --ui; default 127.0.0.1:<free port>)")
    group.add_argument("--html-report", dest="traceml_html_report", action="store_true",
                       help="also write a one-file HTML report, <run dir>/report.html, at the end")
    group.add_argument("--processor-port", dest="traceml_processor_port", type=int,
                       default=multinode.DEFAULT_PROCESSOR_PORT, metavar="PORT",
                       help="several nodes without --endpoint: the OTLP gRPC port of the job's one "
                            "processor, on the rendezvous host; its OTLP/HTTP port, where every node's "
                            "ranks are asked for deep captures, is the next one (default %(default)s "
                            "and +1; same on every node)")
    group.add_argument("--processor-token-file", dest="traceml_processor_token_file", default=None,
                       metavar="FILE",
                       help="several nodes without --endpoint: the bearer token the job's processor "
                            "requires and every node's ranks send (a file holding the same token on "
                            "every node)")


def parse(argv: Sequence[str], prog: str = "traceml run") -> tuple[argparse.Namespace, RunOptions]:
    parser = build_parser(prog)
    args = parser.parse_args(list(argv))
    if args.traceml_refresh <= 0:
        parser.error("--refresh must be positive")
    if not (0 < args.traceml_processor_port and multinode.control_port_of(args.traceml_processor_port) < 65536):
        parser.error("--processor-port must be between 1 and 65534 (the next port is its OTLP/HTTP)")
    ui = None
    if args.traceml_ui or args.traceml_ui_address:
        from traceml.processor.api import parse_host_port

        try:
            ui = parse_host_port(args.traceml_ui_address) if args.traceml_ui_address else ("127.0.0.1", 0)
        except ValueError as exc:
            parser.error(f"--ui-address: {exc}")
    options = RunOptions(
        live=args.live,
        refresh_s=args.traceml_refresh,
        endpoint=args.traceml_endpoint,
        protocol=args.traceml_protocol,
        run_id=args.traceml_run_id,
        runs_dir=args.traceml_runs_dir,
        print_summary=args.traceml_print_summary,
        ui=ui,
        html_report=args.traceml_html_report,
        processor_port=args.traceml_processor_port,
        processor_token_file=args.traceml_processor_token_file,
    )
    for name in ("live", "traceml_refresh", "traceml_endpoint", "traceml_protocol",
                 "traceml_run_id", "traceml_runs_dir", "traceml_print_summary", "traceml_ui",
                 "traceml_ui_address", "traceml_html_report", "traceml_processor_port",
                 "traceml_processor_token_file"):
        delattr(args, name)
    return args, options


def wrap_with_bootstrap(args: argparse.Namespace) -> bool:
    """Point torchrun at the per-rank bootstrap; False when the entry point is not Python."""
    if args.no_python:
        return False
    script_args = list(args.training_script_args)
    if args.module:
        target = ["-m", args.training_script]
    else:
        target = [args.training_script]
    args.run_path = False
    args.module = True
    args.training_script = BOOTSTRAP_MODULE
    args.training_script_args = [*target, *script_args]
    return True


def launcher_ending_of(args: argparse.Namespace, exc: BaseException | None) -> "LauncherEnding":
    """What this launcher saw of its ranks' exit, for the summary's per-rank endings.

    torch's elastic agent reports exit codes only for failed ranks (`ChildFailedError`,
    keyed by global rank) and then stops the others with SIGTERM; when the job succeeded,
    every rank of this node exited 0; when the agent itself got a signal, it forwarded it.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from traceml.processor.api import LauncherEnding

    if _is_multi_node(args.nnodes):
        # Which global ranks ran here is the rendezvous' choice (c10d ignores --node-rank):
        # only the failed ranks' codes, keyed by global rank, are sure.
        if isinstance(exc, ChildFailedError):
            return LauncherEnding(exit_codes={int(r): int(f.exitcode) for r, f in exc.failures.items()})
        return LauncherEnding()
    node_rank = None  # one node: every rank ran under this launcher
    if exc is None:
        return LauncherEnding(node_rank, others_exit_code=0)
    if isinstance(exc, ChildFailedError):
        codes = {int(rank): int(failure.exitcode) for rank, failure in exc.failures.items()}
        return LauncherEnding(node_rank, exit_codes=codes, signal=int(signal.SIGTERM))
    if isinstance(exc, SignalException):
        return LauncherEnding(node_rank, signal=int(exc.sigval))
    if isinstance(exc, KeyboardInterrupt):
        return LauncherEnding(node_rank, signal=int(signal.SIGINT))
    if isinstance(exc, _TerminatedBeforeLaunch):
        return LauncherEnding(node_rank, signal=exc.signum)
    return LauncherEnding(node_rank)


def exit_code_of(exc: BaseException) -> int:
    """Map what torch's launcher raised to the exit status a shell expects."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(exc, ChildFailedError):
        _, failure = exc.get_first_failure()
        code = int(failure.exitcode)
        return 128 - code if code < 0 else (code or 1)
    if isinstance(exc, SignalException):
        return 128 + int(exc.sigval)
    if isinstance(exc, KeyboardInterrupt):
        return 128 + int(signal.SIGINT)
    if isinstance(exc, SystemExit):
        if exc.code is None:
            return 0
        return exc.code if isinstance(exc.code, int) else 1
    return 1


class _TerminatedBeforeLaunch(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(f"received signal {signum}")
        self.signum = signum


@contextmanager
def _patched_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set the ranks' environment (inherited through the elastic agent), restore afterwards."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Until torch installs its own handlers, SIGTERM must still let us clean up."""
    if sys.platform == "win32":
        yield
        return

    def handler(signum, _frame):
        raise _TerminatedBeforeLaunch(signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. a test harness)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass(frozen=True)
class LaunchResult:
    exit_code: int
    run_id: str
    run_dir: Path | None  # None when exporting to an external endpoint
    report: "FinalReport | None" = None


def _say(out: TextIO, message: str) -> None:
    print(f"[traceml] {message}", file=out, flush=True)


def launch(args: argparse.Namespace, options: RunOptions, *, out: TextIO | None = None) -> LaunchResult:
    """Run the job to completion; `exit_code` is the status to forward."""
    from torch.distributed.run import run as torch_run

    out = out or sys.stdout
    user_rdzv_id = args.rdzv_id if not args.standalone else None
    resolved = rd.resolve_run_id(options.run_id, user_rdzv_id)
    if not (args.module or args.no_python) and not os.path.isfile(args.training_script):
        # What `python missing.py` answers, before any processor or rank starts.
        _say(out, f"error: can't open file {args.training_script!r}: no such file")
        return LaunchResult(2, resolved.run_id, None)
    endpoint = options.endpoint or _environment_endpoint()
    placement = None if endpoint else _placement(args, options, out)
    if not endpoint and (placement is None or placement.hosts_here):
        from traceml.schema.distribution import processor_side_missing_message

        missing = processor_side_missing_message("the embedded processor of traceml run")
        if missing:  # a core-only install: refuse before anything starts, say both ways out
            _say(out, f"error: {missing}; or send the ranks' telemetry to a running traceml-processor "
                      f"with --endpoint URL")
            return LaunchResult(2, resolved.run_id, None)
    if resolved.source == SOURCE_GENERATED and _is_multi_node(args.nnodes):
        _say(out, "warning: multi-node launch without --run-id, --rdzv-id or $TRACEML_RUN_ID: "
                  "each node generates its own run id"
                  + (", so the job's processor keeps each node's ranks as a run of its own"
                     if placement is not None else ""))
    if placement is not None and options.processor_token_file:
        from traceml.processor.api import TokenFileError

        try:
            token_header = multinode.bearer_header(options.processor_token_file)
        except TokenFileError as exc:
            _say(out, f"error: {exc}")
            return LaunchResult(2, resolved.run_id, None)

    rank_env = {env.TRACEML_LAUNCHED: "1", env.TRACEML_RUN_ID: resolved.run_id}
    if not wrap_with_bootstrap(args):
        _say(out, "warning: --no-python entry points cannot be instrumented automatically; "
                  "TRACEML_LAUNCHED and TRACEML_RUN_ID are set for a script that calls traceml.init()")

    processor: EmbeddedProcessor | None = None
    run_path: Path | None = None
    monitor = None
    report = None
    exit_code = 0
    failure: BaseException | None = None
    with _sigterm_raises():
        try:
            if placement is not None and options.processor_token_file:
                rank_env[env.TRACEML_OTLP_HEADERS] = token_header
            if endpoint:
                _export_only(endpoint, options, rank_env, resolved.run_id, out)
            elif placement is not None and not placement.hosts_here:
                _export_to_job_processor(placement, options, rank_env, resolved.run_id, out)
            else:
                run_path = rd.run_directory(options.runs_dir, resolved.run_id)
                processor = _start_embedded(args, options, run_path, rank_env, resolved.run_id, out,
                                            placement)
                if processor is None and placement is not None and \
                        rank_env.get(env.TRACEML_OTLP_ENDPOINT) == placement.endpoint:
                    # Another launcher on this machine hosts the job's processor after all.
                    placement = dataclasses.replace(placement, hosts_here=False)
                    _remove_if_empty(run_path)
                    run_path = None
                if options.live and processor is not None:
                    monitor = _start_live(args, options, run_path, rank_env, resolved.run_id, out)
            with _patched_environ(rank_env):
                torch_run(args)
        except _TerminatedBeforeLaunch as exc:
            exit_code = 128 + exc.signum
            failure = exc
        except BaseException as exc:  # noqa: BLE001 - every failure still gets a summary
            exit_code = exit_code_of(exc)
            failure = exc
            _report_failure(out, exc, args)
        finally:
            if monitor is not None:
                monitor.stop()
            if processor is not None:
                processor.stop()
                if run_path is not None and processor.endpoints is not None:
                    from traceml.launcher.finalize import finalize_run

                    report = finalize_run(run_path, resolved.run_id, out=out,
                                          print_card=options.print_summary, exit_code=exit_code,
                                          launcher=_launcher_ending(args, failure))
                    if options.html_report and report is not None:
                        _write_html_report(run_path, resolved.run_id, out)
            elif placement is not None and not placement.hosts_here:
                _say(out, f"run {resolved.run_id}: this node's ranks exported to the job's processor on "
                          f"{placement.address}; the summary of all ranks is written on that node, "
                          f"under its --runs-dir (default {rd.DEFAULT_RUNS_DIR})/<run id>/final_summary.json")
    return LaunchResult(exit_code, resolved.run_id, run_path, report)


def _remove_if_empty(path: Path) -> None:
    try:
        path.rmdir()  # only an empty folder: nothing of the run is ever removed
    except OSError:
        pass


def _placement(args: argparse.Namespace, options: RunOptions, out: TextIO):
    """The job's one processor on several nodes (`launcher/multinode.py`); None on one node or
    when no node is known to hold the rendezvous endpoint (each node then keeps its own)."""
    if not _is_multi_node(args.nnodes):
        return None
    try:
        placement = multinode.placement_of(args, options.processor_port)
    except Exception as exc:  # a rendezvous torch itself will refuse; it says why
        _say(out, f"warning: cannot tell which node hosts the rendezvous ({type(exc).__name__}: {exc})")
        return None
    if placement is not None and placement.hosts_here:
        bind = multinode.bind_host_for(placement.host)
        if multinode.port_taken(bind, placement.port):
            # As torch's c10d backend does for its store: a second launcher on the host machine
            # (several "nodes" on one host) finds the first one's server and joins it.
            _say(out, f"port {placement.port} on {placement.host} is already in use: this node exports "
                      f"to the processor there (another launcher of this job on this machine, or "
                      f"choose a free --processor-port on every node)")
            return dataclasses.replace(placement, hosts_here=False)
        if multinode.port_taken(bind, placement.control_port):
            # Not another launcher (it would hold the gRPC port too): a stranger. Telemetry goes on;
            # only the other nodes' deep captures are lost (their polls fail, counted, never raised).
            _say(out, f"warning: port {placement.control_port} on {placement.host} (--processor-port + 1, "
                      f"the job's processor's OTLP/HTTP) is already in use: the processor serves it on "
                      f"loopback, so ranks of other nodes cannot be asked for deep captures; choose a "
                      f"--processor-port whose next port is free, on every node")
            return dataclasses.replace(placement, control_port=None)
    return placement


def _export_to_job_processor(placement, options: RunOptions, rank_env: dict[str, str], run_id: str,
                             out: TextIO) -> None:
    """A node that does not host the rendezvous: no processor here, the ranks export to the host's."""
    rank_env[env.TRACEML_OTLP_ENDPOINT] = placement.endpoint
    rank_env[env.TRACEML_OTLP_PROTOCOL] = env.PROTOCOL_GRPC
    _to_our_processor(rank_env)
    _say(out, f"run {run_id}: no processor on this node; the ranks export OTLP gRPC to the job's "
              f"processor on {placement.address} ({placement.why})")
    if not os.environ.get(env.TRACEML_CONTROL_ENDPOINT, "").strip() and placement.control_url:
        # Deep captures: the ranks poll the job's processor's OTLP/HTTP, at --processor-port + 1.
        rank_env[env.TRACEML_CONTROL_ENDPOINT] = placement.control_url
    if options.live or options.ui is not None or options.html_report:
        _say(out, "--live, --ui and --html-report apply on the node that runs the job's processor")


def _to_our_processor(rank_env: dict[str, str]) -> None:
    """Ranks that export only to TraceML's processor (this launcher's, or the job's on another
    node) send no phase child spans unless TRACEML_PHASE_SPANS says otherwise: those spans are
    for trace viewers, which this destination is not (the processor counts and drops them,
    docs/wire-format.md), and they are most of what a step costs to encode, send and decode."""
    if not os.environ.get(env.TRACEML_PHASE_SPANS, "").strip():
        rank_env[env.TRACEML_PHASE_SPANS] = "0"


def _launcher_ending(args: argparse.Namespace, failure: BaseException | None):
    try:
        return launcher_ending_of(args, failure)
    except Exception:  # the summary then goes by the end markers alone
        return None


def _write_html_report(run_path: Path, run_id: str, out: TextIO) -> None:
    """`--html-report`: the one-file report beside the summary; a failure is reported, never raised."""
    from traceml.processor.api import REPORT_FILENAME, write_run_report

    try:
        path = write_run_report(run_path / rd.DB_FILENAME, run_id, run_path / REPORT_FILENAME)
    except Exception as exc:  # the training outcome matters more than our report
        _say(out, f"could not write the HTML report: {type(exc).__name__}: {exc}")
        return
    _say(out, f"HTML report:   {path}")


def _environment_endpoint() -> str | None:
    """Where the environment already sends the ranks' telemetry, described for the log line; None:
    nowhere. TraceML's own variable first, then the per-signal and generic OTEL_* ones
    (`environment.exporter_value`: the exporter's own precedence)."""
    found = {signal: env.exporter_value(os.environ, "ENDPOINT", signal) for signal in env.OTLP_SIGNALS}
    if all(f is not None and f[0] in (env.TRACEML_OTLP_ENDPOINT, env.OTEL_EXPORTER_OTLP_ENDPOINT)
           for f in found.values()) and found["traces"] == found["metrics"]:
        return found["traces"][1].strip()
    return ", ".join(f"{f[1].strip()} ({signal})" for signal, f in found.items() if f is not None) or None


def _export_only(endpoint: str, options: RunOptions, rank_env: dict[str, str], run_id: str,
                 out: TextIO) -> None:
    # TraceML's own variables: the job's OpenTelemetry SDK reads only OTEL_*. Without --endpoint
    # the ranks inherit the environment's variables as they are.
    if options.endpoint:
        rank_env[env.TRACEML_OTLP_ENDPOINT] = endpoint
    if options.protocol:
        rank_env[env.TRACEML_OTLP_PROTOCOL] = options.protocol
    if options.live:
        _say(out, "--live needs the embedded processor; with an endpoint, watch the "
                  "processor instead (traceml top --db PATH)")
    if options.ui is not None or options.html_report:
        _say(out, "--ui and --html-report need the embedded processor; with an endpoint, start "
                  "traceml-processor --ui HOST:PORT there, and use traceml summary --html on its database")
    _say(out, f"run {run_id}: exporting OTLP to {endpoint}")


def _start_embedded(args: argparse.Namespace, options: RunOptions, run_path: Path,
                    rank_env: dict[str, str], run_id: str, out: TextIO,
                    placement=None) -> EmbeddedProcessor | None:
    """Start the processor and point the ranks at it; None (training goes on) if it cannot start.

    With a `placement` (this node hosts the job's processor) OTLP gRPC listens on the rendezvous
    host's address and `--processor-port`, and every node's ranks export there."""
    shared = {}
    if placement is not None:
        token_file = options.processor_token_file
        bind = multinode.bind_host_for(placement.host)
        shared = dict(grpc_bind=(bind, placement.port), advertised_host=placement.host,
                      auth_token_file=Path(token_file).resolve() if token_file else None,
                      http_bind=None if placement.control_port is None else (bind, placement.control_port))
    # One node: every rank sends OTLP/HTTP (below), so the processor runs no gRPC server, whose
    # threads would wake all run long for nothing.
    processor = EmbeddedProcessor(db_path=run_path / rd.DB_FILENAME, summary_dir=Path(options.runs_dir),
                                  log_path=run_path / "processor.log", ui=options.ui,
                                  grpc=placement is not None, **shared)
    try:
        run_path.mkdir(parents=True, exist_ok=True)
        endpoints = processor.start()
    except (EmbeddedProcessorError, OSError) as exc:
        if placement is not None and multinode.port_taken(multinode.bind_host_for(placement.host),
                                                          placement.port):
            # Another launcher on this machine won the port first (both checked before either
            # started): export to its processor, as when the port was taken before the check.
            _export_to_job_processor(placement, options, rank_env, run_id, out)
            return None
        # Telemetry must not stop training: run the job, just without collection.
        _say(out, f"warning: {exc}; the script runs without telemetry collection")
        return None
    if placement is None:
        # One node: OTLP/HTTP on loopback, where the exporter keeps one plain connection and no
        # gRPC threads run beside training (docs/performance.md: the background cost).
        rank_env[env.TRACEML_OTLP_ENDPOINT] = endpoints.control_url
        rank_env[env.TRACEML_OTLP_PROTOCOL] = env.PROTOCOL_HTTP
    else:  # every node's ranks reach the job's processor alike, over gRPC
        rank_env[env.TRACEML_OTLP_ENDPOINT] = endpoints.otlp_grpc_endpoint
        rank_env[env.TRACEML_OTLP_PROTOCOL] = env.PROTOCOL_GRPC
    _to_our_processor(rank_env)
    if not os.environ.get(env.TRACEML_CONTROL_ENDPOINT, "").strip():
        # Deep captures: the ranks poll the processor's OTLP/HTTP for requests: loopback on one
        # node, the rendezvous host at --processor-port + 1 for every node's ranks on several (a
        # user's own setting is kept as it is).
        rank_env[env.TRACEML_CONTROL_ENDPOINT] = endpoints.control_url
    listens = f"{endpoints.http_address} (OTLP/HTTP)" if placement is None else \
        f"{endpoints.grpc_address} (OTLP gRPC, where the ranks send) and {endpoints.http_address} (OTLP/HTTP)"
    _say(out, f"run {run_id}: embedded processor on {listens}, data in {run_path}")
    if endpoints.ui is not None:
        _say(out, f"live web view: {endpoints.ui_url(run_id)}")
    if placement is not None:
        polls = (f" and poll {endpoints.control_url} for deep-capture requests"
                 if placement.control_port is not None else "")
        _say(out, f"every node's ranks export to it ({placement.why}){polls}; the summary of all ranks "
                  f"is written here")
        from traceml.schema.hosts import is_loopback

        if not options.processor_token_file and not is_loopback(endpoints.grpc_host):
            _say(out, f"warning: the job's processor listens on {endpoints.grpc_address} without a "
                      f"bearer token or TLS: anyone who can reach that address (and "
                      f"{endpoints.control_url}) can send it telemetry and ask for deep captures; "
                      f"pass --processor-token-file FILE (the same token on every node), or run "
                      f"traceml-processor with --tls-cert/--auth-token-file and pass --endpoint")
    elif _is_multi_node(args.nnodes):
        _say(out, f"warning: with --rdzv-backend {args.rdzv_backend} no node is known to host the "
                  "rendezvous, so each node starts its own embedded processor and sees only its own "
                  "ranks; for one diagnosis of all nodes, run traceml-processor once and pass --endpoint")
    return processor


def _start_live(args: argparse.Namespace, options: RunOptions, run_path: Path,
                rank_env: dict[str, str], run_id: str, out: TextIO):
    from traceml.launcher.live import LiveMonitor

    if _redirect_rank_output(args, run_path):
        _say(out, f"rank output goes to {args.log_dir}")
    # torchrun's own default for several local ranks, set quietly so its warning
    # banner does not tear through the live display.
    nproc = str(args.nproc_per_node)
    if "OMP_NUM_THREADS" not in os.environ and nproc.isdigit() and int(nproc) > 1:
        rank_env["OMP_NUM_THREADS"] = "1"
    monitor = LiveMonitor(run_path / rd.DB_FILENAME, run_id, refresh_s=options.refresh_s, out=out)
    monitor.start()
    return monitor


def _is_multi_node(nnodes: str) -> bool:
    from torch.distributed.run import parse_min_max_nnodes

    try:
        _, max_nodes = parse_min_max_nnodes(nnodes)
    except Exception:
        return False
    return max_nodes > 1


def _redirect_rank_output(args: argparse.Namespace, run_path: Path) -> bool:
    """Keep the live view readable: rank stdout/stderr go to files unless the user chose."""
    if str(args.redirects) == "0" and str(args.tee) == "0" and not args.log_dir:
        args.redirects = "3"
        args.log_dir = str(run_path / "logs")
        return True
    return False


def _report_failure(out: TextIO, exc: BaseException, args: argparse.Namespace) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(exc, ChildFailedError):
        rank, failure = exc.get_first_failure()
        _say(out, f"rank {rank} failed with exit code {failure.exitcode}")
        if args.log_dir and str(args.redirects) != "0":
            for name in ("stderr.log", "stdout.log"):
                for log in sorted(Path(args.log_dir).rglob(name)):
                    if log.parent.name != str(failure.local_rank):
                        continue
                    tail = log.read_text(errors="replace").splitlines()[-20:]
                    if tail:
                        _say(out, f"last lines of {log}:")
                        print("\n".join(tail), file=out, flush=True)
    elif not isinstance(exc, (KeyboardInterrupt, SystemExit)):
        _say(out, f"launch failed: {type(exc).__name__}: {exc}")


HELP_WITHOUT_TORCH_EPILOG = (
    "Every torchrun option is accepted as well, before the script (--nproc-per-node, --nnodes, "
    "--node-rank, --rdzv-backend, --rdzv-endpoint, --rdzv-id, --max-restarts, --standalone, ..., and "
    "their PET_* environment forms): `torchrun --help` lists them, or `traceml run --nproc-per-node 1 "
    "--help` shows torch's own parser with the TraceML options. docs/cli.md describes each TraceML option.")


def asks_for_help_only(argv: Sequence[str]) -> bool:
    """`-h`/`--help` among leading flags only (`traceml run --help`, `traceml run --live -h`): the help
    can then be answered without torch. After a value or the script, `--help` may be the script's own,
    and torch's parser decides."""
    for token in argv:
        if token in ("-h", "--help"):
            return True
        if not token.startswith("-") or token == "--":
            return False
    return False


def print_help_without_torch(out: TextIO, prog: str = "traceml run") -> None:
    """The TraceML options, parsed by the same `add_traceml_options` as the real parser, and where the
    torchrun options are: torch costs seconds to import just to print text."""
    parser = argparse.ArgumentParser(
        prog=prog, usage=f"{prog} [torchrun options] [TraceML options] script.py [script args]",
        description=DESCRIPTION, epilog=HELP_WITHOUT_TORCH_EPILOG)
    add_traceml_options(parser)
    parser.print_help(out)


def main(argv: Sequence[str]) -> int:
    if asks_for_help_only(argv):
        print_help_without_torch(sys.stdout)
        return 0
    import importlib.util

    if importlib.util.find_spec("torch") is None:  # a training side installed where torch is not
        print("traceml run: PyTorch (torch) is not installed in this environment; traceml run launches the "
              "script through torch's own launcher (torchrun). Install TraceML where you train.", file=sys.stderr)
        return 2
    args, options = parse(argv)
    return launch(args, options).exit_code
