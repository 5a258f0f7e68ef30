"""The trained weights as full HF tensors on every trainer rank, bucket by bucket, moved by group collectives.

What the recipes' framework does for a colocated sync (radixark/miles
`miles/backends/megatron_utils/update_weight/update_weight_from_tensor.py` and `hf_weight_iterator_direct.py`:
per bucket, broadcast over the pipeline group, all-gather over the expert and tensor groups, convert to HF on
every GPU), with one flattened buffer per dtype per collective instead of one collective per tensor:

1. **Plan** (`BucketSchedule.build`, the same on every rank, computed from the model spec and the layout alone: no
   metadata exchange). A *unit* is what moves together: a dense tensor of one pipeline stage (each TP rank holds
   a slice or a copy), or local expert `j` of one MoE layer (EP rank `k` holds HF expert `k * E/ep + j`). Units
   are cut into buckets of at most `rollout.update_weight_buffer_size` bytes of full HF tensors, a bucket never
   spanning two stages (one broadcast source per bucket); a unit larger than the buffer is a bucket of its own.
2. **Collectives per bucket**, issued by every rank in the same order, each on one flat buffer per dtype:
   - the stage holding the bucket broadcasts its ranks' local shards over the pipeline group (PP > 1): every
     pipeline group has its own source, the rank of that stage with the receiver's TP/EP coordinates, so no
     rank sends the model to everyone (megatron builds the pipeline group across stages at fixed TP, CP, DP
     and EP coordinates: `megatron/core/parallel_state.py`, `RankGenerator` with order "tp-cp-ep-dp-pp",
     pp outermost in both the dense and the expert decomposition);
   - TP-split dense shards are all-gathered over the TP group (TP > 1);
   - expert shards are all-gathered over the EP group (EP > 1), then over the expert-TP group (ETP > 1).
3. Every rank rebuilds the HF tensors of the bucket on its own device (`hf.names.hf_from_gathered`:
   the GLU de-interleave, the TP concatenation) and hands them to the engine rank on its GPU.

So a sync issues at most buckets x dtypes x (PP + TP + EP + ETP) collectives whatever the tensor count, and
each rank receives at most the model's bytes once (`BucketSchedule.collectives`, `BucketSchedule.received_bytes`:
the model `kimi plan` prints). NCCL needs the same collectives in the same order on every member of a group,
with the same sizes: the schedule is computed identically everywhere, and every rank runs every collective of
every bucket (a rank of another stage receives, it never skips).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kimi_pipeline.hf.names import NameMappingError, Shard, hf_from_gathered, hf_shapes, hf_to_megatron_names
from kimi_pipeline.recipes.layout import Layout
from kimi_pipeline.recipes.models import ModelSpec

GROUPS = ("pp", "tp", "ep", "etp")


@dataclass(frozen=True)
class Unit:
    """Tensors that move together. Dense: `shards` holds one Shard (TP rank 0's view; every TP rank's slice has
    the same shape). Expert: one Shard per EP rank, in EP order (the same megatron name, different HF experts)."""

    stage: int
    expert: bool
    shards: tuple[Shard, ...]
    local_shape: tuple[int, ...]  # the megatron tensor one rank holds
    dtype: torch.dtype
    hf_bytes: int  # bytes of the full HF tensors the unit yields

    @property
    def megatron(self) -> str:
        return self.shards[0].megatron

    @property
    def split(self) -> bool:
        return self.shards[0].split

    @property
    def local_numel(self) -> int:
        n = 1
        for d in self.local_shape:
            n *= d
        return n


@dataclass(frozen=True)
class Bucket:
    stage: int
    units: tuple[Unit, ...]

    @property
    def hf_bytes(self) -> int:
        return sum(u.hf_bytes for u in self.units)

    def dtypes(self, units: Sequence[Unit] | None = None) -> list[torch.dtype]:
        """The dtypes of `units` (default: all) in first-seen order: one flat buffer each."""
        seen: dict[torch.dtype, None] = {}
        for u in self.units if units is None else units:
            seen.setdefault(u.dtype, None)
        return list(seen)

    @property
    def tp_units(self) -> list[Unit]:
        return [u for u in self.units if not u.expert and u.split]

    @property
    def expert_units(self) -> list[Unit]:
        return [u for u in self.units if u.expert]

    @property
    def etp_units(self) -> list[Unit]:
        """The expert units gathered over the expert-TP group: every expert unit of a dtype that has a split one
        (one flat buffer per dtype)."""
        split = {u.dtype for u in self.expert_units if u.split}
        return [u for u in self.expert_units if u.dtype in split]


@dataclass(frozen=True)
class Groups:
    """This rank's process groups and coordinates (megatron's `parallel_state`); sizes of 1 issue nothing."""

    pp: object = None
    tp: object = None
    ep: object = None
    etp: object = None
    pp_rank: int = 0
    sizes: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(GROUPS, 1))
    pp_stage_source: bool = True  # TP = CP = DP = 0 of its stage: the rank that talks to the engines for the stage

    @classmethod
    def current(cls) -> Groups:
        from megatron.core import parallel_state as ps  # megatron stays out of the modules that never train

        return cls(pp=ps.get_pipeline_model_parallel_group(), tp=ps.get_tensor_model_parallel_group(),
                   ep=ps.get_expert_model_parallel_group(), etp=ps.get_expert_tensor_parallel_group(),
                   pp_rank=ps.get_pipeline_model_parallel_rank(),
                   pp_stage_source=(ps.get_tensor_model_parallel_rank() == 0
                                 and ps.get_data_parallel_rank(with_context_parallel=True) == 0),
                   sizes={"pp": ps.get_pipeline_model_parallel_world_size(),
                          "tp": ps.get_tensor_model_parallel_world_size(),
                          "ep": ps.get_expert_model_parallel_world_size(),
                          "etp": ps.get_expert_tensor_parallel_world_size()})


@dataclass
class SyncCounters:
    """What one rank's sync moved: collectives issued (by group) and bytes received through them."""

    collectives: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0))
    received_bytes: int = 0
    buckets: int = 0

    @property
    def total(self) -> int:
        return sum(self.collectives.values())


def pp_stage_dtypes(tensors: Mapping[str, torch.Tensor], groups: Groups) -> list[dict[str, torch.dtype]]:
    """Every stage's tensors' dtypes by megatron name, on every rank: one object all-gather over the pipeline group,
    once per run (slime and miles exchange their parameter infos the same way before the first sync); the
    ranks of a stage hold the same names and dtypes whatever their TP / EP coordinates."""
    mine = {name: str(t.dtype).removeprefix("torch.") for name, t in tensors.items()}
    if groups.sizes["pp"] == 1:
        every = [mine]
    else:
        every = [None] * groups.sizes["pp"]
        dist.all_gather_object(every, mine, group=groups.pp)
    return [{name: getattr(torch, dt) for name, dt in stage.items()} for stage in every]


def _local_shape(shard: Shard, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The megatron tensor's shape on one rank, from the HF shapes: `hf.names.shard_from_hf`'s cut (a slice
    along `dim` per TP rank; a GLU's gate and up slices concatenated along dim 0), without tensors."""
    parts = []
    for name in shard.hf:
        shape = list(shapes[name])
        if shard.split:
            if shape[shard.dim] % shard.size:
                raise NameMappingError(f"{name}: dim {shard.dim} of {tuple(shape)} does not split into {shard.size}")
            shape[shard.dim] //= shard.size
        parts.append(shape)
    if len(parts) == 2:
        return (parts[0][0] + parts[1][0], *parts[0][1:])
    return tuple(parts[0])


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class BucketSchedule:
    """Every bucket of a sync, in order, for a model spec and layout; identical on every rank."""

    buckets: tuple[Bucket, ...]
    layout: Layout

    @classmethod
    def build(cls, spec: ModelSpec, layout: Layout, *, buffer_bytes: int, dtype: torch.dtype, use_te: bool,
              pp_stage_dtypes: Sequence[Mapping[str, torch.dtype]] | None = None) -> BucketSchedule:
        """`dtype`: the trainer's parameter dtype (the expert bias stays fp32 whatever it is), unless
        `pp_stage_dtypes` gives each stage's tensors' own dtypes by megatron name (`pp_stage_dtypes()`: a model may keep
        its norms in fp32 beside bf16 weights, as megatron's local layer spec does on CPU)."""
        if buffer_bytes <= 0:
            raise ValueError(f"update_weight_buffer_size must be > 0, got {buffer_bytes}")
        layout.check_model(spec)
        shapes = hf_shapes(spec)
        buckets: list[Bucket] = []
        for stage in range(layout.pp):
            units = cls._pp_stage_units(spec, layout, stage, shapes, dtype, use_te,
                                     pp_stage_dtypes[stage] if pp_stage_dtypes is not None else None)
            current: list[Unit] = []
            size = 0
            for u in units:
                if current and size + u.hf_bytes > buffer_bytes:
                    buckets.append(Bucket(stage, tuple(current)))
                    current, size = [], 0
                current.append(u)
                size += u.hf_bytes
            if current:
                buckets.append(Bucket(stage, tuple(current)))
        return cls(tuple(buckets), layout)

    @staticmethod
    def _pp_stage_units(spec: ModelSpec, layout: Layout, stage: int, shapes, dtype: torch.dtype, use_te: bool,
                     dtypes: Mapping[str, torch.dtype] | None) -> list[Unit]:
        per_ep = [hf_to_megatron_names(spec, layout, stage, k, use_te=use_te) for k in range(layout.ep)]
        units: list[Unit] = []

        def dtype_of(s: Shard) -> torch.dtype:
            if dtypes is not None:
                if s.megatron not in dtypes:
                    raise NameMappingError(f"{s.megatron}: not in stage {stage}'s model (spec and layout disagree "
                                           "with the model)")
                return dtypes[s.megatron]
            return torch.float32 if s.fp32 else dtype

        experts = [[s for s in shards if s.expert] for shards in per_ep]
        for s in per_ep[0]:
            if s.expert:
                continue
            if spec.tie_word_embeddings and s.megatron == "output_layer.weight":
                continue  # the last stage's tied copy of the embedding is not sent twice
            dt = dtype_of(s)
            units.append(Unit(stage, False, (s,), _local_shape(s, shapes), dt,
                              sum(_nbytes(shapes[n], dt) for n in s.hf)))
        for column in zip(*experts):  # local expert slot j of a layer on every EP rank
            dt = dtype_of(column[0])
            units.append(Unit(stage, True, tuple(column), _local_shape(column[0], shapes), dt,
                              sum(_nbytes(shapes[n], dt) for s in column for n in s.hf)))
        # experts after the dense tensors of their stage would put a whole stage's experts in the last buckets;
        # keep the model's order instead (layer by layer), which is the order of the per-EP lists
        order = {s.megatron: i for i, s in enumerate(per_ep[0])}
        return sorted(units, key=lambda u: order[u.megatron])

    # ------------------------------------------------------------------ the model of the cost
    def collectives(self, stage: int | None = None) -> dict[str, int]:
        """Collectives one rank issues per sync, by group: the colocated path (every rank, every bucket), or with
        `stage` the non-colocated one (that stage's buckets, no pipeline broadcast)."""
        sizes = {"pp": self.layout.pp if stage is None else 1, "tp": self.layout.tp, "ep": self.layout.ep,
                 "etp": self.layout.etp}
        out = dict.fromkeys(GROUPS, 0)
        for b in self.buckets if stage is None else self.pp_stage_buckets(stage):
            for group, n in _bucket_collectives(b, sizes).items():
                out[group] += n
        return out

    def received_bytes(self, stage: int) -> int:
        """Bytes a rank of pipeline stage `stage` receives per sync on the colocated path (all buckets, groups)."""
        return sum(sum(received_by_group(b, self.layout, stage).values()) for b in self.buckets)

    @property
    def hf_bytes(self) -> int:
        return sum(b.hf_bytes for b in self.buckets)

    def pp_stage_buckets(self, stage: int) -> list[Bucket]:
        return [b for b in self.buckets if b.stage == stage]


def _bucket_collectives(b: Bucket, sizes: Mapping[str, int]) -> dict[str, int]:
    return {"pp": len(b.dtypes()) if sizes["pp"] > 1 else 0,
            "tp": len(b.dtypes(b.tp_units)) if sizes["tp"] > 1 else 0,
            "ep": len(b.dtypes(b.expert_units)) if sizes["ep"] > 1 else 0,
            "etp": len(b.dtypes(b.etp_units)) if sizes["etp"] > 1 else 0}


def _shard_bytes(units: Sequence[Unit]) -> int:
    return sum(_nbytes(u.local_shape, u.dtype) for u in units)


def received_by_group(b: Bucket, layout: Layout, stage: int) -> dict[str, int]:
    """Bytes a rank of pipeline stage `stage` receives for bucket `b`, by group. The colocated path: every rank
    assembles every bucket (for the non-colocated one, a stage's own buckets without the "pp" share)."""
    return {"pp": _shard_bytes(b.units) if layout.pp > 1 and stage != b.stage else 0,
            "tp": _shard_bytes(b.tp_units) * (layout.tp - 1),
            "ep": _shard_bytes(b.expert_units) * (layout.ep - 1),
            "etp": _shard_bytes(b.etp_units) * layout.ep * (layout.etp - 1)}


# ------------------------------------------------------------------ the collectives of one bucket


def _flat(units: Sequence[Unit], dtype: torch.dtype, tensors: Mapping[str, torch.Tensor] | None,
          device: torch.device) -> torch.Tensor:
    """One flat buffer of `units`' local shards of `dtype`: their values (the holding stage) or room for them."""
    chosen = [u for u in units if u.dtype == dtype]
    if tensors is None:
        return torch.empty(sum(u.local_numel for u in chosen), dtype=dtype, device=device)
    parts = []
    for u in chosen:
        t = tensors[u.megatron]
        if tuple(t.shape) != u.local_shape or t.dtype != dtype:
            raise NameMappingError(f"{u.megatron}: this rank holds {tuple(t.shape)} {t.dtype}, the sync schedule expects "
                                   f"{u.local_shape} {dtype} (model spec and layout disagree with the model)")
        parts.append(t.detach().reshape(-1))
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)


def _split(flat: torch.Tensor, units: Sequence[Unit], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`flat` (one rank's shards of `units` of `dtype`, in order) back into shaped views, by megatron name."""
    out, offset = {}, 0
    for u in units:
        if u.dtype != dtype:
            continue
        out[u.megatron] = flat[offset:offset + u.local_numel].view(u.local_shape)
        offset += u.local_numel
    return out


def _all_gather(flat: torch.Tensor, group, size: int) -> torch.Tensor:
    """[size, n]: every member's `flat`, in group-rank order (one all_gather_into_tensor)."""
    out = torch.empty(size * flat.numel(), dtype=flat.dtype, device=flat.device)  # gloo takes a flat output only
    dist.all_gather_into_tensor(out, flat.contiguous(), group=group)
    return out.view(size, flat.numel())


def gather_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], groups: Groups, device: torch.device,
                  counters: SyncCounters | None = None, *,
                  across_pp_stages: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The bucket's full HF tensors on this rank (collective over the pipeline, TP, EP and expert-TP groups:
    every rank of the world calls it for every bucket of the schedule, in order). `tensors`: this rank's live
    megatron tensors by name (`model.hf_bridge.model_tensors`). `across_pp_stages=False`: only the holding stage's
    ranks take part (no pipeline broadcast; every rank of that stage calls it for each of the stage's buckets)."""
    sizes = dict(groups.sizes)
    counters = counters or SyncCounters()
    holder = groups.pp_rank == bucket.stage
    if not across_pp_stages:
        if not holder:
            raise ValueError(f"bucket of stage {bucket.stage} gathered on stage {groups.pp_rank} without a broadcast")
        sizes["pp"] = 1
    # 1. the holding stage's local shards, on every stage
    local: dict[str, torch.Tensor] = {}
    for dtype in bucket.dtypes():
        flat = _flat(bucket.units, dtype, tensors if holder else None, device)
        if sizes["pp"] > 1:
            dist.broadcast(flat, group=groups.pp, group_src=bucket.stage)
            counters.collectives["pp"] += 1
            if not holder:
                counters.received_bytes += flat.numel() * flat.element_size()
        local.update(_split(flat, bucket.units, dtype))
    # 2. TP slices of the dense tensors
    tp_parts: dict[str, list[torch.Tensor]] = {}
    tp_units = bucket.tp_units
    if sizes["tp"] > 1:
        for dtype in bucket.dtypes(tp_units):
            flat = torch.cat([local[u.megatron].reshape(-1) for u in tp_units if u.dtype == dtype])
            gathered = _all_gather(flat, groups.tp, sizes["tp"])
            counters.collectives["tp"] += 1
            counters.received_bytes += flat.numel() * flat.element_size() * (sizes["tp"] - 1)
            per_rank = [_split(gathered[r], tp_units, dtype) for r in range(sizes["tp"])]
            for u in tp_units:
                if u.dtype == dtype:
                    tp_parts[u.megatron] = [p[u.megatron] for p in per_rank]
    # 3. experts: every EP rank's slot, then the expert-TP slices
    ex_parts: dict[str, list[list[torch.Tensor]]] = {}  # megatron name -> [ep rank][etp rank]
    ex_units = bucket.expert_units
    for dtype in bucket.dtypes(ex_units):
        chosen = [u for u in ex_units if u.dtype == dtype]
        flat = torch.cat([local[u.megatron].reshape(-1) for u in chosen])
        by_ep = flat.unsqueeze(0)
        if sizes["ep"] > 1:
            by_ep = _all_gather(flat, groups.ep, sizes["ep"])
            counters.collectives["ep"] += 1
            counters.received_bytes += flat.numel() * flat.element_size() * (sizes["ep"] - 1)
        by_etp = None
        if sizes["etp"] > 1 and any(u.split for u in chosen):  # the whole flat buffer (`Bucket.etp_units`)
            by_etp = _all_gather(by_ep.reshape(-1), groups.etp, sizes["etp"]).view(sizes["etp"], *by_ep.shape)
            counters.collectives["etp"] += 1
            counters.received_bytes += by_ep.numel() * by_ep.element_size() * (sizes["etp"] - 1)
        for k in range(by_ep.shape[0]):
            mine = _split(by_ep[k], chosen, dtype)
            slices = ([_split(by_etp[r, k], chosen, dtype) for r in range(sizes["etp"])]
                      if by_etp is not None else None)
            for u in chosen:
                parts = [s[u.megatron] for s in slices] if slices is not None and u.split else [mine[u.megatron]]
                ex_parts.setdefault(u.megatron, []).append(parts)
    counters.buckets += 1
    # 4. HF tensors, in the bucket's order
    for u in bucket.units:
        if u.expert:
            for shard, parts in zip(u.shards, ex_parts[u.megatron]):
                yield from zip(shard.hf, hf_from_gathered(_whole(shard, len(parts)), parts))
        else:
            parts = tp_parts.get(u.megatron, [local[u.megatron]])
            yield from zip(u.shards[0].hf, hf_from_gathered(_whole(u.shards[0], len(parts)), parts))


def _whole(shard: Shard, parts: int) -> Shard:
    """The shard as `hf_from_gathered` reads it for `parts` gathered slices (1: the rank holds it whole)."""
    if parts == shard.size:
        return shard
    return Shard(shard.megatron, shard.hf, dim=shard.dim if parts > 1 else None, group=shard.group, size=parts,
                 expert=shard.expert, owner_pp=shard.owner_pp, owner_ep=shard.owner_ep, fp32=shard.fp32)
