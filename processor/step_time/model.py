"""Step Time shared data contracts: the lowest processor layer (standard library only).

Three core domain shapes flow through the processor:

    StepTimeRepositorySnapshot  normalised source facts (sqlite_reader.py)
      -> StepTimeWindow         canonical analysed facts (analysis.py)
      -> StepTimeAnalysis       window plus one diagnosis (pipeline.py)

Values are milliseconds on the window's selected clock unless a name says
otherwise. `None` means unavailable (never measured, or only partly present on
the aligned steps); a measured zero stays `0.0`.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from traceml.schema.diagnosis import Severity

CLOCK_CPU = "cpu"
CLOCK_GPU = "gpu"

FRESHNESS_COLD = "cold"
FRESHNESS_LIVE = "live"
FRESHNESS_BRIDGED = "bridged"
FRESHNESS_EXPIRED = "expired"
FRESHNESS_STATES = (FRESHNESS_COLD, FRESHNESS_LIVE, FRESHNESS_BRIDGED, FRESHNESS_EXPIRED)

# Window sizes, in common step ids. The read side (sqlite_reader.py) bounds what it loads by
# them and the analyzer (analysis.py) cuts the aligned window to them, so both take
# them from here.
LIVE_WINDOW_STEPS = 100
"""The live profile analyses the latest 100 common steps."""
SUMMARY_WINDOW_STEPS = 10_000
"""The summary profile analyses up to the latest 10,000 common steps."""
WINDOW_LOOKBACK = 4
"""Step ids read per window step: a rank that lags or skips steps still leaves a full common window."""
LIVE_TAIL_MAX_CELLS = 1_024 * LIVE_WINDOW_STEPS * WINDOW_LOOKBACK
"""Most (rank, step id) cells one run's live tail keeps (409,600): a run of up to 1,024 ranks
keeps all 400 step ids, a larger one fewer (see `tail_step_ids`; 16,384 ranks: 25, still over
the 20 steps a crit finding needs). It bounds the live cache and the window analysed from it:
6 runs of 16,384 ranks at the cap measured under 1 GiB (benchmarks/bench_load.py, docs/processor.md)."""
SUMMARY_MAX_CELLS = 1 << 24
"""Most (rank, step id) cells the summary selection reads (16,777,216 = 1,677 ranks x 10,000
steps): the summary of a run beyond it analyses fewer of the latest steps, by the same rule."""
MIN_TAIL_STEPS = 2
"""A tail is never cut below two step ids (fewer cannot make an aligned window worth a diagnosis);
only a run of more than `max_cells // 2` ranks goes over the cell cap, and then by this floor."""


def tail_step_ids(window: int, lookback: int, ranks: int, max_cells: int) -> int:
    """The step ids a selection keeps for a run of `ranks` ranks: the rule for large runs.

    `window x lookback` (the latest 400 step ids live), cut to `max_cells // ranks` so that
    ranks x step ids stays within the cap, and never below `MIN_TAIL_STEPS` (nor above
    `window x lookback`). A cut tail first loses lookback (lagging ranks have less room),
    then window steps: the window analysed is then shorter than `window`, and
    `StepTimeWindow.max_steps` says how many it could hold, so no surface claims steps
    that were not kept.
    """
    full = window * lookback
    if ranks <= 0:
        return full
    return min(full, max(max_cells // ranks, MIN_TAIL_STEPS))


# --- Ingest side: what receivers hand to storage --------------------------------------


@dataclass(frozen=True, slots=True)
class RankIdentity:
    """Who a rank is; every field but the global rank may be unknown."""

    global_rank: int
    local_rank: int | None = None
    node_rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None
    hostname: str | None = None


@dataclass(frozen=True, slots=True)
class RawEventValue:
    """One raw event's summed values for one step, as received (before normalisation)."""

    cpu_ms: float | None
    gpu_ms: float | None
    count: int | None


@dataclass(frozen=True, slots=True)
class StepTimeIngestRecord:
    """One `traceml.step` span decoded: exactly one `step_time_samples` row."""

    run_id: str
    identity: RankIdentity
    step: int
    start_time: float  # unix seconds, step start
    sample_time: float  # unix seconds, step end
    events: Mapping[str, RawEventValue]  # raw event name -> values
    training_strategy: str | None = None
    attempt: int = 0  # elastic restart attempt of the sending process (`traceml.run.attempt`)
    # The step span's OpenTelemetry ids (16 and 8 bytes), kept so a re-exported series can name
    # its worst step as an exemplar; None where the step came without a span id (foreign rows).
    trace_id: bytes | None = None
    span_id: bytes | None = None


@dataclass(frozen=True, slots=True)
class StepMemoryIngestRecord:
    """One step's peak memory of one rank's tracked device (bytes; None when unavailable)."""

    run_id: str
    global_rank: int
    step: int
    device: str
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    sample_time: float
    attempt: int = 0  # elastic restart attempt of the sending process (`traceml.run.attempt`)


@dataclass(frozen=True, slots=True)
class ResourceIngestRecord:
    """One resource value (`schema.resources.STORED_METRICS`, in the convention's unit) at one time.

    From a rank's sampler: `run_id` and `global_rank` set (None rank for nothing: every
    TraceML point names its rank; host-level metrics keep it to say who sent them). From
    a foreign sender (`hostmetrics`, DCGM): `run_id` and `global_rank` None, joined to runs
    by `host` (and `device`, or `pid` for a process's metrics) when read. `device`: a GPU's
    `hw.id` (NVML UUID), `index:N`, a rank's `cuda:N` for its allocator, else ''.
    """

    run_id: str | None
    global_rank: int | None
    host: str
    device: str
    metric: str
    sample_time: float  # unix seconds
    value: float
    source: str  # `schema.resources.SOURCES`
    pid: int | None = None
    attempt: int = 0


# --- Repository side -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClockPair:
    """One canonical metric on both clocks for one row; either may be missing."""

    cpu_ms: float | None
    gpu_ms: float | None


@dataclass(frozen=True, slots=True)
class StepTimeSourceRow:
    """One decoded source row with CPU/GPU clock pairs; no alignment or derived meaning.

    `values` holds only the canonical metrics the row carries.
    """

    row_id: int
    global_rank: int
    step: int
    sample_time: float | None
    values: Mapping[str, ClockPair]


@dataclass(frozen=True, slots=True)
class StepTimeSourceCursor:
    """The single stored latest-row/latest-step position used by live-session reuse."""

    latest_row_id: int
    latest_step: int | None


@dataclass(frozen=True, eq=False)
class StepTimeSourceGrid:
    """Columnar form of a selection: step slots x ranks, what the analyzer reads.

    Built by `sqlite_reader.py` (with numpy) so that no Python object is made per value;
    the fields are buffer-like arrays (numpy arrays in practice), indexed
    `[slot]`, `[slot][rank_index]` or `[slot][rank_index][k]`:

    - `steps[slot]`: the step id held by a slot, or -1 for an unused slot; slots
      need not be in step order (the live cache is a ring).
    - `present[slot][r]`: a row exists for (step, `ranks[r]`).
    - `values[slot][r][k]`: metric `metrics[k // 2]`, CPU clock for even k, GPU for
      odd k, in milliseconds; NaN = missing.
    - `row_ids`, `sample_times`: per cell (unused where not present).

    A live snapshot's grid aliases the live session's cache (`shared=True`) and is
    valid until the session's next refresh; the analyzer copies what the window keeps
    from a shared grid and may keep views of an unshared one.
    """

    metrics: tuple[str, ...]
    ranks: tuple[int, ...]
    steps: object
    present: object
    values: object
    row_ids: object
    sample_times: object
    shared: bool = False

    def rows(self) -> "GridRows":
        return GridRows(self)


class GridRows(Sequence[StepTimeSourceRow]):
    """`StepTimeSourceRow`s built on access from a grid (in step, then rank order)."""

    def __init__(self, grid: StepTimeSourceGrid):
        self._grid = grid
        self._cells: list[tuple[int, int]] | None = None

    def _index(self) -> list[tuple[int, int]]:
        if self._cells is None:
            g = self._grid
            order = sorted((int(g.steps[s]), s) for s in range(len(g.steps)) if int(g.steps[s]) >= 0)
            self._cells = [(s, r) for _, s in order for r in range(len(g.ranks)) if bool(g.present[s][r])]
        return self._cells

    def __len__(self) -> int:
        return len(self._index())

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        slot, r = self._index()[index]
        g = self._grid
        cell = g.values[slot][r]
        values = {}
        for k, metric in enumerate(g.metrics):
            cpu, gpu = float(cell[2 * k]), float(cell[2 * k + 1])
            cpu_v = None if cpu != cpu else cpu
            gpu_v = None if gpu != gpu else gpu
            if cpu_v is not None or gpu_v is not None:
                values[metric] = ClockPair(cpu_v, gpu_v)
        sample = float(g.sample_times[slot][r])
        return StepTimeSourceRow(
            row_id=int(g.row_ids[slot][r]), global_rank=g.ranks[r], step=int(g.steps[slot]),
            sample_time=None if sample != sample else sample, values=values)


@dataclass(frozen=True)
class StepTimeRepositorySnapshot:
    """Normalised source facts for one run, read in one SQLite snapshot.

    `rows` is the typed row view; `grid`, when the repository provides it, holds the
    same facts in columnar form so the analyzer never walks rows one by one.
    """

    run_id: str
    training_strategy: str
    ranks: Mapping[int, RankIdentity]  # the persisted rank universe
    cursor: StepTimeSourceCursor
    rows: Sequence[StepTimeSourceRow]
    rejected: Mapping[str, int] = field(default_factory=dict)  # decode reason -> count
    grid: StepTimeSourceGrid | None = None
    tail_steps: int | None = None  # step ids the selection kept (`tail_step_ids`); None: not bounded
    # Ranks whose every selected step with an input wait measured it as the time before forward
    # (no DataLoader seen; `input_wait_count` 0). Read by the live tail; () where not read.
    input_before_forward_ranks: tuple[int, ...] = ()


# --- Window side -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepTimeValues:
    """Optional phase, derived and CPU-reporting values for one step or one rank average."""

    input_wait: float | None = None
    h2d: float | None = None
    forward: float | None = None
    backward: float | None = None
    optimizer_step: float | None = None
    traced_step_time: float | None = None
    compute: float | None = None
    residual: float | None = None
    step_time: float | None = None
    # Explicit-clock aggregates kept whatever the selected clock is.
    step_time_cpu: float | None = None
    step_time_gpu: float | None = None
    traced_step_time_cpu: float | None = None
    traced_step_time_gpu: float | None = None
    dataloader_fetch_cpu: float | None = None
    # Measured time inside torch.distributed collectives (occurrence-driven): a sub-interval
    # of the phase or residual that contains it, never added to Step Time.
    collective_wait: float | None = None

    def get(self, metric: str) -> float | None:
        return getattr(self, metric)


@dataclass(frozen=True, slots=True)
class StepTimeStepFacts:
    """One aligned step id and its typed values."""

    step: int
    values: StepTimeValues


@dataclass(frozen=True)
class StepTimeRankFacts:
    """Typed aligned steps of one rank and the corresponding rank-window average."""

    rank: int
    identity: RankIdentity
    average: StepTimeValues
    steps: Sequence[StepTimeStepFacts]


@dataclass(frozen=True, slots=True)
class StepTimeMetric:
    """Flat per-signal series and rank statistics; clock and coverage live on the window.

    Statistics use only the ranks that measured the metric. `worst`/`worst_rank`
    describe the same rank; `representative_rank` is the real rank nearest the
    mathematical median (then lower value, then lower rank).
    """

    name: str
    series: Sequence[float | None]  # per aligned step: median over measured ranks (may be built on first access)
    rank_values: Mapping[int, float]  # rank -> window average, measured ranks only
    median: float | None
    average: float | None
    worst: float | None
    worst_rank: int | None
    skew: float | None  # (worst - median) / median; None with < 2 measured ranks
    representative_rank: int | None
    representative_value: float | None


@dataclass(frozen=True)
class StepTimeWindow:
    """Canonical analysed facts for the common step window of one run."""

    run_id: str
    clock: str | None  # CLOCK_CPU / CLOCK_GPU; None when the window is empty
    steps: tuple[int, ...]  # aligned step ids, ascending
    expected_ranks: tuple[int, ...]  # the rank universe, kept even when a rank lacks a metric
    rank_facts: Mapping[int, StepTimeRankFacts]
    metrics: Mapping[str, StepTimeMetric]  # canonical + derived metric name -> statistics
    coverage: Mapping[str, tuple[int, int]]  # metric -> (measured ranks, expected ranks)
    shares: Mapping[str, float | None]  # metric -> median(metric) / median(step_time)
    training_strategy: str
    # The most aligned steps this window could hold: the profile's window, cut to the step ids
    # the selection kept for a run beyond the cell cap (`tail_step_ids`); None: not known.
    max_steps: int | None = None
    # Per aligned step: the median over ranks of its end (unix seconds; NaN where no rank said),
    # so samples taken on the wall clock (resource metrics) can be placed on steps.
    step_end_times: tuple[float, ...] = field(default=(), compare=False)

    @property
    def step_count(self) -> int:
        return len(self.steps)

    @property
    def is_empty(self) -> bool:
        return not self.steps


@dataclass(frozen=True, slots=True)
class DiagnosisIssue:
    """One finding. `evidence` holds rule-specific, JSON-safe facts (documented in DIAGNOSIS.md)."""

    kind: str
    severity: Severity
    status: str
    score: float | None
    summary: str
    culprit_rank: int | None = None
    victim_rank: int | None = None
    component: str | None = None
    evidence: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class StepTimeDiagnosis:
    """Ordered issues; `primary` is `issues[0]` (BALANCED/WARMUP/INCOMPLETE_DATA when nothing fires)."""

    issues: tuple[DiagnosisIssue, ...]

    @property
    def primary(self) -> DiagnosisIssue:
        return self.issues[0]


@dataclass(frozen=True)
class StepTimeAnalysis:
    """The window plus one diagnosis: what every surface reads.

    `resources`: the run's process, host and GPU figures over the same window
    (`processor.resources.model.ResourceWindow`), which the diagnosis also read; None
    when the analysis was made without them (a bare snapshot)."""

    window: StepTimeWindow
    diagnosis: StepTimeDiagnosis
    cursor: StepTimeSourceCursor | None = None
    resources: object = None  # ResourceWindow | None (defined above this layer's stdlib model)
    # The snapshot's ranks whose input wait was measured as the time before forward: the live
    # view says so as the card does (the final summary reads it over the whole run instead).
    input_before_forward_ranks: tuple[int, ...] = ()
    # The badput ledger over the same window (`processor.diagnosis.ledger.WindowLedger`): rank-time
    # lost per cause and each finding's what-if; None when the analysis was made without it.
    ledger: object = None


@dataclass(frozen=True)
class LiveStepTimeResult:
    """Freshness added to an existing analysis, without copying its timing facts."""

    analysis: StepTimeAnalysis
    freshness: str
    age_s: float | None  # seconds since the analysis was last good (monotonic)
    error: str | None = None


def finite_ratio(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, or None when the denominator is not positive or the
    ratio is not finite (a denormal step time overflows it). One rule for every share,
    skew and score the analysis and the diagnosis rules derive."""
    if not denominator > 0:
        return None
    ratio = numerator / denominator
    return ratio if math.isfinite(ratio) else None
