"""Record builders shared by the exporter tests and bench_exporter (plain module: `conftest` names collide across folders)."""
from __future__ import annotations

from traceml.exporter.identity import RunIdentity
from traceml.records import EventTotals, PhaseInterval, ResolvedStepTime, StepMemorySnapshot
from traceml.schema import vocabulary as v


def identity(run_id: str = "run-test", rank: int = 0, world_size: int = 1) -> RunIdentity:
    return RunIdentity(run_id=run_id, rank=rank, local_rank=rank, node_rank=0, world_size=world_size,
                       local_world_size=world_size, hostname="host-a",
                       strategy=v.STRATEGY_DDP if world_size > 1 else v.STRATEGY_SINGLE,
                       run_id_source="argument")


BASE_NS = 1_700_000_000_000_000_000


def step_record(step: int, *, gpu: bool = True, zero_forward: bool = False, phases: bool = True) -> ResolvedStepTime:
    """A step shaped like the contract's base fixture; values vary with the step number."""
    events = {
        v.RAW_DATALOADER_NEXT: EventTotals(5.0 + step / 1000, None, 1),
        v.RAW_H2D: EventTotals(10.0, 5.0 if gpu else None, 2),
        v.RAW_FORWARD: EventTotals(0.0 if zero_forward else 60.25, 0.0 if zero_forward and gpu else (30.5 if gpu else None), 1),
        v.RAW_BACKWARD: EventTotals(90.0, 45.0 if gpu else None, 1),
        v.RAW_OPTIMIZER_STEP: EventTotals(20.0, 10.0 if gpu else None, 1),
        v.RAW_STEP_TIME: EventTotals(190.0 + step, 95.0 if gpu else None, 1),
    }
    start = BASE_NS + step * 200_000_000
    phase_list = ()
    if phases:
        t = start
        out = []
        for raw in (v.RAW_DATALOADER_NEXT, v.RAW_H2D, v.RAW_H2D, v.RAW_FORWARD, v.RAW_BACKWARD, v.RAW_OPTIMIZER_STEP):
            out.append(PhaseInterval(raw, t, t + 10_000_000))
            t += 10_000_000
        phase_list = tuple(out)
    return ResolvedStepTime(step=step, start_time_ns=start, end_time_ns=start + 195_000_000,
                            events=events, phases=phase_list)


def memory_record(step: int, *, cuda: bool = True) -> StepMemorySnapshot:
    if not cuda:
        return StepMemorySnapshot(step, "cpu", None, None, BASE_NS + step * 200_000_000 + 195_000_000)
    return StepMemorySnapshot(step, "cuda:0", 1_000_000 + step, 2_000_000 + step,
                              BASE_NS + step * 200_000_000 + 195_000_000)
