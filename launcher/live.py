"""The live Step Time view for `traceml run --live` and `traceml top`.

One `LiveStepTimeSession` per view, refreshed on a background thread; every
frame is drawn by the pure presenter from the `LiveStepTimeResult` it returns
plus the progress this module measures (latest step and steps per second over
wall-clock time, which the session does not know) and the run's status from the
store (`ended` once every rank's end marker is stored, else how long ago the last
step ended). On a terminal the frame
is a Rich `Live` display; otherwise one plain line per refresh in which the
step or the diagnosis changed, so logs stay short. Strings from the wire are
made printable by the presenter (`presenters.terminal_text`); an error message,
which may quote them, is too.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from traceml.processor.api import LiveStepTimeResult


@dataclass(frozen=True, slots=True)
class Progress:
    """How far the run got: the latest stored step and the rate it advanced at."""

    latest_step: int | None
    steps_per_s: float | None


class ProgressMeter:
    """Steps per second from successive (latest step, monotonic time) observations."""

    def __init__(self, horizon_s: float = 10.0) -> None:
        self._horizon_s = horizon_s
        self._points: list[tuple[float, int]] = []

    def observe(self, latest_step: int | None, now: float | None = None) -> Progress:
        now = time.monotonic() if now is None else now
        if latest_step is None:
            return Progress(None, None)
        if not self._points or self._points[-1][1] != latest_step:
            self._points.append((now, latest_step))
        while len(self._points) > 2 and now - self._points[0][0] > self._horizon_s:
            self._points.pop(0)
        rate = None
        if len(self._points) >= 2:
            (t0, s0), (_, s1) = self._points[0], self._points[-1]
            # Up to now, not to the last new step: a stall makes the rate decay.
            if now > t0 and s1 >= s0:
                rate = (s1 - s0) / (now - t0)
        return Progress(latest_step, rate)


@dataclass(frozen=True, slots=True)
class RunStatus:
    """What the store says of the run beyond the window: over, and when its last step ended."""

    ended: bool
    last_step_time: float | None  # wall clock (the newest stored step's end)

    def last_step_age(self, now: float | None = None) -> str | None:
        if self.last_step_time is None:
            return None
        return format_age(max(0.0, (time.time() if now is None else now) - self.last_step_time))

    def label(self, now: float | None = None) -> str | None:
        """`ended`, or `last step 12.3s ago`; None when nothing is known yet."""
        if self.ended:
            return "ended"
        age = self.last_step_age(now)
        return None if age is None else f"last step {age} ago"


def format_age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m {int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h {int(seconds % 3600 // 60):02d}m"


def read_run_status(db_path: Path, run_id: str) -> RunStatus:
    """The run is over when every rank of it sent its end marker (`runs.run_is_over`, the
    processor's own rule); the last step time is the store's. Unknown (not ended) on any error."""
    from traceml.processor.api import run_is_over
    from traceml.processor.api import StoreReadError, read_run_progress

    try:
        progress = read_run_progress(db_path, run_id)
    except StoreReadError:
        return RunStatus(False, None)
    ends = progress.ends
    return RunStatus(run_is_over(ends.ranks, ends.world_size, ends.finished), progress.last_sample_time)


def latest_step_of(result: LiveStepTimeResult) -> int | None:
    analysis = result.analysis
    if analysis.cursor is not None and analysis.cursor.latest_step is not None:
        return analysis.cursor.latest_step
    steps = analysis.window.steps
    return steps[-1] if steps else None


def plain_line(result: LiveStepTimeResult, progress: Progress, status: RunStatus | None = None) -> str:
    """One log line: the presenter's line, prefixed with the progress."""
    from traceml.processor.api import format_live_line

    step = "" if progress.latest_step is None else f" step {progress.latest_step}"
    return f"[traceml]{step} " + format_live_line(
        result, steps_per_s=progress.steps_per_s, ended=status is not None and status.ended,
        last_step_age=None if status is None else status.last_step_age())


def render_frame(result: LiveStepTimeResult, progress: Progress, title: str, status: RunStatus | None = None):
    """The Rich renderable for one frame (the presenter draws; we only pass data)."""
    from traceml.processor.api import render_live

    if progress.latest_step is not None:
        title = f"{title} · step {progress.latest_step}"
    return render_live(result, steps_per_s=None if status is not None and status.ended else progress.steps_per_s,
                       title=title, run_state=None if status is None else status.label())


class LiveMonitor:
    """Refreshes one session every `refresh_s` seconds until `stop()`; one final frame after."""

    def __init__(self, db_path: Path, run_id: str | None, *, refresh_s: float = 1.0,
                 out: TextIO | None = None, tty: bool | None = None, title: str | None = None) -> None:
        self.db_path = Path(db_path)
        self.run_id = run_id
        self.refresh_s = refresh_s
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.title = title or f"TraceML · {run_id or 'latest run'}"
        self.last_result: LiveStepTimeResult | None = None
        self.last_line: str | None = None
        self.last_status: RunStatus | None = None
        self.frames = 0
        self._session = None
        self._meter = ProgressMeter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live = None
        self._last_plain_key: tuple | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self.tty:
            from rich.console import Console
            from rich.live import Live
            from rich.text import Text

            console = Console(file=self.out)
            # Redrawn only when a refresh produced a frame (no idle 4 Hz redraws on busy cores).
            self._live = Live(Text("[traceml] waiting for the first steps ..."), console=console,
                              auto_refresh=False, transient=False, redirect_stdout=False,
                              redirect_stderr=False)
            self._live.start()
        self._thread = threading.Thread(target=self._loop, name="traceml-live", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 3 * self.refresh_s))
            self._thread = None
        if self._live is not None:
            self._live.stop()
            self._live = None

    def run_forever(self) -> None:
        """Foreground mode for `traceml top`: refresh until interrupted."""
        self.start()
        try:
            while self._thread is not None and self._thread.is_alive():
                self._thread.join(timeout=0.5)
        finally:
            self.stop()

    # --- one refresh -------------------------------------------------------------------

    def refresh_once(self) -> LiveStepTimeResult | None:
        session = self._ensure_session()
        if session is None:
            return None
        result = session.refresh()
        self.last_result = result
        progress = self._meter.observe(latest_step_of(result))
        self.last_status = read_run_status(self.db_path, self.run_id)
        self._show(result, progress, self.last_status)
        return result

    def _loop(self) -> None:
        while True:
            try:
                self.refresh_once()
            except Exception as exc:  # a broken frame must not end the view or the run
                self._show_error(exc)
            if self._stop.wait(self.refresh_s):
                break
        try:
            self.refresh_once()  # the final state, after the ranks finished
        except Exception as exc:
            self._show_error(exc)

    def _ensure_session(self):
        if self._session is not None:
            return self._session
        if not self.db_path.exists():
            return None
        run_id = self.run_id
        if run_id is None:
            from traceml.launcher.stored_runs import RunLookupError, choose_run

            try:
                run_id = choose_run(self.db_path, None)
            except RunLookupError:
                return None
            self.run_id = run_id
        from traceml.processor.api import LiveStepTimeSession

        self._session = LiveStepTimeSession(self.db_path, run_id)
        return self._session

    def _show(self, result: LiveStepTimeResult, progress: Progress, status: RunStatus | None = None) -> None:
        self.frames += 1
        if self._live is not None:
            self._live.update(render_frame(result, progress, self.title, status), refresh=True)
            return
        if self.tty:  # one frame without a running Live display (`traceml top --once`)
            from rich.console import Console

            Console(file=self.out).print(render_frame(result, progress, self.title, status))
            return
        primary = result.analysis.diagnosis.primary
        key = (progress.latest_step, primary.kind, primary.severity, primary.culprit_rank, result.freshness,
               status is not None and status.ended)
        if key == self._last_plain_key:
            return
        self._last_plain_key = key
        self.last_line = plain_line(result, progress, status)
        print(self.last_line, file=self.out, flush=True)

    def _show_error(self, exc: Exception) -> None:
        from traceml.processor.api import printable

        message = printable(f"[traceml] live view: {type(exc).__name__}: {exc}")
        if self._live is not None:
            from rich.text import Text

            self._live.update(Text(message), refresh=True)
        elif message != self.last_line:
            self.last_line = message
            print(message, file=self.out, flush=True)
