"""FSDP recognised from the trained model (`traceml.sharding`), on a real one-process gloo group.

The resource's strategy is fixed before the model exists; what `note_model` finds on
the model (FSDP1's wrapper, FSDP2's `fully_shard`) rides on the step records. A plain
or DDP-wrapped model is not FSDP.
"""
from __future__ import annotations

import os
import socket

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from traceml import sharding  # noqa: E402
from traceml.schema.vocabulary import STRATEGY_FSDP  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def group():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_fully_shard_is_fsdp(group):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model[0])
    fully_shard(model)
    assert sharding.model_strategy(model) == STRATEGY_FSDP
    inner = _model()
    fully_shard(inner[2])  # only a submodule sharded: still an FSDP model
    assert sharding.model_strategy(inner) == STRATEGY_FSDP


def test_the_fsdp1_wrapper_is_fsdp(group):
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(_model(), device_id=torch.device("cpu"))
    assert sharding.model_strategy(model) == STRATEGY_FSDP


def test_a_plain_or_ddp_model_is_not(group):
    from torch.nn.parallel import DistributedDataParallel

    assert sharding.model_strategy(_model()) is None
    assert sharding.model_strategy(DistributedDataParallel(_model())) is None
    assert sharding.model_strategy(object()) is None  # not a module: nothing recognised, no error


def test_wrap_forward_notes_it_and_step_records_carry_it(group):
    """The model is looked at where it gets forward timing; the step records say what was found."""
    import traceml
    from torch.distributed.fsdp import fully_shard

    from traceml.samplers import resolve_batch
    from traceml.schema.vocabulary import RAW_FORWARD

    sharding.reset()
    try:
        plain = traceml.wrap_forward(_model())
        assert sharding.detected is None
        model = _model()
        fully_shard(model)
        traceml.wrap_forward(model)
        assert sharding.detected == STRATEGY_FSDP
        traceml.wrap_forward(plain)  # once found it stays
        assert sharding.detected == STRATEGY_FSDP
        batch = type("Batch", (), {"step": 0, "parent": None,
                                   "events": [(RAW_FORWARD, 0, 1_000_000, None, None)]})()
        assert resolve_batch(batch, 0).strategy == STRATEGY_FSDP
    finally:
        sharding.reset()
        from traceml.forward import remove_forward_instrumentation

        for m in (plain, model):
            remove_forward_instrumentation(m)
