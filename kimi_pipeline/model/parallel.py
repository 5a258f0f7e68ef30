"""Parallel layout + torch.distributed / megatron parallel_state bring-up.

One `Layout` describes how a job splits the model (TP, PP, EP, expert-TP, CP; DP derived from the world
size; uneven first/last pipeline stages). It is built from the recipe's `convert` or `parallel` section,
and `init_distributed` turns it into process groups: from torchrun / Ray env vars (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), or as a single process on a free port, on the device the process was given.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.model.megatron_compat import apply_compat
from kimi_pipeline.recipes.checks import PipelineSplitError, pipeline_layers
from kimi_pipeline.recipes.models import ConvertSpec, ModelSpec, ParallelSpec
from kimi_pipeline.util.net import LOOPBACK
from kimi_pipeline.util.rendezvous import gloo_on, tcp_store
from kimi_pipeline.util.threads import cpu_threads


class LayoutError(PermanentError):
    """The parallel layout does not fit the world size or the model shape."""


@dataclass(frozen=True)
class Layout:
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    first_pp_stage_layers: int | None = None  # decoder_first_pipeline_num_layers
    last_pp_stage_layers: int | None = None  # decoder_last_pipeline_num_layers
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        mp = self.tp * self.pp * self.cp
        if self.world_size % mp:
            raise LayoutError(f"world size {self.world_size} is not divisible by tp*pp*cp = {mp}")
        expert_mp = self.ep * self.etp * self.pp
        if self.world_size % expert_mp:
            raise LayoutError(f"world size {self.world_size} is not divisible by ep*etp*pp = {expert_mp}")
        if self.ep == 1 and self.etp != self.tp:
            # With EP=1 megatron reduces expert grads over the dense DP group only, which misses the TP
            # ranks that hold the same expert shard but route other (sequence-parallel) tokens.
            raise LayoutError(f"ep=1 needs etp == tp (got tp={self.tp}, etp={self.etp}): set etp={self.tp} or ep>1")
        if self.pp == 1 and (self.first_pp_stage_layers or self.last_pp_stage_layers):
            object.__setattr__(self, "first_pp_stage_layers", None)
            object.__setattr__(self, "last_pp_stage_layers", None)
        if self.sequence_parallel and self.tp == 1:
            object.__setattr__(self, "sequence_parallel", False)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size (replicas of each expert shard)."""
        return self.world_size // (self.ep * self.etp * self.pp)

    def pp_stage_layers(self, num_layers: int) -> list[int]:
        """Decoder layers per pipeline stage: the recipe check's rule (`recipes.checks.pipeline_layers`)."""

        first, last = self.first_pp_stage_layers, self.last_pp_stage_layers
        try:
            return pipeline_layers(num_layers, self.pp, first, last)
        except PipelineSplitError as e:
            raise LayoutError(
                f"{num_layers} layers do not split over pp={self.pp} with first={first}, last={last}: {e}; set "
                "decoder_first/last_pipeline_num_layers so the rest divides evenly"
            ) from None

    def layer_offset(self, num_layers: int, pp_rank: int) -> int:
        return sum(self.pp_stage_layers(num_layers)[:pp_rank])

    def check_model(self, spec: ModelSpec) -> None:
        """Raise LayoutError when the model shape cannot be split this way."""
        problems = []
        if spec.num_attention_heads % self.tp:
            problems.append(f"num_attention_heads {spec.num_attention_heads} % tp {self.tp}")
        if spec.vocab_size % self.tp:
            problems.append(f"vocab_size {spec.vocab_size} % tp {self.tp}")
        if spec.num_experts % self.ep:
            problems.append(f"num_experts {spec.num_experts} % ep {self.ep}")
        if spec.moe_ffn_hidden_size % self.etp:
            problems.append(f"moe_ffn_hidden_size {spec.moe_ffn_hidden_size} % etp {self.etp}")
        if spec.ffn_hidden_size % self.tp:
            problems.append(f"ffn_hidden_size {spec.ffn_hidden_size} % tp {self.tp}")
        if problems:
            raise LayoutError("model shape does not split over the layout: " + "; ".join(problems) + " must be 0")
        self.pp_stage_layers(spec.num_layers)

    @classmethod
    def from_convert(cls, spec: ConvertSpec, world_size: int | None = None) -> Layout:
        """The conversion job's layout: world size = nodes x ranks per node unless given."""
        return cls(
            world_size=world_size or spec.nodes * spec.gpus_per_node,
            tp=spec.tp,
            pp=spec.pp,
            ep=spec.ep,
            etp=spec.etp,
            first_pp_stage_layers=spec.decoder_first_pipeline_num_layers,
            last_pp_stage_layers=spec.decoder_last_pipeline_num_layers,
        )

    @classmethod
    def from_parallel(cls, spec: ParallelSpec, world_size: int | None = None) -> Layout:
        """The trainer's layout. World size: given, else tp*pp*cp*dp if the recipe sets dp, else $WORLD_SIZE."""
        if world_size is None:
            if spec.dp is not None:
                world_size = spec.dp * spec.tp * spec.pp * spec.cp
            else:
                world_size = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(
            world_size=world_size,
            tp=spec.tp,
            pp=spec.pp,
            ep=spec.ep,
            etp=spec.etp,
            cp=spec.cp,
            first_pp_stage_layers=spec.decoder_first_pipeline_num_layers,
            last_pp_stage_layers=spec.decoder_last_pipeline_num_layers,
            sequence_parallel=spec.sequence_parallel,
        )


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
