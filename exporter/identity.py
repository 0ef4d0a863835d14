"""Who this rank is: run id, rank numbers, host and training strategy.

Resolved once per process from arguments and the launcher's environment
(torchrun, SLURM). Importing this module never imports torch; torch is touched
only to agree on a generated run id across ranks (see `_agreed_run_id`).

Run id: the declared sources in the order `traceml.schema.run_id` gives (an
explicit argument or `TRACEML_RUN_ID`, then `TORCHELASTIC_RUN_ID` unless `none`,
then `SLURM_JOB_ID`: the launcher follows the same order), else
4. a generated id that every rank of the job agrees on:
   a. through the job's rendezvous store (the initialised default process
      group's store, or torchrun's agent TCPStore at MASTER_ADDR:MASTER_PORT):
      each rank proposes a fresh random id with one atomic compare-and-set on
      one key; the first proposal wins and every rank reads it back. The store
      lives exactly as long as the job, so two consecutive jobs never share one.
   b. without a reachable store, from the launcher process all local ranks
      share (MASTER_ADDR, MASTER_PORT, the parent's pid and start time since
      boot, the boot id): same for every rank it spawned, different for the
      next job because a new launcher has a new pid/start time. Only sound when
      every rank runs under one launcher (single node, `mp.spawn`); across nodes
      without a store a warning asks for `TRACEML_RUN_ID`.
   c. a single-process run simply generates a fresh id.
"""
from __future__ import annotations

import hashlib
import logging
import os
import socket
from dataclasses import dataclass
from typing import Mapping

from traceml.schema import environment as env_names
from traceml.schema import vocabulary as v
from traceml.schema.run_id import (
    SOURCE_GENERATED,
    SOURCE_LAUNCHER_PROCESS,
    SOURCE_RENDEZVOUS_STORE,
    RunIdSource,
    declared_run_id,
    fresh_run_id,
)

_log = logging.getLogger("traceml.exporter.identity")

RUN_ID_STORE_KEY = "traceml/run_id"
STORE_TIMEOUT_S = 5.0

__all__ = ["RunIdentity", "resolve_identity", "fresh_run_id"]


@dataclass(frozen=True, slots=True)
class RunIdentity:
    """One rank of one run, as every signal it exports is tagged."""

    run_id: str
    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    hostname: str
    strategy: str
    run_id_source: RunIdSource = SOURCE_GENERATED  # which source gave the id (`schema.run_id`)
    attempt: int = 0  # elastic restart attempt (TORCHELASTIC_RESTART_COUNT): earlier attempts' steps stay apart

    @property
    def service_instance_id(self) -> str:
        return f"{self.run_id}-rank{self.rank}"


def resolve_identity(
    run_id: str | None = None,
    strategy: str | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    use_store: bool = True,
) -> RunIdentity:
    """Identity of this process. Raises ValueError on malformed launcher variables."""
    env = os.environ if environ is None else environ
    rank = _int_env(env, env_names.RANK, env_names.SLURM_PROCID, default=0, minimum=0)
    world_size = _int_env(env, env_names.WORLD_SIZE, env_names.SLURM_NTASKS, default=1, minimum=1)
    if rank >= world_size:
        raise ValueError(f"rank {rank} is not below world size {world_size} (check RANK/WORLD_SIZE)")
    local_rank = _int_env(env, env_names.LOCAL_RANK, env_names.SLURM_LOCALID, default=rank, minimum=0)
    local_world_size = _local_world_size(env, world_size)
    node_rank = _int_env(env, env_names.GROUP_RANK, env_names.SLURM_NODEID,
                         default=rank // max(local_world_size, 1), minimum=0)
    run_id_value, source = _resolve_run_id(run_id, env, world_size, local_world_size, use_store)
    return RunIdentity(
        run_id=run_id_value,
        rank=rank,
        local_rank=local_rank,
        node_rank=node_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        hostname=socket.gethostname(),
        strategy=_resolve_strategy(strategy, env, world_size),
        run_id_source=source,
        attempt=_int_env(env, env_names.TORCHELASTIC_RESTART_COUNT, None, default=0, minimum=0),
    )


# --- ranks ---------------------------------------------------------------------------------

def _int_env(env: Mapping[str, str], name: str, fallback: str | None, *, default: int, minimum: int) -> int:
    for key in (name, fallback):
        if key is None:
            continue
        raw = env.get(key)
        if raw is None or raw.strip() == "":
            continue
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"{key}={raw!r} is not an integer") from None
        if value < minimum:
            raise ValueError(f"{key}={raw!r} must be >= {minimum}")
        return value
    return default


def _local_world_size(env: Mapping[str, str], world_size: int) -> int:
    raw = env.get(env_names.LOCAL_WORLD_SIZE)
    if raw is not None and raw.strip():
        return _int_env(env, env_names.LOCAL_WORLD_SIZE, None, default=1, minimum=1)
    per_node = env.get(env_names.SLURM_NTASKS_PER_NODE)
    if per_node:
        # SLURM writes "4" or, for heterogeneous layouts, "4(x2),2": take this layout's first count.
        head = per_node.split(",")[0].split("(")[0].strip()
        if head.isdigit() and int(head) > 0:
            return int(head)
    nodes = env.get(env_names.SLURM_NNODES)
    if nodes and nodes.strip().isdigit() and int(nodes) > 0:
        return max(1, world_size // int(nodes))
    return world_size


def _resolve_strategy(strategy: str | None, env: Mapping[str, str], world_size: int) -> str:
    chosen = strategy or env.get(env_names.TRACEML_TRAINING_STRATEGY) or ""
    chosen = chosen.strip().lower()
    if not chosen:
        return v.STRATEGY_DDP if world_size > 1 else v.STRATEGY_SINGLE
    if chosen not in v.TRAINING_STRATEGIES:
        raise ValueError(f"training strategy {chosen!r} is not one of {list(v.TRAINING_STRATEGIES)}")
    return chosen


# --- run id --------------------------------------------------------------------------------

def _resolve_run_id(explicit: str | None, env: Mapping[str, str], world_size: int,
                    local_world_size: int, use_store: bool) -> tuple[str, RunIdSource]:
    declared = declared_run_id(explicit, env.get(env_names.TORCHELASTIC_RUN_ID), env)
    if declared is not None:
        return declared
    if world_size <= 1:
        return fresh_run_id(), SOURCE_GENERATED
    if use_store:
        agreed = _agreed_run_id(env)
        if agreed:
            return agreed, SOURCE_RENDEZVOUS_STORE
    derived = _launcher_run_id(env)
    if derived and local_world_size < world_size:
        _log.warning("traceml: no run id source reachable from every node (TRACEML_RUN_ID, "
                     "TORCHELASTIC_RUN_ID, SLURM_JOB_ID, rendezvous store); ranks on different "
                     "nodes may disagree. Set TRACEML_RUN_ID to one value for the whole job.")
    return (derived, SOURCE_LAUNCHER_PROCESS) if derived else (fresh_run_id(), SOURCE_GENERATED)


def _agreed_run_id(env: Mapping[str, str]) -> str | None:
    """Every rank proposes; the store's atomic compare-and-set keeps the first proposal."""
    store = _rendezvous_store(env)
    if store is None:
        return None
    try:
        agreed = store.compare_set(RUN_ID_STORE_KEY, "", fresh_run_id())
        text = agreed.decode() if isinstance(agreed, (bytes, bytearray)) else str(agreed)
        return text or None
    except Exception as exc:  # a store problem must never stop training
        _log.debug("traceml: rendezvous store compare_set failed: %s", exc)
        return None


def _rendezvous_store(env: Mapping[str, str]):
    try:
        import torch.distributed as dist
    except Exception:
        return None
    try:
        if dist.is_available() and dist.is_initialized():
            from torch.distributed import distributed_c10d
            return distributed_c10d._get_default_store()
    except Exception as exc:
        _log.debug("traceml: default process group store unavailable: %s", exc)
    if (env.get(env_names.TORCHELASTIC_USE_AGENT_STORE) or "").strip().lower() != "true":
        return None
    host, port = env.get(env_names.MASTER_ADDR), env.get(env_names.MASTER_PORT)
    if not host or not port or not port.strip().isdigit():
        return None
    try:
        from datetime import timedelta
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    except Exception as exc:
        _log.debug("traceml: agent store %s:%s unreachable: %s", host, port, exc)
        return None


def _launcher_run_id(env: Mapping[str, str]) -> str | None:
    """Hash of what all ranks under one launcher share and the next job will not."""
    ppid = os.getppid()
    start_ticks = _process_start_ticks(ppid)
    if start_ticks is None:
        return None
    parts = (env.get(env_names.MASTER_ADDR, ""), env.get(env_names.MASTER_PORT, ""),
             socket.gethostname(), _boot_id(), str(ppid), start_ticks)
    return "job-" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _process_start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22 (starttime) counted after the parenthesised command name, which may hold spaces.
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""
