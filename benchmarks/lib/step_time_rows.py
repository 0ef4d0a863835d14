"""Synthetic Step Time rows for the analysis benchmarks, written through the receivers' path.

Every rank's step has the five phases and the step itself, skewed a little per rank and
per step so the analysis has something to find, with step N at `START + N` seconds.
bench_step_time, bench_resource_analysis and bench_peers' analysis worker build their
stores from these, so their figures are about the same data.
"""
from __future__ import annotations

from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.model import RankIdentity, RawEventValue, StepTimeIngestRecord
from traceml.schema import vocabulary as v

RUN = "bench"
START = 1_700_000_000.0  # step N starts at START + N
BASE = {v.RAW_DATALOADER_NEXT: 5.0, v.RAW_H2D: 5.0, v.RAW_FORWARD: 30.0,
        v.RAW_BACKWARD: 45.0, v.RAW_OPTIMIZER_STEP: 10.0, v.RAW_STEP_TIME: 95.0}


def records(ranks: int, steps: range, strategy: str = "ddp") -> list[StepTimeIngestRecord]:
    """One record per rank and step of `steps`."""
    out = []
    for step in steps:
        for rank in range(ranks):
            skew = 1.0 + 0.01 * (rank % 7) + 0.001 * (step % 13)
            events = {name: RawEventValue(2 * value * skew, value * skew, 1) for name, value in BASE.items()}
            out.append(StepTimeIngestRecord(
                RUN, RankIdentity(rank, rank % 8, rank // 8, ranks, min(ranks, 8), f"node{rank // 8}"),
                step, START + step, 1_700_000_000.1 + step, events, strategy))
    return out


def write(store: StepTimeStore, ranks: int, steps: range, batch_rows: int = 20_000) -> None:
    """`records` of every rank for `steps`, written in batches of about `batch_rows` rows."""
    per_batch = max(1, batch_rows // ranks)
    for start in range(steps.start, steps.stop, per_batch):
        store.write(records(ranks, range(start, min(start + per_batch, steps.stop))))
