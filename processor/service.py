"""The processor composed in one place: store, ingest, receivers, run monitor, re-export.

Receivers -> OtlpIntake (decode) -> IngestQueue (commit, then acknowledge)
-> StepTimeStore; after each commit the RunMonitor learns which runs moved, and
on its own thread refreshes their live analysis and ends finished or idle runs.
The Prometheus endpoint and the OTLP pusher read the monitor's latest points.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from traceml.processor.admission import RunAdmission
from traceml.processor.decode import DecodeLimits, Decoder
from traceml.processor.ingest import IngestQueue
from traceml.processor.mapping import BUILTIN, MappingSet, SpanMapping, load_mapping_file
from traceml.processor.metric_point import MetricPoint
from traceml.processor.otlp_intake import OtlpIntake
from traceml.processor.runs import RunMonitor, stored_run_is_over
from traceml.processor.security import BearerAuth, TlsConfig, warn_if_exposed
from traceml.processor.http_front import HttpLimits
from traceml.processor.self_telemetry import SelfTelemetry
from traceml.processor import settings as s
from traceml.processor.summary_export import SummaryExportConfig, SummaryPusher
from traceml.schema import vocabulary as v

LOG = logging.getLogger(__name__)


@dataclass
class ProcessorConfig:
    """Every setting of one processor, composed into the parts that use them.

    The defaults, ranges and meanings are `traceml.processor.settings`' declarations;
    the CLI builds one with `from_settings`, code and tests construct one directly,
    and either way a value out of its range is refused here (`SettingError`).
    """

    db: Path
    otlp_grpc: tuple[str, int] | None = s.OTLP_GRPC.default
    otlp_http: tuple[str, int] | None = s.OTLP_HTTP.default
    prometheus: tuple[str, int] | None = s.PROMETHEUS.default
    ui: tuple[str, int] | None = s.UI.default  # the web view (--ui)
    export: SummaryExportConfig | None = None
    summary_dir: Path | None = s.SUMMARY_DIR.default
    auth: BearerAuth = field(default_factory=BearerAuth)
    tls: TlsConfig = field(default_factory=TlsConfig)
    idle_timeout_s: float = s.IDLE_TIMEOUT.default
    refresh_interval_s: float = s.REFRESH_INTERVAL.default
    limits: DecodeLimits = field(default_factory=DecodeLimits)  # max runs, max ranks per run
    max_pending_records: int = s.MAX_PENDING_RECORDS
    grpc_workers: int = s.GRPC_THREADS  # threads per gRPC server
    max_concurrent_requests: int = s.MAX_CONCURRENT_REQUESTS.default  # per receiver; beyond: "retry later"
    workers: int = s.WORKERS.default  # ingest processes sharing the receiver ports (SO_REUSEPORT)
    http_limits: HttpLimits = field(default_factory=HttpLimits)  # OTLP/HTTP timeouts and connection cap
    rank_series_top_k: int = s.RANK_SERIES_TOP_K.default  # per-rank series: ranks by score beyond the culprits
    max_series: int = s.MAX_SERIES.default  # per scrape / push; whole runs beyond it are left out, counted
    repeat_offender_runs: int = s.REPEAT_OFFENDER_RUNS.default  # K of the repeat-offender rule
    repeat_offender_window: int = s.REPEAT_OFFENDER_WINDOW.default  # N: a host's last runs counted
    fleet_period_s: float = s.FLEET_PERIOD.default  # culprit history behind the fleet series
    mapping: SpanMapping | None = None  # a declared foreign-step mapping (--mapping-file), before the built-ins
    capture: str = s.CAPTURE.default  # deep profiler captures: auto, manual or off
    capture_steps: int = s.CAPTURE_STEPS.default
    capture_cooldown_s: float = s.CAPTURE_COOLDOWN.default
    capture_max_trace_bytes: int = s.CAPTURE_MAX_TRACE_BYTES.default
    capture_deadline_s: float = s.CAPTURE_DEADLINE.default

    def mapping_set(self) -> MappingSet:
        """The foreign-step mappings in force: the declared one first, then the built-ins."""
        return MappingSet(((self.mapping,) if self.mapping is not None else ()) + BUILTIN)

    def __post_init__(self) -> None:
        for setting in (s.IDLE_TIMEOUT, s.REFRESH_INTERVAL, s.MAX_CONCURRENT_REQUESTS, s.WORKERS,
                        s.RANK_SERIES_TOP_K, s.MAX_SERIES, s.REPEAT_OFFENDER_RUNS, s.REPEAT_OFFENDER_WINDOW,
                        s.FLEET_PERIOD, s.CAPTURE_STEPS, s.CAPTURE_COOLDOWN, s.CAPTURE_MAX_TRACE_BYTES,
                        s.CAPTURE_DEADLINE):
            setting.check(getattr(self, setting.name), f"ProcessorConfig.{setting.name}")
        if self.capture not in s.CAPTURE.kind.choices:
            raise s.SettingError(f"ProcessorConfig.capture={self.capture!r} is invalid: expected "
                                 f"{s.CAPTURE.kind.expected}")
        for setting, value in ((s.MAX_RUNS, self.limits.max_runs),
                               (s.MAX_RANKS_PER_RUN, self.limits.max_ranks_per_run)):
            setting.check(value, f"DecodeLimits.{setting.name}")
        if self.export is not None:
            s.EXPORT_INTERVAL.check(self.export.interval_s, "SummaryExportConfig.interval_s")

    @classmethod
    def from_settings(cls, settings: s.ProcessorSettings, environ=None) -> "ProcessorConfig":
        """The config `settings` describe (`settings.resolve`). Raises TokenFileError for an
        unusable `--auth-token-file`."""
        from traceml.processor.security import read_token_file

        token_file = settings[s.AUTH_TOKEN_FILE]
        token = read_token_file(token_file) if token_file is not None else settings[s.AUTH_TOKEN]
        cert, key = settings[s.TLS_CERT], settings[s.TLS_KEY]
        return cls(
            db=settings[s.DB],
            otlp_grpc=settings[s.OTLP_GRPC],
            otlp_http=settings[s.OTLP_HTTP],
            prometheus=settings[s.PROMETHEUS],
            ui=settings[s.UI],
            export=s.summary_export_config(settings, environ),
            summary_dir=settings[s.SUMMARY_DIR],
            auth=BearerAuth(token or None),
            tls=TlsConfig(None if cert is None else str(cert), None if key is None else str(key)),
            idle_timeout_s=settings[s.IDLE_TIMEOUT],
            refresh_interval_s=settings[s.REFRESH_INTERVAL],
            limits=DecodeLimits(max_runs=settings[s.MAX_RUNS], max_ranks_per_run=settings[s.MAX_RANKS_PER_RUN]),
            max_concurrent_requests=settings[s.MAX_CONCURRENT_REQUESTS],
            workers=settings[s.WORKERS],
            http_limits=HttpLimits(header_timeout_s=settings[s.HTTP_HEADER_TIMEOUT],
                                   body_timeout_s=settings[s.HTTP_BODY_TIMEOUT],
                                   body_chunk_timeout_s=settings[s.HTTP_BODY_CHUNK_TIMEOUT],
                                   keepalive_timeout_s=settings[s.HTTP_KEEPALIVE_TIMEOUT],
                                   max_connections=settings[s.HTTP_MAX_CONNECTIONS]),
            rank_series_top_k=settings[s.RANK_SERIES_TOP_K],
            max_series=settings[s.MAX_SERIES],
            repeat_offender_runs=settings[s.REPEAT_OFFENDER_RUNS],
            repeat_offender_window=settings[s.REPEAT_OFFENDER_WINDOW],
            fleet_period_s=settings[s.FLEET_PERIOD],
            mapping=None if settings[s.MAPPING_FILE] is None else load_mapping_file(settings[s.MAPPING_FILE]),
            capture=settings[s.CAPTURE],
            capture_steps=settings[s.CAPTURE_STEPS],
            capture_cooldown_s=settings[s.CAPTURE_COOLDOWN],
            capture_max_trace_bytes=settings[s.CAPTURE_MAX_TRACE_BYTES],
            capture_deadline_s=settings[s.CAPTURE_DEADLINE],
        )


class StepTimeBackend:
    """The Step Time read side, diagnosis and reporting as the RunMonitor uses them.

    `record_culprits`: where a summarised run's confirmed culprits go (the store's writer),
    for the repeat-offender rule of later runs and the fleet listing; None: not recorded."""

    def __init__(self, rank_series_top_k: int = s.RANK_SERIES_TOP_K.default, *,
                 repeat_offenders: tuple[int, int] = (s.REPEAT_OFFENDER_RUNS.default, s.REPEAT_OFFENDER_WINDOW.default),
                 record_culprits=None):
        self.rank_series_top_k = rank_series_top_k
        self.repeat_offenders = repeat_offenders
        self.record_culprits = record_culprits
        self._totals: dict = {}  # run id -> its step counters (`reporting.step_exemplars.StepTotals`)

    def open_session(self, db_path: Path, run_id: str):
        from traceml.processor.step_time.pipeline import LiveStepTimeSession

        return LiveStepTimeSession(db_path, run_id)

    def project(self, db_path: Path, result):
        from traceml.processor.reporting.step_exemplars import StepTotals, advance
        from traceml.processor.summary_section import live_points

        window = result.analysis.window
        totals = self._totals[window.run_id] = advance(self._totals.get(window.run_id, StepTotals()), window,
                                                       ledger=result.analysis.ledger)
        return live_points(result, db_path, top_k=self.rank_series_top_k, totals=totals)

    def forget(self, run_id: str) -> None:
        """The run left the monitor: its step counters go (they start again if it returns)."""
        self._totals.pop(run_id, None)

    def write_summary(self, db_path: Path, run_id: str, folder: Path) -> list[Path]:
        from traceml.processor.summary_section import write_summary

        paths, culprits = write_summary(db_path, run_id, folder, repeat_offenders=self.repeat_offenders)
        if self.record_culprits is not None:
            self.record_culprits(run_id, culprits)
        return list(paths)


class ProcessorService:
    def __init__(self, config: ProcessorConfig, backend=None):
        from traceml.processor.sqlite_writer import StepTimeStore

        config.tls.validate()
        self.config = config
        self.pool = None
        shared = None
        if config.workers > 1:
            from traceml.processor.workers import WorkerPool

            self.pool = WorkerPool(config, config.workers - 1)
            shared = self.pool.make_shared_counts(SelfTelemetry.size)
        self.stats = SelfTelemetry(shared=shared)
        # Read-only first (a foreign file is refused before anything is created), then
        # one processor per database (the lock), then every page, then the writer.
        from traceml.processor.sqlite_guard import WriterLock, check_database, integrity_check

        check_database(config.db)
        self.db_lock = WriterLock(config.db).acquire()
        try:
            integrity_check(config.db)
            self.store = StepTimeStore(config.db)
        except BaseException:
            self.db_lock.release()
            raise
        known = self._recent_runs()
        self.admission = RunAdmission(config.limits, known)
        self.decoder = Decoder(config.limits, self.admission)
        self.decoder.spans.mappings = config.mapping_set()
        from traceml.processor.fleet_series import FleetSeries

        self.fleet = FleetSeries(config.db, config.fleet_period_s)
        from traceml.processor.capture.book import CaptureBook, digest_of
        from traceml.processor.capture.files import CaptureFiles
        from traceml.processor.capture.policy import CapturePolicy

        # Deep captures (issue 33): the book of requests, asked by the policy after live refreshes.
        self.captures = CaptureBook(
            CaptureFiles(Path(config.db)), mode=config.capture, steps=config.capture_steps,
            cooldown_s=config.capture_cooldown_s, max_trace_bytes=config.capture_max_trace_bytes,
            deadline_s=config.capture_deadline_s, holds_run=self._ranks_held, run_ended=self._run_ended,
            digest=lambda record: digest_of(record, self.capture_policy.window_of(record.run_id)))
        self.capture_policy = CapturePolicy(self.captures)
        self.captures.choose_reference = self.capture_policy.choose_reference
        auto = config.capture == "auto"
        self.monitor = RunMonitor(
            Path(config.db), backend or StepTimeBackend(
                config.rank_series_top_k,
                repeat_offenders=(config.repeat_offender_runs, config.repeat_offender_window),
                record_culprits=self._record_culprits), summary_dir=config.summary_dir,
            refresh_interval_s=config.refresh_interval_s, idle_timeout_s=config.idle_timeout_s,
            poll_store=config.workers > 1, on_forgotten=self._forget_run,
            on_refreshed=self.capture_policy.after_refresh if auto else None,
            watch_interval_s=s.CAPTURE_WATCH_INTERVAL_S if auto else None,
            watch_max_interval_s=s.CAPTURE_WATCH_MAX_INTERVAL_S)
        self.monitor.adopt(known)
        self.captures.adopt(known)
        self.ingest = IngestQueue(self.store, stats=self.stats, on_committed=self.monitor.observe,
                                  max_pending_records=config.max_pending_records)
        self.intake = OtlpIntake(self.decoder, self.ingest, self.stats)
        self.grpc = None
        self.http = None
        self.prometheus = None
        self.ui = None
        self.pusher = None
        self._started = False
        self._stopped = threading.Event()

    def _recent_runs(self) -> list[str]:
        """Runs of a reused database that were still receiving within the idle timeout.

        Only these are watched again after a restart (and ended by idle timeout if
        nothing more comes); older runs were summarised by the previous process.
        """
        import time

        from traceml.processor.sqlite_layout import connect_readonly
        from traceml.processor.store_read import read_run_activity

        now = time.time()
        recent = []
        conn = connect_readonly(self.config.db)
        try:
            for run in read_run_activity(conn):
                if now - run.last_receive_time >= self.config.idle_timeout_s:
                    continue
                if stored_run_is_over(conn, run.run_id):
                    continue  # every rank sent its end marker: that run is over
                recent.append(run.run_id)
        finally:
            conn.close()
        return recent

    def _ranks_held(self, run_id: str):
        """The ranks seen of `run_id` when this processor holds it (the capture book's question), else None."""
        state = self.monitor.state(run_id)
        return None if state is None else set(state.ranks)

    def _run_ended(self, run_id: str) -> bool:
        state = self.monitor.state(run_id)
        return state is not None and state.ended is not None

    def _forget_run(self, run_id: str) -> None:
        """A run the monitor forgot: its admission slot, its step counters and its captures (files
        included) are freed."""
        self.admission.forget(run_id)
        self.captures.forget_run(run_id)
        self.capture_policy.forget(run_id)
        forget = getattr(self.monitor.backend, "forget", None)
        if forget is not None:
            forget(run_id)

    def _record_culprits(self, run_id: str, culprits) -> None:
        """A summarised run's culprits into the store; the fleet series are read again."""
        self.store.record_culprits(run_id, culprits)
        self.fleet.invalidate()

    # --- points for /metrics and OTLP ---------------------------------------------------

    def points(self) -> list:
        points = self.monitor.points()
        points.extend(self.fleet.points())  # per culprit host: bounded by the fleet, not by runs
        # Requests and records by outcome (and refusal reason): every series, zeros included.
        points.extend(MetricPoint(key.metric, key.attributes(), float(count))
                      for key, count in self.stats.counts().items())
        # Lost summary pushes, on /metrics and downstream; always present (0 when not pushing).
        points.append(MetricPoint(v.METRIC_PROCESSOR_EXPORT_FAILURES, {},
                                  float(0 if self.pusher is None else self.pusher.failed)))
        return points

    def readiness(self) -> tuple[bool, str]:
        if not self._started or self._stopped.is_set():
            return False, "not serving"
        if not self.ingest._thread.is_alive():
            return False, "ingest writer stopped"
        from traceml.processor.sqlite_guard import database_fault

        fault = database_fault(self.config.db)
        if fault is not None:
            return False, f"database damaged ({fault}); restore it from a backup or start on a new file"
        if self.pool is not None and not self.pool.alive():
            return False, "an ingest worker stopped"
        return True, "ready"

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> "ProcessorService":
        from traceml.processor.receiver_grpc import GrpcReceiver
        from traceml.processor.receiver_http import HttpReceiver

        cfg = self.config
        self.ingest.start()
        self.monitor.start()
        if cfg.otlp_grpc is not None:
            warn_if_exposed("OTLP/gRPC", cfg.otlp_grpc[0], cfg.auth, cfg.tls)
            self.grpc = GrpcReceiver(self.intake, *cfg.otlp_grpc, auth=cfg.auth, tls=cfg.tls,
                                     workers=cfg.grpc_workers, max_concurrent_requests=cfg.max_concurrent_requests,
                                     reuse_port=self.pool is not None)
            self.grpc.start()
        if cfg.otlp_http is not None:
            warn_if_exposed("OTLP/HTTP", cfg.otlp_http[0], cfg.auth, cfg.tls)
            self.http = HttpReceiver(self.intake, *cfg.otlp_http, auth=cfg.auth, tls=cfg.tls,
                                     readiness=self.readiness, reuse_port=self.pool is not None,
                                     max_concurrent_requests=cfg.max_concurrent_requests, limits=cfg.http_limits)
            if self.pool is None:
                # The capture paths too: a rank's poll or upload must reach the process that holds the book.
                from traceml.processor.capture.routes import CaptureRoutes
                from traceml.schema.capture import CAPTURES_PATH, CONTROL_PATH

                routes = CaptureRoutes(self.captures, self.http.app)
                self.http.app.mount(CONTROL_PATH, routes)
                self.http.app.mount(CAPTURES_PATH, routes)
                # The web view rides on the OTLP/HTTP port too. Not with ingest workers: they share the
                # port, and a page landing on a worker would find no run sessions (use --ui there).
                from traceml.processor.web.server import front_route, web_app_for

                self.http.app.mount("/ui", front_route(web_app_for(self)))
            self.http.start()
        if self.pool is not None:
            # Workers bind the ports the main process resolved (port 0 becomes a real port first).
            self.pool.start(None if self.grpc is None else (self.grpc.host, self.grpc.port),
                            None if self.http is None else (self.http.host, self.http.port))
        if cfg.prometheus is not None:
            from traceml.processor.prometheus_exposition import PrometheusEndpoint

            warn_if_exposed("Prometheus /metrics", cfg.prometheus[0], cfg.auth, cfg.tls)
            self.prometheus = PrometheusEndpoint(*cfg.prometheus, collect=self.points, max_series=cfg.max_series,
                                                 auth=cfg.auth, tls=cfg.tls, limits=cfg.http_limits,
                                                 on_event=self.stats.connection_event)
            self.prometheus.start()
        if cfg.ui is not None:
            from traceml.processor.web.server import start_ui

            self.ui = start_ui(self, *cfg.ui)
        if cfg.export is not None:
            self.pusher = SummaryPusher(cfg.export, collect=self.points, max_series=cfg.max_series)
            self.pusher.start()
        self._started = True
        LOG.info("traceml-processor serving: grpc=%s http=%s prometheus=%s db=%s",
                 self.grpc_port, self.http_port, self.prometheus_port, cfg.db)
        return self

    @property
    def grpc_port(self) -> int | None:
        return self.grpc.port if self.grpc else None

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http else None

    @property
    def prometheus_port(self) -> int | None:
        return self.prometheus.port if self.prometheus else None

    @property
    def ui_port(self) -> int | None:
        return self.ui.port if self.ui else None

    def stop(self) -> None:
        """Stop accepting, commit what is queued, summarise open runs, push once, close."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.grpc is not None:
            self.grpc.stop(grace_s=2.0)
        if self.http is not None:
            self.http.stop()
        if self.pool is not None:
            self.pool.stop()
        self.ingest.stop()
        self.captures.stop()  # open captures fail, saying so, before the last summaries are written
        self.monitor.stop(summarise_open_runs=self.config.summary_dir is not None)
        if self.pusher is not None:
            self.pusher.stop(flush=True)
        if self.prometheus is not None:
            self.prometheus.stop()
        if self.ui is not None:
            self.ui.stop()
        self.store.close()
        self.db_lock.release()
        LOG.info("traceml-processor stopped")

    def __enter__(self) -> "ProcessorService":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
