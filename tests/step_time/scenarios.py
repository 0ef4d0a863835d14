"""The Step Time contract scenarios (eleven from the contract, four of issue 19's collective
wait and drift, one of issue 30's loop without input wait), written into real SQLite through `StepTimeStore`.

Base per-step payload (milliseconds): input_wait 5, h2d 5, forward 30, backward 45,
optimizer 10, traced 95. GPU scenarios store gpu = value and cpu = 2 x value; CPU
scenarios store cpu = value and no GPU value. Each database holds one run whose
run id is the scenario name. Jitter is seeded: every build writes the same rows.

Use `build_scenario(name, path)` (or the `scenario_db` fixture in conftest.py).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.model import (
    RankIdentity,
    RawEventValue,
    StepTimeIngestRecord,
)
from traceml.schema.vocabulary import (
    RAW_BACKWARD,
    RAW_COLLECTIVE_WAIT,
    RAW_DATALOADER_NEXT,
    RAW_FORWARD,
    RAW_H2D,
    RAW_OPTIMIZER_STEP,
    RAW_STEP_TIME,
    STRATEGY_DDP,
    STRATEGY_FSDP,
    STRATEGY_SINGLE,
)

BASE: Mapping[str, float] = {
    RAW_DATALOADER_NEXT: 5.0,
    RAW_H2D: 5.0,
    RAW_FORWARD: 30.0,
    RAW_BACKWARD: 45.0,
    RAW_OPTIMIZER_STEP: 10.0,
    RAW_STEP_TIME: 95.0,
}
START_TIME = 1_700_000_000.0
STEP_SECONDS = 0.1

Payload = Mapping[str, float]  # raw event -> value on the scenario's clock; absent = not sent


@dataclass(frozen=True)
class Scenario:
    name: str
    ranks: int
    steps: tuple[int, ...]  # step ids every rank would write
    clock: str  # "gpu" or "cpu"
    strategy: str
    payload: Callable[[int, int], Payload | None]  # (rank, step) -> payload, None = no row
    claim: str

    @property
    def run_id(self) -> str:
        return self.name


def _base(**changes: float | None) -> Payload:
    """Base payload with some events changed (None removes an event)."""
    names = {"iw": RAW_DATALOADER_NEXT, "h2d": RAW_H2D, "fwd": RAW_FORWARD, "bwd": RAW_BACKWARD,
             "opt": RAW_OPTIMIZER_STEP, "traced": RAW_STEP_TIME, "cw": RAW_COLLECTIVE_WAIT}
    out = dict(BASE)
    for key, value in changes.items():
        if value is None:
            out.pop(names[key], None)
        else:
            out[names[key]] = value
    return out


def _same_every_step(per_rank: Mapping[int, Payload]) -> Callable[[int, int], Payload]:
    return lambda rank, step: per_rank[rank]


def _straggler(r1: Payload) -> Callable[[int, int], Payload]:
    r0 = {RAW_DATALOADER_NEXT: 100.0, RAW_FORWARD: 20.0, RAW_BACKWARD: 20.0, RAW_STEP_TIME: 40.0}
    return _same_every_step({0: r0, 1: r1})


def _jittered(rank: int, step: int) -> Payload:
    rng = random.Random(7_919 * rank + step)  # seeded per (rank, step): same rows on every build
    payload = _base(bwd=60.0) if rank == 1 else _base()
    return {name: value * rng.uniform(0.9, 1.1) for name, value in payload.items()}


def _missing_steps(rank: int, step: int) -> Payload | None:
    return None if rank == 1 and step in (11, 12, 13, 14) else _base()


def _intermittent(rank: int, step: int) -> Payload:
    """H2D on even steps, optimizer on every 4th; the traced step holds the phases that
    ran plus 5 ms of unattributed time, so the residual stays 5 ms on every step."""
    h2d = 5.0 if step % 2 == 0 else None
    opt = 10.0 if step % 4 == 0 else None
    traced = 5.0 + 30.0 + 45.0 + (h2d or 0.0) + (opt or 0.0)
    payload = _base(h2d=h2d, opt=opt, traced=traced)
    if rank == 1 and step == 17:
        payload.pop(RAW_FORWARD)  # the work ran; its measurement did not arrive
    return payload


def _backward_straggler(rank: int, step: int) -> Payload:
    """DDP, 3 ranks; rank 2's backward computes 60 ms longer, so ranks 0 and 1 wait 60 ms in
    the gradient all-reduce inside their backward: backward is 105 ms on every rank, and only
    the collective wait (60, 60, 0 ms on top of 1 ms of transfer) tells the ranks apart."""
    return _base(bwd=105.0, traced=155.0, cw=1.0 if rank == 2 else 61.0)


def _gather_input_straggler(rank: int, step: int) -> Payload:
    """HF Trainer's defaults on 2 ranks, rank 1 with a slow dataset (40 ms more input wait):
    rank 0 waits those 40 ms in the token-count gather, a collective outside every timed
    phase of the traced step; its residual would hold them unmeasured."""
    if rank == 1:
        return _base(iw=45.0, cw=0.5)
    return _base(traced=135.0, cw=40.5)


def _no_input_compute_straggler(rank: int, step: int) -> Payload:
    """Marked steps over batches no DataLoader delivers (a generator): no rank measures input
    wait. DDP, 2 ranks; rank 1's forward computes 60 ms longer, so rank 0 waits those 60 ms in
    the gradient all-reduce inside its backward. Every phase the rules need but input wait is
    measured, so the straggler is found on the traced step (issue 30 item 1)."""
    if rank == 1:
        return _base(iw=None, fwd=90.0, traced=155.0, cw=1.0)
    return _base(iw=None, bwd=105.0, traced=155.0, cw=61.0)


def _collective_bound(rank: int, step: int) -> Payload:
    """Every rank waits about 40 ms of a 145 ms step in collectives inside backward, nearly
    alike (a slow interconnect, not a late rank)."""
    return _base(bwd=85.0, traced=135.0, cw=40.0 + rank)


def _drift(rank: int, step: int) -> Payload:
    """All ranks alike: from step 21 on the forward pass takes 30 ms longer (+30 % step)."""
    return _base(fwd=60.0, traced=125.0) if step >= 21 else _base()


_STEPS_100 = tuple(range(1, 101))
_STEPS_40 = tuple(range(1, 41))
_STEPS_30 = tuple(range(1, 31))

SCENARIO_SPECS: Mapping[str, Scenario] = {s.name: s for s in (
    Scenario("complete_gpu", 2, _STEPS_100, "gpu", STRATEGY_DDP,
             _same_every_step({0: _base(), 1: _base()}),
             "complete multi-rank window, GPU selection, and CPU-reporting projection"),
    Scenario("sparse_missing_forward", 2, _STEPS_30, "cpu", STRATEGY_DDP,
             _same_every_step({0: _base(), 1: _base(fwd=None)}),
             "one rank lacks a required signal; compute and residual remain unavailable on that rank"),
    Scenario("measured_zero_forward", 2, (1, 2, 3, 4), "cpu", STRATEGY_DDP,
             _same_every_step({0: _base(), 1: _base(fwd=0.0)}),
             "an explicit zero remains measured and participates in compute, residual, and diagnosis"),
    Scenario("single_rank_cpu", 1, _STEPS_30, "cpu", STRATEGY_SINGLE,
             _same_every_step({0: _base()}),
             "single-rank statistics and diagnosis without fabricated cross-rank skew"),
    Scenario("ddp_rank_straggler", 2, tuple(range(1, 25)), "cpu", STRATEGY_DDP,
             _straggler({RAW_DATALOADER_NEXT: 0.0, RAW_FORWARD: 20.0, RAW_BACKWARD: 120.0,
                         RAW_STEP_TIME: 140.0}),
             "DDP visible-backward attribution and critical severity after a confident window"),
    Scenario("fsdp_rank_straggler", 2, tuple(range(1, 25)), "cpu", STRATEGY_FSDP,
             _straggler({RAW_DATALOADER_NEXT: 0.0, RAW_FORWARD: 80.0, RAW_BACKWARD: 80.0,
                         RAW_STEP_TIME: 160.0}),
             "FSDP strategy propagation, attribution behavior, and warning severity cap"),
    Scenario("jittered_ddp", 2, _STEPS_40, "cpu", STRATEGY_DDP, _jittered,
             "per-step variation on every metric, and a rank whose backward is slower"),
    Scenario("rank_missing_steps", 2, _STEPS_30, "cpu", STRATEGY_DDP, _missing_steps,
             "a rank that stops reporting for four steps mid-window drops those steps"),
    Scenario("intermittent_metrics", 2, _STEPS_40, "cpu", STRATEGY_DDP, _intermittent,
             "optimizer_step and h2d on some steps stay measured; a forward missing once "
             "leaves that rank's forward, compute and residual unknown"),
    Scenario("h2d_bound_gpu", 2, _STEPS_30, "gpu", STRATEGY_DDP,
             _same_every_step({0: _base(h2d=20.0, bwd=30.0), 1: _base(h2d=20.0, bwd=30.0)}),
             "H2D-bound diagnosis on the GPU clock"),
    Scenario("forward_missing_everywhere", 2, _STEPS_30, "cpu", STRATEGY_DDP,
             _same_every_step({0: _base(fwd=None), 1: _base(fwd=None)}),
             "incomplete-data diagnosis when no rank reports forward"),
    Scenario("collective_backward_straggler", 3, _STEPS_30, "cpu", STRATEGY_DDP, _backward_straggler,
             "equal backward on every rank; the least collective wait names the rank slowed in "
             "backward (COMPUTE_STRAGGLER, grown phase backward)"),
    Scenario("collective_gather_input_straggler", 2, _STEPS_30, "cpu", STRATEGY_DDP,
             _gather_input_straggler,
             "a collective outside the phases is measured wait, not residual; the rank that waited "
             "least is the input straggler, and no INPUT_BOUND is reported beside it"),
    Scenario("collective_bound", 2, _STEPS_30, "cpu", STRATEGY_DDP, _collective_bound,
             "every rank waits a large share of its step in collectives: COLLECTIVE_BOUND, no rank named"),
    Scenario("step_time_drift", 2, _STEPS_40, "cpu", STRATEGY_DDP, _drift,
             "every rank 30 % slower from step 21 on: STEP_TIME_DRIFT at that step, forward grown"),
    Scenario("no_input_compute_straggler", 2, _STEPS_30, "cpu", STRATEGY_DDP, _no_input_compute_straggler,
             "no rank measures input wait: the rules that do not need it run on the traced step "
             "(COMPUTE_STRAGGLER, grown phase forward) and INCOMPLETE_DATA says what is out of reach"),
)}

SCENARIOS: tuple[str, ...] = tuple(SCENARIO_SPECS)


def scenario_records(name: str) -> list[StepTimeIngestRecord]:
    """The ingest records of one scenario, rank-major per step (as a collector would batch them)."""
    spec = SCENARIO_SPECS[name]
    records = []
    for step in spec.steps:
        for rank in range(spec.ranks):
            payload = spec.payload(rank, step)
            if payload is None:
                continue
            events = {
                raw: (RawEventValue(2.0 * value, value, 1) if spec.clock == "gpu"
                      else RawEventValue(value, None, 1))
                for raw, value in payload.items()
            }
            start = START_TIME + step * STEP_SECONDS
            records.append(StepTimeIngestRecord(
                run_id=spec.run_id,
                identity=RankIdentity(rank, local_rank=rank, node_rank=0, world_size=spec.ranks,
                                      local_world_size=spec.ranks, hostname="node0"),
                step=step, start_time=start, sample_time=start + STEP_SECONDS * 0.9,
                events=events, training_strategy=spec.strategy))
    return records


def build_scenario(name: str, path: str | Path) -> Path:
    """Write scenario `name` into the SQLite database at `path` (created if needed)."""
    path = Path(path)
    with StepTimeStore(path) as store:
        result = store.write(scenario_records(name), receive_time=START_TIME + 3600.0)
    if result.unknown_events:
        raise AssertionError(f"scenario {name} wrote bad rows: {result}")
    return path
