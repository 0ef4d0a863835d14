"""Run identity: the run-id precedence, rank variables, strategy, and a generated id all ranks share."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from traceml.exporter.identity import resolve_identity
from traceml.schema.run_id import (
    SOURCE_ARGUMENT,
    SOURCE_GENERATED,
    SOURCE_LAUNCHER_PROCESS,
    SOURCE_RENDEZVOUS,
    SOURCE_RENDEZVOUS_STORE,
    SOURCE_SLURM,
    SOURCE_TRACEML_ENV,
)

TORCHRUN_2 = {"RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}


def test_precedence_argument_then_traceml_then_torchelastic_then_slurm():
    env = {"TRACEML_RUN_ID": "t", "TORCHELASTIC_RUN_ID": "e", "SLURM_JOB_ID": "s"}
    assert (resolve_identity("arg", environ=env).run_id, resolve_identity("arg", environ=env).run_id_source) == \
        ("arg", SOURCE_ARGUMENT)
    assert resolve_identity(environ=env).run_id_source == SOURCE_TRACEML_ENV
    del env["TRACEML_RUN_ID"]
    assert (resolve_identity(environ=env).run_id, resolve_identity(environ=env).run_id_source) == \
        ("e", SOURCE_RENDEZVOUS)
    del env["TORCHELASTIC_RUN_ID"]
    assert (resolve_identity(environ=env).run_id, resolve_identity(environ=env).run_id_source) == ("s", SOURCE_SLURM)


@pytest.mark.parametrize("value", ["none", "None", " NONE "])
def test_plain_torchrun_none_is_not_a_run_id(value):
    ident = resolve_identity(environ={"TORCHELASTIC_RUN_ID": value, "SLURM_JOB_ID": "991"})
    assert (ident.run_id, ident.run_id_source) == ("991", SOURCE_SLURM)
    alone = resolve_identity(environ={"TORCHELASTIC_RUN_ID": value})
    assert alone.run_id_source == SOURCE_GENERATED and alone.run_id.lower() != "none"


def test_single_process_ids_are_fresh_per_run():
    a, b = resolve_identity(environ={}), resolve_identity(environ={})
    assert a.run_id != b.run_id and a.world_size == 1 and a.strategy == "single"


def test_torchrun_rank_variables():
    ident = resolve_identity(environ=dict(TORCHRUN_2, TRACEML_RUN_ID="r"))
    assert (ident.rank, ident.local_rank, ident.node_rank, ident.world_size, ident.local_world_size,
            ident.strategy, ident.service_instance_id) == (1, 1, 0, 2, 2, "ddp", "r-rank1")


def test_slurm_fallbacks_when_torchrun_variables_are_absent():
    env = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "2(x4)"}
    ident = resolve_identity(environ=env)
    assert (ident.run_id, ident.rank, ident.local_rank, ident.node_rank, ident.world_size,
            ident.local_world_size) == ("77", 5, 1, 2, 8, 2)


def test_strategy_from_argument_env_or_inferred():
    assert resolve_identity(environ=dict(TORCHRUN_2, TRACEML_RUN_ID="r", TRACEML_TRAINING_STRATEGY="FSDP")
                            ).strategy == "fsdp"
    assert resolve_identity("r", strategy="single", environ=TORCHRUN_2).strategy == "single"
    with pytest.raises(ValueError, match="zero3"):
        resolve_identity("r", strategy="zero3", environ={})


@pytest.mark.parametrize("env,needle", [({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK"),
                                        ({"RANK": "2", "WORLD_SIZE": "2"}, "below world size"),
                                        ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
                                        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK")])
def test_malformed_launcher_variables_are_clear_errors(env, needle):
    with pytest.raises(ValueError, match=needle):
        resolve_identity("r", environ=env)


def test_ranks_agree_through_the_rendezvous_store_and_the_next_job_differs():
    torch_dist = pytest.importorskip("torch.distributed")
    from datetime import timedelta

    ids = []
    for _job in range(2):
        store = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
        env = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2"}
        ranks = [resolve_identity(environ=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in (1, 0)]
        assert {i.run_id_source for i in ranks} == {SOURCE_RENDEZVOUS_STORE}
        assert ranks[0].run_id == ranks[1].run_id
        ids.append(ranks[0].run_id)
        del store
    assert ids[0] != ids[1]


_CHILD = "from traceml.exporter.identity import resolve_identity; print(resolve_identity(use_store=False).run_id)"
_PARENT = textwrap.dedent("""
    import os, subprocess, sys
    outs = []
    procs = [subprocess.Popen([sys.executable, "-c", {child!r}], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                       LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="none",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"))
             for r in range(2)]
    print(" ".join(p.communicate()[0].strip() for p in procs))
""").format(child=_CHILD)


@pytest.mark.slow
def test_without_a_store_ranks_under_one_launcher_agree_and_consecutive_jobs_differ():
    env = {k: val for k, val in __import__("os").environ.items()
           if k not in ("TRACEML_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    jobs = [subprocess.run([sys.executable, "-c", _PARENT], capture_output=True, text=True, env=env,
                           timeout=120).stdout.split() for _ in range(2)]
    for ids in jobs:
        assert len(ids) == 2 and ids[0] == ids[1] and ids[0].startswith("job-")
    assert jobs[0][0] != jobs[1][0]
    # Same-process check of the source label.
    ident = resolve_identity(environ={"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "1"}, use_store=False)
    assert ident.run_id_source == SOURCE_LAUNCHER_PROCESS


@pytest.mark.parametrize("explicit, rdzv, environ", [
    ("cli", "rdzv", {"TRACEML_RUN_ID": "env", "SLURM_JOB_ID": "9"}),
    (None, "rdzv", {"TRACEML_RUN_ID": " env ", "SLURM_JOB_ID": "9"}),
    (None, "rdzv", {"SLURM_JOB_ID": "9"}),
    (None, "None", {"SLURM_JOB_ID": "9"}),
    (None, "  ", {"TRACEML_RUN_ID": "", "SLURM_JOB_ID": "9"}),
])
def test_a_rank_and_the_launcher_choose_the_same_declared_run_id(explicit, rdzv, environ):
    """The launcher's --rdzv-id reaches the ranks as TORCHELASTIC_RUN_ID: both must pick the same id."""
    from traceml.launcher import run_dir

    launcher = run_dir.resolve_run_id(explicit, rdzv, environ)
    rank = resolve_identity(explicit, environ=dict(environ, TORCHELASTIC_RUN_ID=rdzv))
    assert launcher.run_id == rank.run_id


def test_a_generated_run_id_has_one_format_on_both_sides():
    from traceml.launcher import run_dir

    pattern = r"\d{8}-\d{6}-[0-9a-f]{8}"
    assert re.fullmatch(pattern, run_dir.resolve_run_id(None, None, {}).run_id)
    assert re.fullmatch(pattern, resolve_identity(environ={}).run_id)
