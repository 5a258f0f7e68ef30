"""torch.distributed / megatron parallel_state bring-up.

`init_distributed` turns a `recipes.layout.Layout` (how a job splits the model) into process groups: from
torchrun / Ray env vars (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or as a single process on a free port, on
the device the process was given.
"""

from __future__ import annotations

import datetime
import math
import os

import torch
import torch.distributed as dist

from kimi_pipeline.model.megatron_compat import apply_compat
from kimi_pipeline.recipes.layout import Layout, LayoutError
from kimi_pipeline.util.net import LOOPBACK
from kimi_pipeline.util.rendezvous import gloo_on, tcp_store
from kimi_pipeline.util.threads import cpu_threads


def process_group_timeout(default_minutes: int = 30) -> datetime.timedelta:
    """How long a collective may wait: the seeds' `NCCL_TIMEOUT` (seconds; `rl.actor_layout.SEED_CUDA_ENV` sets it for
    every GPU actor) when set, else `default_minutes`. Neither torch nor NCCL reads that variable themselves:
    the timeout only takes effect through `init_process_group` and megatron's groups, which this feeds."""
    raw = os.environ.get("NCCL_TIMEOUT")
    if raw is None:
        return datetime.timedelta(minutes=default_minutes)
    try:
        seconds = int(raw)
    except ValueError:
        raise LayoutError(f"NCCL_TIMEOUT={raw!r}: expected whole seconds (the seeds use 3600)") from None
    if seconds <= 0:
        raise LayoutError(f"NCCL_TIMEOUT={raw!r}: expected a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


def _trainer_store(address: str, port: int, rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The default group's store, as `init_process_group(init_method="tcp://…")` makes it (rank 0 hosts it,
    multi-tenant, keys under "default_pg": torch/distributed/rendezvous.py:162-214, distributed_c10d.py:1883-1897)
    but listening on MASTER_ADDR alone (`util.rendezvous.tcp_store`). Under torchrun the agent of node 0 hosts it
    (TORCHELASTIC_USE_AGENT_STORE; `weightjobs.agent` binds it) and every rank is a client."""
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = tcp_store(address, port, world, rank == 0 and not agent_hosts, timeout, multi_tenant=True)
    return dist.PrefixStore("default_pg", store)  # the prefix init_process_group gives the store it makes


def init_distributed(
    layout: Layout,
    *,
    device: torch.device,
    backend: str | None = None,
    seed: int = 1234,
    timeout_minutes: int = 30,
) -> int:
    """Initialise torch.distributed + megatron parallel_state for `layout` on `device`; returns this rank.

    `device` comes from `model.device` (decided once per process). Reads RANK / WORLD_SIZE / MASTER_ADDR /
    MASTER_PORT (torchrun and Ray actors set them); without them runs as a single process on a free loopback
    port. nccl for CUDA tensors, gloo for CPU ones; megatron's compatibility rows for that device, backend and
    the installed kernels; on CPU one intra-op thread per core per local rank. megatron's gloo groups are
    created on both paths, as megatron's default does (its distributed optimizer needs them).
    """

    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    apply_compat(device, backend)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if "MASTER_PORT" not in os.environ:
            raise LayoutError("RANK/WORLD_SIZE are set but MASTER_PORT is not (launch with torchrun or set it)")
        address, port = os.environ.get("MASTER_ADDR", LOOPBACK), int(os.environ["MASTER_PORT"])
    else:  # a lone process: its own loopback rendezvous, without touching the environment
        rank, world, address, port = 0, 1, LOOPBACK, 0
    if world != layout.world_size:
        raise LayoutError(f"layout is for {layout.world_size} ranks but WORLD_SIZE={world}")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(local_world))  # one rank per core: more starves gloo ranks
    timeout = process_group_timeout(timeout_minutes)
    with gloo_on(address):  # megatron's gloo groups too: every member is where the rendezvous is
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, store=_trainer_store(address, port, rank, world, timeout),
                                    rank=rank, world_size=world, timeout=timeout)
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            distributed_timeout_minutes=max(1, math.ceil(timeout.total_seconds() / 60)),
        )
    torch.manual_seed(seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    model_parallel_cuda_manual_seed(seed)
    return rank


def destroy() -> None:
    """Tear down megatron's groups and the default process group (safe to call twice)."""

    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def ranks() -> dict[str, int]:
    """This process's coordinates in the megatron grid (for names, logs and file names)."""
    from megatron.core import parallel_state as ps

    return {
        "rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
    }
