"""How trained weights reach the rollout engines: one updater per run (per set of engines), chosen once.

Megatron shards → HF names → the engine's own format (`quant.engine_format`: INT4 pack-quantized, FP8
blocks + scales, or bf16) → every engine, in `rollout.update_weight_buffer_size` buckets:

- `OwnedBuckets`: colocated on one host (every engine reads this host's shared memory): each trainer rank
  sends the buckets it holds itself, never broadcast to the other ranks.
- `GatheredPush`: rank 0 receives each tensor from its holder and sends it (shared memory, the weight-update
  process group — gloo / NCCL — or safetensors bodies; the engine client picks per engine).
- `CudaIpcBuckets`: SGLang colocated: each trainer rank hands each bucket to the engine rank on its own GPU as a
  CUDA-IPC handle (`/update_weights_from_tensor`, SGLang's serializer format, `engine/cuda_ipc.py`).
- `DiskCheckpoint`: an HF checkpoint in the engine's format on shared storage, loaded by every engine
  (`rollout.weight_sync=disk`: the explicit fallback).

Every trainer rank runs the same updater (the updates are collectives).
"""

from __future__ import annotations

import shutil
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from kimi_pipeline.convert.names import HFLayout
from kimi_pipeline.engine.client import chunk_named_tensors, paused, weight_update_session
from kimi_pipeline.engine.cuda_ipc import build_update_request, serialize_bucket
from kimi_pipeline.engine.dist_update import dtype_from_name
from kimi_pipeline.engine.kinds import engine_kind
from kimi_pipeline.model.hf_config import hf_config_dict
from kimi_pipeline.quant.engine_format import EngineFormat, engine_quant_config, engine_weight_format, to_engine_format
from kimi_pipeline.quant.policy_weights import policy_tensors
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.recipes.models import ModelSpec
from kimi_pipeline.util.files import atomic_write_json
from kimi_pipeline.util.shards import ShardWriter, finish_shards


@dataclass(frozen=True)
class SyncTarget:
    """What the engines serve and how a trainer rank's weights reach them: resolved once on the driver from the
    rollout, sglang, cluster, quant and hub sections (`SyncTarget.of`), so a trainer rank reads this, not them."""

    engine: str  # rollout.engine (`engine.kinds.engine_kind`)
    weight_format: EngineFormat  # rollout.engine_weight_format with `auto` resolved (`quant.engine_format`)
    weight_sync: str  # rollout.weight_sync: "disk" forces the disk fallback
    buffer_bytes: int  # rollout.update_weight_buffer_size: one bucket
    group_size: int  # quant.group_size: INT4 groups (fake-quant and the engines' packed format)
    gpus_per_engine: int  # sglang.gpus_per_engine: the engine ranks a CUDA-IPC bucket goes to
    colocate: bool  # cluster.colocate: engines share the trainers' GPUs and hosts

    @classmethod
    def of(cls, recipe: Recipe) -> SyncTarget:
        rollout, quant = recipe.rollout, recipe.quant
        return cls(engine=rollout.engine,
                   weight_format=engine_weight_format(rollout, quant.export_format, recipe.hub.source_format),
                   weight_sync=rollout.weight_sync, buffer_bytes=rollout.update_weight_buffer_size,
                   group_size=quant.group_size, gpus_per_engine=recipe.sglang.gpus_per_engine,
                   colocate=recipe.cluster.colocate)


class TrainerRank(Protocol):
    """What an updater reads of a trainer rank (`rl.policy.PolicyWorker`)."""

    target: SyncTarget
    spec: ModelSpec
    model: list[torch.nn.Module]
    layout: Any
    rank: int
    world_size: int
    qat: list[str]
    device: torch.device
    hf_layout: HFLayout  # how the engines' checkpoint names the language model

    def sync_dir(self) -> Path: ...


class WeightSync(ABC):
    name: str

    def __init__(self, trainer: TrainerRank, router) -> None:
        self.trainer, self.router, self.target = trainer, router, trainer.target
        self.format = self.target.weight_format
        # an INT4 engine dequantizes the packed stored weights to exactly the fake-quant ones
        self.fake_quant = bool(trainer.qat) and self.format != "int4"

    @abstractmethod
    def update(self, version: str) -> dict[str, float]:
        """Make the engines serve this rank's current weights as `version`; returns sync metrics."""

    def _engine_tensors(self, named):
        """The trainer's tensors as the engines' checkpoint stores them: its format, under its names (K2.5's
        `language_model.` prefix, which SGLang's K2.5 model loads)."""

        return self.trainer.hf_layout.stored_items(to_engine_format(named, self.format, self.target.group_size))

    def _policy_tensors(self, **kw):
        return policy_tensors(self.trainer.model[0], self.trainer.spec, self.trainer.layout,
                              qat_group_size=self.target.group_size if self.fake_quant else None, **kw)

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
    """Rank 0 pauses the engines and opens their weight-update session; every rank pushes the tensors it holds
    (TP-gathered) through its own shared-memory segment; once all are done rank 0 commits the version (an empty
    last bucket: the engines check that no quantized weight is incomplete), ends the session and resumes them."""

    name = "owned"

    def update(self, version: str) -> dict[str, float]:
        t0 = time.perf_counter()
        buffer = self.target.buffer_bytes
        barrier = dist.barrier if self.trainer.world_size > 1 else (lambda: None)
        lead = self.trainer.rank == 0
        with paused(self.router, lead), weight_update_session(self.router, lead):
            barrier()
            chunks = self.router.update_weights(self._engine_tensors(self._policy_tensors(owned_only=True)), buffer,
                                                pause=False, session=False)
            barrier()
            if lead:
                self.router.update_weights([], buffer, weight_version=version, pause=False, session=False)
        return {"sync_seconds": time.perf_counter() - t0, "sync_chunks": float(chunks)}


class GatheredPush(WeightSync):
    name = "gathered"

    def update(self, version: str) -> dict[str, float]:
        t0 = time.perf_counter()
        named = self._gathered_on_rank0()
        chunks = 0
        if named is not None:
            chunks = self.router.update_weights(named, self.target.buffer_bytes,
                                                weight_version=version)
        return {"sync_seconds": time.perf_counter() - t0, "sync_chunks": float(chunks or 0)}


class CudaIpcBuckets(WeightSync):
    """SGLang colocated, as the seeds' framework syncs it: every trainer rank holds each bucket on its own GPU and
    hands it, as a CUDA-IPC handle (`engine/cuda_ipc.py`, SGLang's "flattened_bucket" format), to the engine rank
    on that GPU; the trainer rank on each engine's TP-rank-0 GPU gathers its engine's entries (one per TP rank, in
    TP order) and posts one `/update_weights_from_tensor`, inside the weight-update session rank 0 opened.

    Rank 0 gathers each tensor from its holder (`_gathered_on_rank0`) and broadcasts the bucket to every rank over
    the trainer's own group (NCCL): the bytes never leave the GPUs. Colocated engine e's TP rank i is trainer rank
    e x gpus_per_engine + i (`cluster.placement`: engines take the trainers' GPUs in order). GPU only: CUDA-IPC
    handles need CUDA tensors; on CPU the embedded engine reads shared memory (`OwnedBuckets`) instead, and
    `rollout.weight_sync=disk` stays the explicit fallback. Written from SGLang 0.5.23's source; see README's GPU
    status table for what has run on a GPU."""

    name = "cuda_ipc"

    def __init__(self, trainer: TrainerRank, router) -> None:
        super().__init__(trainer, router)
        g = self.target.gpus_per_engine
        self.engine_index, self.tp_rank = divmod(trainer.rank, g)
        # one gloo group per engine for the entries (strings), made by every rank in the same order
        groups = [dist.new_group(list(range(e * g, (e + 1) * g)), backend="gloo")
                  for e in range(trainer.world_size // g)]
        self.group, self.lead = groups[self.engine_index], self.engine_index * g
        self.client = router.clients[self.engine_index] if self.tp_rank == 0 else None

    def update(self, version: str) -> dict[str, float]:
        t0 = time.perf_counter()
        lead = self.trainer.rank == 0
        named = self._gathered_on_rank0()
        chunks = iter(chunk_named_tensors(named, self.target.buffer_bytes)) if lead else None
        count = 0
        with paused(self.router, lead), weight_update_session(self.router, lead):
            while (bucket := self._next_bucket(chunks)) is not None:
                entries = [None] * self.target.gpus_per_engine if self.client is not None else None
                dist.gather_object(serialize_bucket(list(bucket.items())), entries, dst=self.lead, group=self.group)
                if self.client is not None:
                    self.client.post_tensor_request(build_update_request(entries))
                dist.barrier()  # every engine has loaded the bucket: its IPC buffers may go
                del bucket
                torch.cuda.ipc_collect()
                count += 1
            if lead:  # one cache flush and the version after the last bucket
                self.router.flush_cache()
                self.router.update_weight_version(version)
        return {"sync_seconds": time.perf_counter() - t0, "sync_chunks": float(count)}

    def _next_bucket(self, chunks) -> dict[str, torch.Tensor] | None:
        """The next bucket on every rank (rank 0's, broadcast over the trainers' group); None after the last."""

        chunk = next(chunks, None) if chunks is not None else None
        header = [[(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in chunk.items()]
                  if chunk is not None else None]
        dist.broadcast_object_list(header, src=0)
        if header[0] is None:
            return None
        out = {}
        for name, dtype, shape in header[0]:
            t = (chunk[name].to(self.trainer.device).contiguous() if chunk is not None
                 else torch.empty(shape, dtype=dtype_from_name(dtype), device=self.trainer.device))
            dist.broadcast(t, src=0)
            out[name] = t
        return out


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

        root = self.trainer.sync_dir()
        out, tmp = root / version, root / f"{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        finish_shards(tmp, ShardWriter(tmp, self.target.buffer_bytes).add_all(named).close())
        config = hf_config_dict(self.trainer.spec)
        if (qc := engine_quant_config(self.format, self.target.group_size)) is not None:
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

    local = router.weight_transport == "auto" and all(c.shares_memory() for c in router.clients)
    if trainer.world_size > 1:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        local = bool(flag.item())
    return local


def choose_weight_sync(trainer: TrainerRank, router) -> WeightSync:
    """The run's updater (collective: every trainer rank calls it with the same engines)."""

    target = trainer.target
    kind = engine_kind(target.engine)
    if target.weight_sync == "disk":
        return DiskCheckpoint(trainer, router)
    if target.colocate and kind.colocated_updates_by_cuda_ipc:
        return CudaIpcBuckets(trainer, router)
    if kind.owned_bucket_updates and _all_engines_local(trainer, router):
        return OwnedBuckets(trainer, router)
    return GatheredPush(trainer, router)
