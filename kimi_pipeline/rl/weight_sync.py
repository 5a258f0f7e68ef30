"""How trained weights reach the rollout engines: one updater per run (per set of engines), chosen once.

Megatron shards → HF names → the engine's own format (`quant.engine_format`: INT4 pack-quantized, FP8
blocks + scales, or bf16) → every engine, in `rollout.update_weight_buffer_size` buckets:

- `OwnedBuckets`: colocated on one host (every engine reads this host's shared memory): each trainer rank
  sends the buckets it holds itself, never broadcast to the other ranks.
- `GatheredPush`: rank 0 receives each tensor from its holder and sends it (shared memory, the weight-update
  process group — gloo / NCCL — or safetensors bodies; the engine client picks per engine).
- `DiskCheckpoint`: an HF checkpoint in the engine's format on shared storage, loaded by every engine
  (`rollout.weight_sync=disk`, and SGLang colocated until its CUDA-IPC path is proven on a GPU).

Every trainer rank runs the same updater (the updates are collectives).
"""

from __future__ import annotations

import shutil
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Protocol

import torch

from kimi_pipeline.recipes import Recipe


class TrainerRank(Protocol):
    """What an updater reads of a trainer rank (`rl.policy.PolicyWorker`)."""

    recipe: Recipe
    model: list[torch.nn.Module]
    layout: Any
    rank: int
    world_size: int
    qat: list[str]

    def sync_dir(self) -> Path: ...


class WeightSync(ABC):
    name: str

    def __init__(self, trainer: TrainerRank, router) -> None:
        from kimi_pipeline.quant.engine_format import engine_weight_format

        self.trainer, self.router, self.recipe = trainer, router, trainer.recipe
        self.format = engine_weight_format(self.recipe)
        # an INT4 engine dequantizes the packed stored weights to exactly the fake-quant ones
        self.fake_quant = bool(trainer.qat) and self.format != "int4"

    @abstractmethod
    def update(self, version: str) -> dict[str, float]:
        """Make the engines serve this rank's current weights as `version`; returns sync metrics."""

    def _engine_tensors(self, named):
        from kimi_pipeline.quant.engine_format import to_engine_format

        return to_engine_format(named, self.format, self.recipe.quant.group_size)

    def _policy_tensors(self, **kw):
        from kimi_pipeline.quant.policy_weights import policy_tensors

        r = self.recipe
        return policy_tensors(self.trainer.model[0], r.model, self.trainer.layout,
                              qat_group_size=r.quant.group_size if self.fake_quant else None, **kw)

    def _gathered_on_rank0(self):
        """HF tensors on rank 0 (each received from its holder); None on the other ranks, which must still
        take part in the gather."""
        named = self._policy_tensors(dst=0)
        if self.trainer.rank != 0:
            for _ in named:
                pass
            return None
        return self._engine_tensors(named)


class OwnedBuckets(WeightSync):
    """Rank 0 pauses the engines; every rank pushes the tensors it holds (TP-gathered) through its own
    shared-memory segment; once all are done rank 0 commits the version (an empty last bucket: the engines
    check that no quantized weight is incomplete) and resumes them."""

    name = "owned"

    def update(self, version: str) -> dict[str, float]:
        import torch.distributed as dist

        from kimi_pipeline.rl.engine.client import paused

        t0 = time.perf_counter()
        buffer = self.recipe.rollout.update_weight_buffer_size
        barrier = dist.barrier if self.trainer.world_size > 1 else (lambda: None)
        lead = self.trainer.rank == 0
        with paused(self.router, lead):
            barrier()
            chunks = self.router.update_weights(self._engine_tensors(self._policy_tensors(owned_only=True)), buffer,
                                                pause=False)
            barrier()
            if lead:
                self.router.update_weights([], buffer, weight_version=version, pause=False)
        return {"sync_seconds": time.perf_counter() - t0, "sync_chunks": float(chunks)}


class GatheredPush(WeightSync):
    name = "gathered"

    def update(self, version: str) -> dict[str, float]:
        t0 = time.perf_counter()
        named = self._gathered_on_rank0()
        chunks = 0
        if named is not None:
            chunks = self.router.update_weights(named, self.recipe.rollout.update_weight_buffer_size,
                                                weight_version=version)
        return {"sync_seconds": time.perf_counter() - t0, "sync_chunks": float(chunks or 0)}


class DiskCheckpoint(WeightSync):
    name = "disk"

    def update(self, version: str) -> dict[str, float]:
        t0 = time.perf_counter()
        named = self._gathered_on_rank0()
        if named is not None:
            path = self._write(named, version)
            self.router.update_weights_from_disk(str(path), weight_version=version)
        return {"sync_seconds": time.perf_counter() - t0, "sync_chunks": 1.0 if named is not None else 0.0}

    def _write(self, named, version: str) -> Path:
        """HF safetensors + config (with the engine format's quantization_config) under the trainer's sync dir;
        only the newest weights are kept."""
        from kimi_pipeline.model.hf_config import hf_config_dict
        from kimi_pipeline.quant.engine_format import engine_quant_config
        from kimi_pipeline.util.files import atomic_write_json
        from kimi_pipeline.util.shards import ShardWriter, finish_shards

        root = self.trainer.sync_dir()
        out, tmp = root / version, root / f"{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        finish_shards(tmp, ShardWriter(tmp, self.recipe.rollout.update_weight_buffer_size).add_all(named).close())
        config = hf_config_dict(self.recipe.model)
        if (qc := engine_quant_config(self.format, self.recipe.quant.group_size)) is not None:
            config["quantization_config"] = qc
        atomic_write_json(tmp / "config.json", config)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        for old in root.iterdir():
            if old != out:
                shutil.rmtree(old, ignore_errors=True)
        return out


def _all_engines_local(trainer: TrainerRank, router) -> bool:
    """Whether, on every rank, every engine reads buckets from this host's shared memory (agreed by all)."""
    import torch.distributed as dist

    local = router.weight_transport == "auto" and all(c.shares_memory() for c in router.clients)
    if trainer.world_size > 1:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        local = bool(flag.item())
    return local


def choose_weight_sync(trainer: TrainerRank, router) -> WeightSync:
    """The run's updater (collective: every trainer rank calls it with the same engines)."""
    from kimi_pipeline.rl.engine.kinds import engine_kind

    r, kind = trainer.recipe, engine_kind(trainer.recipe)
    if r.rollout.weight_sync == "disk" or (r.cluster.colocate and kind.colocated_updates_from_disk):
        return DiskCheckpoint(trainer, router)
    if kind.owned_bucket_updates and _all_engines_local(trainer, router):
        return OwnedBuckets(trainer, router)
    return GatheredPush(trainer, router)
