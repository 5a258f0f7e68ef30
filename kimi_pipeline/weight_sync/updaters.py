"""How trained weights reach the rollout engines: one updater per run (per set of engines), chosen once.

Megatron shards → HF names → the engine's own format (`weight_sync.formats`: INT4 pack-quantized, FP8
blocks + scales, or bf16) → every engine, in `rollout.update_weight_buffer_size` buckets:

- `GroupBuckets`: colocated (every K2 recipe, every step). Each bucket is assembled on every trainer rank by
  group collectives (`weight_sync.buckets`: pipeline broadcast, TP / EP all-gathers, flat per dtype) and handed
  to the engine rank on the same device: a CUDA-IPC handle to SGLang (`CudaIpcHandoff`), a shared-memory
  segment to the embedded engine (`SharedMemoryHandoff`).
- `PPStageSources`: not colocated: every pipeline stage assembles its own buckets and its source rank broadcasts
  them to the engines through the stage's own weight-update group (gloo / NCCL), one flat buffer per bucket.
- `DiskCheckpoint`: an HF checkpoint in the engine's format on shared storage, loaded by every engine
  (`rollout.weight_sync=disk`: the explicit fallback).

Every trainer rank runs the same updater (the updates are collectives).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from kimi_pipeline.hf.config import hf_config_dict
from kimi_pipeline.hf.names import HFLayout
from kimi_pipeline.model.hf_bridge import model_tensors, model_uses_te
from kimi_pipeline.model.qat import fake_quant_hf_tensors
from kimi_pipeline.recipes import Recipe
from kimi_pipeline.recipes.models import ModelSpec
from kimi_pipeline.util.files import atomic_write_json
from kimi_pipeline.util.net import LOOPBACK
from kimi_pipeline.util.rendezvous import gloo_on
from kimi_pipeline.util.shards import ShardWriter, finish_shards
from kimi_pipeline.weight_sync import shm
from kimi_pipeline.weight_sync.buckets import BucketSchedule, Groups, SyncCounters, gather_bucket, pp_stage_dtypes
from kimi_pipeline.weight_sync.cuda_ipc import build_update_request, serialize_bucket
from kimi_pipeline.weight_sync.dist_group import GROUP_NAME, WeightGroup
from kimi_pipeline.weight_sync.formats import EngineFormat, engine_quant_config, engine_weight_format, to_engine_format
from kimi_pipeline.weight_sync.push import paused, weight_update_session
from kimi_pipeline.weight_sync.turns import EngineTurns


@dataclass(frozen=True)
class SyncSections:
    """What the engines serve and how a trainer rank's weights reach them: resolved once on the driver from the
    rollout, sglang, cluster, quant and hub sections (`SyncSections.of`), so a trainer rank reads this, not them."""

    engine: str  # rollout.engine (`COLOCATED_HANDOFFS`)
    weight_format: EngineFormat  # rollout.engine_weight_format with `auto` resolved (`weight_sync.formats`)
    weight_sync: str  # rollout.weight_sync: "disk" forces the disk fallback
    buffer_bytes: int  # rollout.update_weight_buffer_size: one bucket
    group_size: int  # quant.group_size: INT4 groups (fake-quant and the engines' packed format)
    gpus_per_engine: int  # sglang.gpus_per_engine: the engine ranks a CUDA-IPC bucket goes to
    colocate: bool  # cluster.colocate: engines share the trainers' GPUs and hosts

    @classmethod
    def of(cls, recipe: Recipe) -> SyncSections:
        rollout, quant = recipe.rollout, recipe.quant
        return cls(engine=rollout.engine,
                   weight_format=engine_weight_format(rollout, quant.export_format, recipe.hub.source_format),
                   weight_sync=rollout.weight_sync, buffer_bytes=rollout.update_weight_buffer_size,
                   group_size=quant.group_size, gpus_per_engine=recipe.sglang.gpus_per_engine,
                   colocate=recipe.cluster.colocate)


class TrainerRank(Protocol):
    """What an updater reads of a trainer rank (`rl.policy.PolicyWorker`)."""

    target: SyncSections
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

    def close(self) -> None:
        """Close the engine client and free what the updater keeps for the run (no collective)."""
        self.router.close()

    def _engine_tensors(self, named):
        """The trainer's tensors as the engines' checkpoint stores them: its format, under its names (K2.5's
        `language_model.` prefix, which SGLang's K2.5 model loads)."""

        return self.trainer.hf_layout.stored_items(to_engine_format(named, self.format, self.target.group_size))


def _schedule(trainer: TrainerRank, groups: Groups) -> BucketSchedule:
    """The run's bucket schedule, with every stage's tensors' own dtypes (one exchange over the pipeline group)."""
    model = trainer.model[0]
    tensors = model_tensors(model)
    dtype = next(t.dtype for n, t in tensors.items() if not n.endswith("expert_bias"))
    return BucketSchedule.build(trainer.spec, trainer.layout, buffer_bytes=trainer.target.buffer_bytes, dtype=dtype,
                            use_te=model_uses_te(model), pp_stage_dtypes=pp_stage_dtypes(tensors, groups))


class WeightHandoff(ABC):
    """How a rank hands a bucket it holds whole to the engine rank on its own device, and what ends a sync."""

    collectives_per_bucket = 0  # collectives `send` issues (over an engine's ranks)
    failed: Exception | None = None  # the first post to the engine that failed in this sync

    def post(self, call: Callable[[], Any]) -> None:
        """One call to the engine, unless one already failed in this sync. A failure is kept, not raised: the
        other ranks are in this bucket's collectives and will be in the next ones, so every rank drains the sync
        and it is raised after the last barrier (`GroupBuckets.update`); raised here, it would leave them waiting
        in a collective this rank never joins."""
        if self.failed is None:
            try:
                call()
            except Exception as e:  # noqa: BLE001 - any failure: kept whole and raised after the drain
                self.failed = e

    @abstractmethod
    def send(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket, in the engine's format and names (every rank calls it for every bucket)."""

    def commit(self, version: str) -> None:
        """After the last bucket, on every rank, before rank 0 ends the weight-update session."""

    def close(self) -> None:
        """Free what the handoff keeps for the run (no collective)."""


class SharedMemoryHandoff(WeightHandoff):
    """The embedded engine (CPU): the first trainer rank of each engine's ranks writes the bucket into its
    shared-memory segment (`weight_sync/shm.py`) and posts the descriptor to that engine alone; the engine's other
    ranks hold the same bucket and send nothing (one embedded process reads it once, where each SGLang TP rank
    takes its own copy). Colocated engine e covers trainer ranks [e x R, (e + 1) x R), R = world / engines
    (`cluster.placement`: engines take the trainers' devices in order; on CPU one engine per node)."""

    def __init__(self, trainer: TrainerRank, router) -> None:
        n_engines = len(router.clients)
        if trainer.world_size % n_engines:
            raise ValueError(f"{n_engines} colocated engines do not divide {trainer.world_size} trainer ranks")
        engine, offset = divmod(trainer.rank, trainer.world_size // n_engines)
        self.client = router.clients[engine] if offset == 0 else None
        self.segment = shm.SharedBucket() if self.client is not None else None

    def send(self, named: list[tuple[str, torch.Tensor]]) -> None:
        if self.client is not None:
            self.post(lambda: self.client.post_weight_chunk(json.dumps(self.segment.write_bucket(dict(named))), None,
                                                            shm.LOAD_FORMAT))

    def commit(self, version: str) -> None:
        """An empty bucket carries the version: the engine checks that no quantized weight is incomplete and
        flushes its cache (`engine/server.py`)."""
        if self.client is not None:
            self.post(lambda: self.client.post_weight_chunk(json.dumps(self.segment.write_bucket({})), version,
                                                            shm.LOAD_FORMAT))

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class CudaIpcHandoff(WeightHandoff):
    """SGLang colocated: each rank serializes the bucket as a CUDA-IPC handle (`cuda_ipc.py`, SGLang's
    "flattened_bucket" format) for the SGLang TP rank on its own GPU; the rank on the engine's TP-rank-0 GPU
    gathers its engine's entries (one per TP rank, in TP order, over a gloo group of the engine's ranks) and
    posts one `/update_weights_from_tensor`; the engine's ranks then wait for each other before the bucket's
    buffers may go (miles `update_weight_from_tensor.py`: `gather_object` of the handles to the engine's first
    rank, a barrier after the engine answered). Colocated engine e's TP rank i is trainer rank e x g + i
    (`cluster.placement`). GPU only: CUDA-IPC handles need CUDA tensors."""

    collectives_per_bucket = 2  # the handles' gather and the engine group's barrier

    def __init__(self, trainer: TrainerRank, router) -> None:
        g = trainer.target.gpus_per_engine
        if trainer.world_size % g:
            raise ValueError(f"engines of {g} GPUs do not divide {trainer.world_size} trainer ranks")
        self.gpus, (engine, self.tp_rank) = g, divmod(trainer.rank, g)
        # one gloo group per engine for the entries (strings), made by every rank in the same order; on loopback when
        # the trainers' rendezvous is (`util.rendezvous.gloo_on`)
        with gloo_on(os.environ.get("MASTER_ADDR", LOOPBACK)):
            groups = [dist.new_group(list(range(e * g, (e + 1) * g)), backend="gloo")
                      for e in range(trainer.world_size // g)]
        self.group, self.lead, self.router = groups[engine], engine * g, router
        self.rank0 = trainer.rank == 0
        self.client = router.clients[engine] if self.tp_rank == 0 else None

    def send(self, named: list[tuple[str, torch.Tensor]]) -> None:
        entries = [None] * self.gpus if self.client is not None else None
        dist.gather_object(serialize_bucket(named), entries, dst=self.lead, group=self.group)
        if self.client is not None:
            self.post(lambda: self.client.post_tensor_request(build_update_request(entries)))
        dist.barrier(group=self.group)  # the engine has loaded the bucket: its IPC buffers may go
        torch.cuda.ipc_collect()

    def commit(self, version: str) -> None:
        """One cache flush and the version after the last bucket, for every engine (from rank 0, which holds the
        session open: control calls, no weights)."""
        if self.rank0:
            self.post(self.router.flush_cache)
            self.post(lambda: self.router.update_weight_version(version))


class GroupBuckets(WeightSync):
    """Colocated sync, as the recipes' framework does it at 256 GPUs: bucket by bucket, every trainer rank
    assembles the full HF tensors of the bucket from group collectives (`weight_sync.buckets`: a broadcast over
    the pipeline group, all-gathers over TP and EP, one flat buffer per dtype), converts them to the engines'
    format and names on its own device, and hands them to the engine rank on the same device (`WeightHandoff`). No
    rank receives more than the model once and none sends it to all; the collectives per sync are bounded by
    buckets x dtypes x groups (`sync_collectives` in the metrics row)."""

    name = "group_buckets"

    def __init__(self, trainer: TrainerRank, router, handoff: WeightHandoff) -> None:
        super().__init__(trainer, router)
        self.groups = Groups.current()
        self.schedule = _schedule(trainer, self.groups)
        self.handoff = handoff

    def update(self, version: str) -> dict[str, float]:
        t0 = time.perf_counter()
        lead = self.trainer.rank == 0
        world = self.trainer.world_size > 1
        counters = SyncCounters()
        tensors = model_tensors(self.trainer.model[0])  # live parameters: read, never copied whole
        self.handoff.failed = None
        with paused(self.router, lead), weight_update_session(self.router, lead):
            if world:  # no rank hands over a bucket before rank 0 paused the engines and opened the session
                dist.barrier()
            for bucket in self.schedule.buckets:
                named = gather_bucket(bucket, tensors, self.groups, self.trainer.device, counters)
                if self.fake_quant:
                    named = fake_quant_hf_tensors(named, self.target.group_size)
                self.handoff.send(list(self._engine_tensors(named)))
            self.handoff.commit(version)
            if world:  # every engine has every bucket before rank 0 ends the session
                dist.barrier()
            if self.handoff.failed is not None:  # drained: no rank is left in a collective
                raise self.handoff.failed
        collectives = counters.total + len(self.schedule.buckets) * self.handoff.collectives_per_bucket + 2 * world
        return {"sync_seconds": time.perf_counter() - t0, "sync_chunks": float(counters.buckets),
                "sync_collectives": float(collectives), "sync_received_bytes": float(counters.received_bytes)}

    def close(self) -> None:
        self.handoff.close()
        super().close()


class PPStageSources(WeightSync):
    """Not colocated, as the recipes' framework does it (radixark/miles
    `update_weight_from_distributed/broadcast.py`: a group "miles-pp_{pp_rank}" per stage, only DP = TP = 0
    broadcasts): every pipeline stage at once assembles its own buckets (TP and EP all-gathers inside the stage,
    `weight_sync.buckets`, no pipeline broadcast), and the stage's source rank (TP = CP = DP = 0) sends each
    bucket through its own weight-update group with every engine rank, as one flat buffer and one broadcast
    (SGLang's `load_format: "flattened_bucket"`). Sources take turns at the engines (`turns.EngineTurns`), which
    avoids the deadlock of two groups' broadcasts entered in different orders by different engines; a stage's
    gathering overlaps the other stages' sending. Rank 0 pauses the engines, holds the weight-update session and
    sets the version after the last bucket."""

    name = "pp_stage_sources"

    def __init__(self, trainer: TrainerRank, router) -> None:
        super().__init__(trainer, router)
        self.groups = Groups.current()
        self.schedule = _schedule(trainer, self.groups)
        self.source = self.groups.pp_stage_source
        self.turns = EngineTurns("kimi-weight-sync/engine-turns")
        self.group: WeightGroup | None = None  # this stage's weight-update group, made at the first sync
        self.pool: ThreadPoolExecutor | None = None  # the group's concurrent engine calls

    def update(self, version: str) -> dict[str, float]:
        t0 = time.perf_counter()
        lead = self.trainer.rank == 0
        world = self.trainer.world_size > 1
        counters = SyncCounters()
        tensors = model_tensors(self.trainer.model[0])
        sent = 0
        with paused(self.router, lead), weight_update_session(self.router, lead):
            if world:
                dist.barrier()
            if self.source and self.group is None:
                with self.turns:  # every engine joins one group at a time (a join blocks until all have joined)
                    self.group = self._join()
            for bucket in self.schedule.pp_stage_buckets(self.groups.pp_rank):
                named = gather_bucket(bucket, tensors, self.groups, self.trainer.device, counters, across_pp_stages=False)
                if self.source:
                    if self.fake_quant:
                        named = fake_quant_hf_tensors(named, self.target.group_size)
                    converted = list(self._engine_tensors(named))
                    with self.turns:
                        sent += self.group.send_flattened(converted, None)
                else:
                    for _ in named:  # the gathers are collectives: every rank of the stage drains them
                        pass
            if world:  # every stage's buckets are in before the version moves
                dist.barrier()
            if lead:
                self.router.flush_cache()
                self.router.update_weight_version(version)
        return {"sync_seconds": time.perf_counter() - t0, "sync_chunks": float(counters.buckets),
                "sync_collectives": float(counters.total + 2 * world),
                "sync_received_bytes": float(counters.received_bytes), "sync_sent_bytes": float(sent)}

    def _join(self) -> WeightGroup:
        """This stage's group: the source as rank 0, then every engine's ranks (SGLang: one per GPU, from the
        engine's tp_size x pp_size)."""
        clients = self.router.clients
        sizes = [int(c.server_info().get("tp_size", 1)) * int(c.server_info().get("pp_size", 1)) for c in clients]
        self.pool = ThreadPoolExecutor(max_workers=max(4, len(clients)), thread_name_prefix="weight-sync")
        return WeightGroup(clients, self.pool, backend="nccl" if self.trainer.device.type == "cuda" else "gloo",
                           ranks_per_engine=sizes, name=f"{GROUP_NAME}-pp{self.groups.pp_rank}")

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        super().close()


class DiskCheckpoint(WeightSync):
    """`rollout.weight_sync=disk`, the explicit fallback: an HF checkpoint in the engines' format on shared storage,
    written the way the distributed INT4 export writes (no rank holds the model): every pipeline stage assembles
    its own buckets (`PPStageSources`' gathers) and its source rank writes them as safetensors shards; rank 0 names
    the shards, writes the index and config last, renames the directory into place and has every engine load it."""

    name = "disk"

    def __init__(self, trainer: TrainerRank, router) -> None:
        super().__init__(trainer, router)
        self.groups = Groups.current()
        self.schedule = _schedule(trainer, self.groups)

    def update(self, version: str) -> dict[str, float]:
        t0 = time.perf_counter()
        lead, world = self.trainer.rank == 0, self.trainer.world_size > 1
        root = self.trainer.sync_dir()
        out, tmp = root / version, root / f"{version}.tmp"
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if world:
            dist.barrier()
        counters = SyncCounters()
        pp_rank = self.groups.pp_rank
        source = self.groups.pp_stage_source
        writer = ShardWriter(tmp, self.target.buffer_bytes, prefix=f".pp{pp_rank}") if source else None
        tensors = model_tensors(self.trainer.model[0])
        for bucket in self.schedule.pp_stage_buckets(pp_rank):
            named = gather_bucket(bucket, tensors, self.groups, self.trainer.device, counters, across_pp_stages=False)
            if writer is None:
                for _ in named:  # the gathers are collectives: every rank of the stage drains them
                    pass
                continue
            if self.fake_quant:
                named = fake_quant_hf_tensors(named, self.target.group_size)
            writer.add_all(self._engine_tensors(named))
        shards = writer.close() if writer is not None else []
        every = [shards]
        if world:  # the shard names (metadata, not tensors) to rank 0
            every = [None] * self.trainer.world_size if lead else None
            dist.gather_object(shards, every, dst=0)
        if lead:
            self._finish(tmp, out, [s for rank_shards in every for s in rank_shards])
            self.router.update_weights_from_disk(str(out), weight_version=version)
        if world:  # every engine loaded it before any rank goes on
            dist.barrier()
        return {"sync_seconds": time.perf_counter() - t0, "sync_chunks": float(counters.buckets),
                "sync_collectives": float(counters.total + 3 * world),
                "sync_received_bytes": float(counters.received_bytes)}

    def _finish(self, tmp: Path, out: Path, shards: list) -> None:
        """Index and config (with the engine format's quantization_config) last, then the directory into place;
        only the newest weights are kept."""
        finish_shards(tmp, shards)
        config = hf_config_dict(self.trainer.spec)
        if (qc := engine_quant_config(self.format, self.target.group_size)) is not None:
            config["quantization_config"] = qc
        atomic_write_json(tmp / "config.json", config)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        for old in out.parent.iterdir():
            if old != out:
                shutil.rmtree(old, ignore_errors=True)


def _all_engines_local(trainer: TrainerRank, router) -> bool:
    """Whether, on every rank, every engine reads buckets from this host's shared memory (agreed by all)."""

    local = router.weight_transport == "auto" and all(c.shares_memory() for c in router.clients)
    if trainer.world_size > 1:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        local = bool(flag.item())
    return local


# How a colocated engine of each kind (`rollout.engine`) takes a bucket from the trainer rank on its device.
COLOCATED_HANDOFFS: dict[str, type[WeightHandoff]] = {"embedded": SharedMemoryHandoff, "sglang": CudaIpcHandoff}


def choose_weight_sync(trainer: TrainerRank, router) -> WeightSync:
    """The run's updater (collective: every trainer rank calls it with the same engines)."""

    target = trainer.target
    if target.weight_sync == "disk":
        return DiskCheckpoint(trainer, router)
    handoff = COLOCATED_HANDOFFS[target.engine] if target.colocate else None
    # an embedded engine reads the bucket from this host's shared memory: every engine must be on it
    if handoff is SharedMemoryHandoff and not _all_engines_local(trainer, router):
        handoff = None
    if handoff is not None:
        return GroupBuckets(trainer, router, handoff(trainer, router))
    return PPStageSources(trainer, router)
