"""SQLite selection and row decoding: the read side of the Step Time store.

Two selection profiles, both returning `StepTimeRepositorySnapshot` with a columnar
`StepTimeSourceGrid` (no JSON is parsed; values come from the `packed` BLOB the
writer stores beside the typed columns, one `numpy.frombuffer` per selection):

- live tail (`LiveTail`): index-bounded to the latest `window x lookback` step ids
  (slots allocated as step ids arrive);
  per refresh one read transaction with two statements: the run header (strategy,
  rank-universe version, cursor = latest row id / latest step), then the rows.
  The tail is kept as an incremental ring cache, so after the first read only rows
  with an id above the previous cursor are fetched (a replaced row gets a new id,
  so it is seen). The rank universe is read by a third statement only when its
  version moved. Each live row also carries how its input wait was measured, so the
  snapshot names the ranks whose input wait is the time before forward without
  another statement.
- summary (`load_summary_snapshot`): metadata-complete: the whole rank universe with
  identities and every row within the latest `max_steps x lookback` step ids.

Both selections keep `tail_step_ids(...)` step ids (model.py): `window x lookback`,
fewer for a run whose ranks x step ids would pass the profile's cell cap
(`LIVE_TAIL_MAX_CELLS`, `SUMMARY_MAX_CELLS`); the snapshot's `tail_steps` says how
many, and the analysis cuts the window to it (`StepTimeWindow.max_steps`).

Decoding: a `packed` BLOB of the layout before user_version 3 (no collective wait) is
widened with that metric missing; a row whose `packed` BLOB is missing or malformed is skipped
(`unreadable_values`); a negative (`negative_value`), infinite (`non_finite_value`)
or absurd (`absurd_value`, over the decoder's one-day cap) value is dropped to
missing. Our writer stores only values the decoder accepted, so these checks are
for rows some other tool wrote into the file. Counts land in `snapshot.rejected`.
Runs never mix: every statement filters on run id. The table layout and the
`packed` format are `sqlite_layout`'s; connections are its `connect_readonly`.
"""
from __future__ import annotations

import logging
import sqlite3
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from traceml.processor.step_time.model import (
    LIVE_TAIL_MAX_CELLS,
    LIVE_WINDOW_STEPS,
    SUMMARY_MAX_CELLS,
    SUMMARY_WINDOW_STEPS,
    WINDOW_LOOKBACK,
    RankIdentity,
    StepTimeRepositorySnapshot,
    StepTimeSourceCursor,
    StepTimeSourceGrid,
    tail_step_ids,
)
from traceml.processor.store_records import ABSURD, MAX_EVENT_MS, NEGATIVE, NON_FINITE
from traceml.processor.sqlite_guard import note_database_error
from traceml.processor.sqlite_layout import (
    LEGACY_PACKED_FIELDS,
    PACKED_FIELDS,
    PACKED_METRICS,
    PACKED_RANK,
    PACKED_SAMPLE_TIME,
    PACKED_STEP,
    PACKED_VALUES,
    connect_readonly,
)
from traceml.schema.vocabulary import STRATEGY_DDP, STRATEGY_SINGLE

LOG = logging.getLogger(__name__)

REASON_UNREADABLE = "unreadable_values"
REASON_NEGATIVE, REASON_NON_FINITE, REASON_ABSURD = NEGATIVE, NON_FINITE, ABSURD  # decode's names

_ROW_COLUMNS = "id, packed"  # rank and step travel inside `packed`: two objects per row
# The live tail adds how the row's input wait was measured, one small int per row (`packed`
# holds no counts), kept as -1 none measured, 0 the time before forward (`input_wait_count` 0: a step
# inferred from an optimizer update with no DataLoader `next()` timed, store_read's
# `read_input_before_forward_ranks` reads the same marker over the whole run), 1 timed fetches.
_LIVE_ROW_COLUMNS = f"{_ROW_COLUMNS}, coalesce(input_wait_count, -1)"
_N_VALUES = PACKED_VALUES
_PACKED_BYTES = 8 * PACKED_FIELDS
_LEGACY_PACKED_BYTES = 8 * LEGACY_PACKED_FIELDS
_LEGACY_PAD = np.full(PACKED_FIELDS - LEGACY_PACKED_FIELDS, np.nan, dtype="<f8").tobytes()

_HEADER_SQL = """
SELECT (SELECT training_strategy FROM step_time_runs WHERE run_id = ?1),
       (SELECT ranks_version FROM step_time_runs WHERE run_id = ?1),
       (SELECT max(id) FROM step_time_samples WHERE run_id = ?1),
       (SELECT max(step) FROM step_time_samples WHERE run_id = ?1)
"""
_RANKS_SQL = (
    "SELECT global_rank, local_rank, node_rank, world_size, local_world_size, hostname"
    " FROM step_time_ranks WHERE run_id = ? ORDER BY global_rank"
)
# Range on (run_id, step): the index-bounded tail.
_TAIL_SQL = (
    f"SELECT {_ROW_COLUMNS} FROM step_time_samples INDEXED BY step_time_samples_run_step"
    " WHERE run_id = ? AND step > ?"
)
_LIVE_TAIL_SQL = (
    f"SELECT {_LIVE_ROW_COLUMNS} FROM step_time_samples INDEXED BY step_time_samples_run_step"
    " WHERE run_id = ? AND step > ?"
)
# Range on (run_id, rowid): only what is new since the cursor; `+step` keeps the
# planner on the rowid range instead of the step range.
_NEW_ROWS_SQL = (
    f"SELECT {_LIVE_ROW_COLUMNS} FROM step_time_samples INDEXED BY step_time_samples_run"
    " WHERE run_id = ? AND id > ? AND +step > ? ORDER BY id"
)


@dataclass(frozen=True)
class RunHeader:
    """Statement one of a read: what decides whether anything changed."""

    run_id: str
    stored_strategy: str | None
    ranks_version: int
    cursor: StepTimeSourceCursor

    @property
    def reuse_key(self) -> tuple:
        return (self.cursor, self.ranks_version, self.stored_strategy)


def connect_reader(path: str | Path) -> sqlite3.Connection:
    """A short-lived reader connection (the one seam tests wrap to trace statements)."""
    return connect_readonly(path)


def read_header(conn: sqlite3.Connection, run_id: str) -> RunHeader:
    strategy, version, max_id, max_step = conn.execute(_HEADER_SQL, (run_id,)).fetchone()
    return RunHeader(run_id, strategy, int(version or 0),
                     StepTimeSourceCursor(int(max_id or 0), None if max_step is None else int(max_step)))


def read_rank_universe(conn: sqlite3.Connection, run_id: str) -> dict[int, RankIdentity]:
    return {row[0]: RankIdentity(*row) for row in conn.execute(_RANKS_SQL, (run_id,))}


def resolve_strategy(stored: str | None, rank_count: int) -> str:
    """The run's strategy; unset -> `ddp` with more than one rank, else `single`."""
    if stored:
        return stored.strip().lower()
    return STRATEGY_DDP if rank_count > 1 else STRATEGY_SINGLE


@dataclass
class DecodedRows:
    """One selection as columns: row ids, ranks, steps, values (n x 2M), sample times, and for
    the live tail's rows each row's input-wait marker (`_LIVE_ROW_COLUMNS`; None when not read)."""

    ids: np.ndarray
    ranks: np.ndarray
    steps: np.ndarray
    values: np.ndarray
    sample_times: np.ndarray
    input_marks: np.ndarray | None = None


def _widen_legacy(blob: bytes) -> bytes:
    """A row written before user_version 3 (no collective wait) in the current layout: its
    metric values, the appended metrics missing (NaN), then sample time, rank and step."""
    if len(blob) != _LEGACY_PACKED_BYTES:
        return blob
    split = 8 * (LEGACY_PACKED_FIELDS - 3)
    return blob[:split] + _LEGACY_PAD + blob[split:]


def decode_rows(rows: list[tuple], rejected: Counter) -> DecodedRows:
    """(id, packed) tuples -> columns; bad rows/values counted in `rejected`."""
    n = len(rows)
    ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=n)
    marks = (np.fromiter((r[2] for r in rows), dtype=np.int64, count=n).clip(-1, 1).astype(np.int8)
             if n and len(rows[0]) > 2 else None)
    blobs = [r[1] for r in rows]
    try:
        joined = b"".join(blobs)
    except TypeError:  # a NULL or non-BLOB packed column
        joined = b""
    if len(joined) != n * _PACKED_BYTES:
        keep = np.fromiter((isinstance(b, bytes) and len(b) in (_PACKED_BYTES, _LEGACY_PACKED_BYTES)
                            for b in blobs), dtype=bool, count=n)
        rejected[REASON_UNREADABLE] += int(n - keep.sum())
        ids = ids[keep]
        marks = None if marks is None else marks[keep]
        joined = b"".join(_widen_legacy(b) for b, k in zip(blobs, keep) if k)
    packed = np.frombuffer(joined, dtype="<f8").reshape(-1, PACKED_FIELDS)
    identity = packed[:, (PACKED_RANK, PACKED_STEP)]
    good = np.isfinite(identity).all(axis=1) & (identity >= 0).all(axis=1)
    if not good.all():
        rejected[REASON_UNREADABLE] += int((~good).sum())
        packed, ids, identity = packed[good], ids[good], identity[good]
        marks = None if marks is None else marks[good]
    values = packed[:, :_N_VALUES].copy()
    sample_times = packed[:, PACKED_SAMPLE_TIME].copy()
    ranks = identity[:, 0].astype(np.int64)
    steps = identity[:, 1].astype(np.int64)
    with np.errstate(invalid="ignore"):
        negative = values < 0
        infinite = np.isinf(values)
        absurd = (values > MAX_EVENT_MS) & ~infinite
    bad = negative | infinite | absurd
    if bad.any():
        for reason, mask in ((REASON_NEGATIVE, negative & ~infinite),
                             (REASON_NON_FINITE, infinite), (REASON_ABSURD, absurd)):
            count = int(mask.sum())
            if count:
                rejected[reason] += count
        values[bad] = np.nan
    return DecodedRows(ids, ranks, steps, values, sample_times, marks)


def _log_rejections(run_id: str, rejected: Counter) -> None:
    if rejected:
        LOG.warning("step time read of run %s skipped or dropped: %s", run_id, dict(rejected))


# --- summary profile ---------------------------------------------------------------


def _compact_steps(steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct step ids (ascending) and each row's index into them, in O(n + span)."""
    if steps.size == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    low = int(steps.min())
    offsets = steps - low
    seen = np.zeros(int(offsets.max()) + 1, dtype=bool)
    seen[offsets] = True
    position = np.cumsum(seen) - 1
    return np.flatnonzero(seen).astype(np.int64) + low, position[offsets]



def load_summary_snapshot(path: str | Path, run_id: str, max_steps: int = SUMMARY_WINDOW_STEPS,
                          lookback: int = WINDOW_LOOKBACK,
                          max_cells: int = SUMMARY_MAX_CELLS) -> StepTimeRepositorySnapshot:
    """Metadata-complete selection: every rank with identity, rows of the latest steps
    (`tail_step_ids` of them: `max_steps x lookback`, fewer for a run beyond `max_cells`)."""
    conn = connect_reader(path)
    try:
        conn.execute("BEGIN")
        header = read_header(conn, run_id)
        identities = read_rank_universe(conn, run_id)
        rows: list[tuple] = []
        span = tail_step_ids(max_steps, lookback, len(identities), max_cells)
        if header.cursor.latest_step is not None:
            rows = conn.execute(_TAIL_SQL, (run_id, header.cursor.latest_step - span)).fetchall()
        conn.execute("COMMIT")
    except sqlite3.DatabaseError as exc:
        note_database_error(path, exc)  # a damaged page: /readyz and the log say so
        raise
    finally:
        conn.close()
    rejected: Counter = Counter()
    decoded = decode_rows(rows, rejected)
    del rows
    _log_rejections(run_id, rejected)
    for rank in np.unique(decoded.ranks).tolist():
        identities.setdefault(rank, RankIdentity(rank))
    universe = tuple(sorted(identities))
    if len(universe) > 0 and tail_step_ids(max_steps, lookback, len(universe), max_cells) < span:
        span = tail_step_ids(max_steps, lookback, len(universe), max_cells)  # rows named more ranks
        decoded = _select(decoded, decoded.steps > header.cursor.latest_step - span)
    if span < max_steps * lookback:
        LOG.info("run %s: %d ranks, so the summary reads the latest %d step ids, not %d (cell cap %d)",
                 run_id, len(universe), span, max_steps * lookback, max_cells)
    step_ids, step_index = _compact_steps(decoded.steps)
    rank_index = np.searchsorted(np.asarray(universe, dtype=np.int64), decoded.ranks)
    shape = (len(step_ids), len(universe))
    # One row per (rank, step) cell: the table's UNIQUE (run_id, global_rank, step).
    values = np.full(shape + (_N_VALUES,), np.nan)
    present = np.zeros(shape, dtype=bool)
    row_ids = np.zeros(shape, dtype=np.int64)
    sample_times = np.full(shape, np.nan)
    values[step_index, rank_index] = decoded.values
    present[step_index, rank_index] = True
    row_ids[step_index, rank_index] = decoded.ids
    sample_times[step_index, rank_index] = decoded.sample_times
    grid = StepTimeSourceGrid(metrics=PACKED_METRICS, ranks=universe, steps=step_ids,
                              present=present, values=values, row_ids=row_ids,
                              sample_times=sample_times)
    return StepTimeRepositorySnapshot(
        run_id=run_id, training_strategy=resolve_strategy(header.stored_strategy, len(universe)),
        ranks={r: identities[r] for r in universe}, cursor=header.cursor, rows=grid.rows(),
        rejected=dict(rejected), grid=grid, tail_steps=span)


# --- live profile ---------------------------------------------------------------------


@dataclass(frozen=True)
class LiveRead:
    """One live read: `snapshot` is None when the header said nothing changed."""

    header: RunHeader
    snapshot: StepTimeRepositorySnapshot | None

    @property
    def unchanged(self) -> bool:
        return self.snapshot is None


class LiveTail:
    """Incremental columnar cache of one run's live tail (not thread-safe: the live
    session serialises refreshes with its lock).

    The tail is the latest `capacity` step ids (`tail_step_ids`: `window x lookback`,
    cut for a run beyond `max_cells`) by the rank universe; a refresh merges only the
    rows newer than the cached cursor. Slots are allocated as step ids arrive (a run
    of 20 steps holds 20 slots, not 400) and reused once their step falls out of the
    tail, so the cache never holds more than `capacity x ranks` cells.
    """

    def __init__(self, run_id: str, window: int = LIVE_WINDOW_STEPS,
                 lookback: int = WINDOW_LOOKBACK, max_cells: int = LIVE_TAIL_MAX_CELLS):
        if window < 1 or lookback < 1 or max_cells < 1:
            raise ValueError("window, lookback and max_cells must be >= 1")
        self.run_id = run_id
        self.window = window
        self.lookback = lookback
        self.max_cells = max_cells
        self.capacity = window * lookback  # step ids kept; set again from the rank count on a full read
        self._header: RunHeader | None = None
        self._identities: dict[int, RankIdentity] = {}
        self._ranks: tuple[int, ...] = ()
        self._rank_array = np.empty(0, dtype=np.int64)
        self._rejected: Counter = Counter()
        self._allocate(0)

    def _allocate(self, n_ranks: int) -> None:
        self._slot_of: dict[int, int] = {}  # step id -> slot
        self._slot_step = np.full(0, -1, dtype=np.int64)
        self._present = np.zeros((0, n_ranks), dtype=bool)
        self._values = np.full((0, n_ranks, _N_VALUES), np.nan)
        self._row_ids = np.zeros((0, n_ranks), dtype=np.int64)
        self._sample_times = np.full((0, n_ranks), np.nan)
        self._input_marks = np.full((0, n_ranks), -1, dtype=np.int8)

    @property
    def slots(self) -> int:
        """Slots allocated now (at most `capacity`)."""
        return int(self._slot_step.size)

    def _grow(self, needed: int) -> None:
        """At least `needed` slots, and a quarter more than now once some exist (so a run adding
        one step per refresh copies its cache every n/4 steps, not every step); never above capacity."""
        n = self.slots
        target = min(self.capacity, max(needed, n + n // 4))
        extra = target - n
        n_ranks = len(self._ranks)
        self._slot_step = np.concatenate([self._slot_step, np.full(extra, -1, dtype=np.int64)])
        self._present = np.concatenate([self._present, np.zeros((extra, n_ranks), dtype=bool)])
        self._values = np.concatenate([self._values, np.full((extra, n_ranks, _N_VALUES), np.nan)])
        self._row_ids = np.concatenate([self._row_ids, np.zeros((extra, n_ranks), dtype=np.int64)])
        self._sample_times = np.concatenate([self._sample_times, np.full((extra, n_ranks), np.nan)])
        self._input_marks = np.concatenate([self._input_marks, np.full((extra, n_ranks), -1, dtype=np.int8)])

    def reset(self) -> None:
        """Forget the cache: the next read is a full tail read."""
        self._header = None

    def _capacity_for(self, n_ranks: int) -> int:
        return tail_step_ids(self.window, self.lookback, n_ranks, self.max_cells)

    def read(self, path: str | Path) -> LiveRead:
        """Read what changed since the previous read, in one snapshot; raises on SQLite errors."""
        conn = connect_reader(path)
        try:
            conn.execute("BEGIN")
            header = read_header(conn, self.run_id)
            previous = self._header
            if previous is not None and previous.reuse_key == header.reuse_key:
                conn.execute("COMMIT")
                return LiveRead(header, None)
            if previous is None or previous.ranks_version != header.ranks_version:
                identities = read_rank_universe(conn, self.run_id)
            else:
                identities = self._identities
            full = (previous is None
                    or previous.ranks_version != header.ranks_version  # e.g. an elastic restart's new attempt
                    or header.cursor.latest_row_id < previous.cursor.latest_row_id
                    or tuple(sorted(identities)) != self._ranks)
            latest = header.cursor.latest_step
            capacity = self._capacity_for(len(identities)) if full else self.capacity
            lower = -1 if latest is None else latest - capacity
            if latest is None:
                rows = []
            elif full:
                rows = conn.execute(_LIVE_TAIL_SQL, (self.run_id, lower)).fetchall()
            else:
                rows = conn.execute(
                    _NEW_ROWS_SQL, (self.run_id, previous.cursor.latest_row_id, lower)).fetchall()
            rejected: Counter = Counter()
            decoded = decode_rows(rows, rejected)
            del rows
            if not full and decoded.ranks.size and not np.isin(decoded.ranks, self._rank_array).all():
                full = True  # rows of a rank outside the stored universe
                rejected = Counter()
                decoded = decode_rows(conn.execute(_LIVE_TAIL_SQL, (self.run_id, lower)).fetchall(),
                                      rejected)
            conn.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            note_database_error(path, exc)  # a damaged page: /readyz and the log say so
            raise
        finally:
            conn.close()

        _log_rejections(self.run_id, rejected)
        self._rejected.update(rejected)
        if full:
            self._rejected = Counter(rejected)
            ranks = set(identities) | set(np.unique(decoded.ranks).tolist())
            identities = {r: identities.get(r) or RankIdentity(r) for r in sorted(ranks)}
            self._ranks = tuple(sorted(identities))
            self._rank_array = np.asarray(self._ranks, dtype=np.int64)
            self._allocate(len(self._ranks))
            self.capacity = self._capacity_for(len(self._ranks))  # rows may name ranks outside the universe
            if latest is not None and latest - self.capacity > lower:
                lower = latest - self.capacity
                decoded = _select(decoded, decoded.steps > lower)
            if self.capacity < self.window * self.lookback:
                LOG.info("run %s: %d ranks, so the live tail keeps the latest %d step ids, not %d"
                         " (cell cap %d)", self.run_id, len(self._ranks), self.capacity,
                         self.window * self.lookback, self.max_cells)
        self._identities = identities
        self._evict(lower)
        self._merge(decoded)
        self._header = header

        grid = StepTimeSourceGrid(metrics=PACKED_METRICS, ranks=self._ranks, steps=self._slot_step.copy(),
                                  present=self._present, values=self._values,
                                  row_ids=self._row_ids, sample_times=self._sample_times,
                                  shared=True)
        snapshot = StepTimeRepositorySnapshot(
            run_id=self.run_id,
            training_strategy=resolve_strategy(header.stored_strategy, len(self._ranks)),
            ranks=dict(self._identities), cursor=header.cursor, rows=grid.rows(),
            rejected=dict(self._rejected), grid=grid, tail_steps=self.capacity,
            input_before_forward_ranks=self.input_before_forward_ranks())
        return LiveRead(header, snapshot)

    def _evict(self, lower: int) -> None:
        """Free the slots whose step fell out of the tail (step <= lower)."""
        stale = np.flatnonzero((self._slot_step >= 0) & (self._slot_step <= lower))
        for slot in stale.tolist():
            del self._slot_of[int(self._slot_step[slot])]
        self._slot_step[stale] = -1
        self._input_marks[stale] = -1  # only cells in the tail hold a marker

    def _merge(self, rows: DecodedRows) -> None:
        if rows.ids.size == 0:
            return
        step_ids, inverse = np.unique(rows.steps, return_inverse=True)
        slot_of = self._slot_of
        new_steps = [step for step in step_ids.tolist() if step not in slot_of]
        if new_steps:
            free = np.flatnonzero(self._slot_step < 0)
            if free.size < len(new_steps):
                self._grow(self.slots + len(new_steps) - free.size)
                free = np.flatnonzero(self._slot_step < 0)
            reset = free[:len(new_steps)]
            self._present[reset] = False
            self._values[reset] = np.nan
            self._input_marks[reset] = -1
            self._slot_step[reset] = new_steps
            slot_of.update(zip(new_steps, reset.tolist()))
        slots = np.fromiter((slot_of[step] for step in step_ids.tolist()), dtype=np.int64,
                            count=step_ids.size)[inverse]
        cols = np.searchsorted(self._rank_array, rows.ranks)
        self._present[slots, cols] = True
        self._values[slots, cols] = rows.values
        self._row_ids[slots, cols] = rows.ids
        self._sample_times[slots, cols] = rows.sample_times
        if rows.input_marks is not None:
            self._input_marks[slots, cols] = rows.input_marks

    def input_before_forward_ranks(self) -> tuple[int, ...]:
        """Ranks whose every step in the tail that measured input wait measured it as the time
        before forward: the final summary's `input_wait_before_forward_ranks` over the steps the
        live view shows, from the markers the tail already fetched (no scan of the run's rows)."""
        marks = self._input_marks  # -1 in every cell outside the tail or not (yet) stored
        measured = (marks >= 0).any(axis=0)
        timed = (marks > 0).any(axis=0)
        return tuple(int(r) for r in self._rank_array[measured & ~timed])


def _select(rows: DecodedRows, keep: np.ndarray) -> DecodedRows:
    return DecodedRows(rows.ids[keep], rows.ranks[keep], rows.steps[keep], rows.values[keep],
                       rows.sample_times[keep],
                       None if rows.input_marks is None else rows.input_marks[keep])


def load_live_snapshot(path: str | Path, run_id: str, window: int = LIVE_WINDOW_STEPS,
                       lookback: int = WINDOW_LOOKBACK,
                       max_cells: int = LIVE_TAIL_MAX_CELLS) -> StepTimeRepositorySnapshot:
    """A one-off live-tail read (no cache kept)."""
    snapshot = LiveTail(run_id, window, lookback, max_cells).read(path).snapshot
    assert snapshot is not None
    return snapshot


__all__ = [
    "LiveRead", "LiveTail", "RunHeader",
    "connect_reader", "decode_rows", "load_live_snapshot",
    "load_summary_snapshot", "read_header", "read_rank_universe", "resolve_strategy",
]
