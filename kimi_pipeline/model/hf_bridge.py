"""The HF names table (`hf.names`) applied to a live megatron model: fill a rank's model from HF tensors
(`load_hf_tensors_into_model`: only the slices this rank owns are read) and the reverse, full HF-named tensors
out of a TP/EP/PP-sharded model (`export_hf_tensors`: collective), reused by the conversion, weight sync and
the INT4 export. The rank's coordinates come from megatron's parallel_state."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kimi_pipeline.hf.names import (
    NameMappingError,
    Shard,
    hf_from_gathered,
    hf_shapes,
    hf_to_megatron_names,
    shard_from_hf,
)
from kimi_pipeline.model.megatron_model import unwrap
from kimi_pipeline.recipes.layout import Layout
from kimi_pipeline.recipes.models import ModelSpec

# --------------------------------------------------------------------------- model access


def model_uses_te(model) -> bool:
    m = unwrap(model)
    flag = getattr(m, "kimi_use_te", None)
    if flag is not None:
        return bool(flag)
    return any(".layer_norm_weight" in n for n, _ in m.named_parameters())


def model_tensors(model) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by state_dict name (live tensors, not copies): the stacked routed experts
    as their per-expert views (`model/grouped_experts.py`), so every name is the names table's."""
    m = unwrap(model)
    return {n: t for n, t in m.state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor) and not n.endswith("_extra_state")}


def current_coords() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "etp_rank": ps.get_expert_tensor_parallel_rank(),
    }


def rank_shards(model, spec: ModelSpec, layout: Layout) -> list[Shard]:
    """The shards of this process's model (coordinates from megatron parallel_state)."""
    c = current_coords()
    return hf_to_megatron_names(spec, layout, c["pp_rank"], c["ep_rank"], c["tp_rank"], etp_rank=c["etp_rank"],
                                use_te=model_uses_te(model))


# --------------------------------------------------------------------------- HF -> megatron


@torch.no_grad()
def load_hf_tensors_into_model(
    model,
    get_hf_tensor: Callable[[str], torch.Tensor],
    spec: ModelSpec,
    layout: Layout,
) -> list[str]:
    """Copy this rank's slices of HF tensors into `model`; returns the HF names read (each once).

    Fails (NameMappingError) if a model tensor has no mapping, a mapped name is not in the model, or a
    shape differs; only the tensors this rank owns are requested from `get_hf_tensor`.
    """
    tensors = model_tensors(model)
    shards = rank_shards(model, spec, layout)
    by_name = {s.megatron: s for s in shards}
    unmapped = sorted(set(tensors) - set(by_name))
    absent = sorted(set(by_name) - set(tensors))
    if unmapped or absent:
        raise NameMappingError(
            f"model and name map disagree: model tensors without HF source {unmapped[:8]}; "
            f"mapped names not in the model {absent[:8]} (spec/layout mismatch?)"
        )
    read: dict[str, None] = {}
    cache: dict[str, torch.Tensor] = {}
    last_use = {n: i for i, s in enumerate(shards) for n in s.hf}
    for i, s in enumerate(shards):
        srcs = []
        for n in s.hf:
            if n not in cache:
                t = get_hf_tensor(n)
                if t is None:
                    raise NameMappingError(f"HF tensor {n} is missing from the checkpoint")
                cache[n] = t
                read.setdefault(n, None)
            srcs.append(cache[n])
        value = shard_from_hf(s, srcs)
        target = tensors[s.megatron]
        if tuple(value.shape) != tuple(target.shape):
            raise NameMappingError(
                f"{' + '.join(s.hf)} -> {s.megatron}: shard shape {tuple(value.shape)} != model {tuple(target.shape)}"
            )
        target.copy_(value.to(target.dtype))
        for n in s.hf:  # drop full tensors once no later shard of this rank needs them
            if last_use[n] == i:
                cache.pop(n, None)
    return list(read)


# --------------------------------------------------------------------------- megatron -> HF


def _group(name: str):
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group() if name == "tp" else ps.get_expert_tensor_parallel_group()


def _gather(shard: Shard, local: torch.Tensor) -> list[torch.Tensor]:
    if not shard.split:
        return hf_from_gathered(shard, [local])
    parts = [torch.empty_like(local) for _ in range(shard.size)]
    dist.all_gather(parts, local.contiguous(), group=_group(shard.group))
    return hf_from_gathered(shard, parts)



@dataclass(frozen=True)
class _Global:
    """A logical tensor in the global export order and who holds it."""

    hf: tuple[str, ...]
    pp: int
    ep: int | None
    fp32: bool


def _global_order(spec: ModelSpec, layout: Layout) -> list[_Global]:
    out = []
    seen: set[tuple[str, ...]] = set()
    for pp in range(layout.pp):
        for ep in range(layout.ep):
            for s in hf_to_megatron_names(spec, layout, pp, ep):
                if s.hf in seen or (not s.expert and ep != 0):
                    continue
                if spec.tie_word_embeddings and s.megatron == "output_layer.weight":
                    continue  # the tied copy is not exported twice
                seen.add(s.hf)
                out.append(_Global(s.hf, pp, ep if s.expert else None, s.fp32))
    return out


@torch.no_grad()
def export_hf_tensors(
    model,
    spec: ModelSpec,
    layout: Layout,
    *,
    dst: int | None = None,
    owned_only: bool = False,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors of a (possibly TP/EP/PP-sharded) model, in a fixed global order.

    Collective: every rank must iterate it to the end. TP/expert-TP shards are all-gathered in their
    groups; then each tensor is broadcast from its holder (lowest global rank holding it) so that every
    rank yields it (dst=None), or sent point to point to global rank `dst` alone, which yields it (the
    other ranks receive nothing). owned_only=True skips the broadcast: each
    holder yields just the tensors it is the designated source of (for writers that shard the output).
    Tensors come out in the model's dtype (expert bias in fp32) unless `dtype` is given.
    """

    tensors = model_tensors(model)
    mine = {s.hf: s for s in rank_shards(model, spec, layout)}
    c = current_coords()
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    me = dist.get_rank() if distributed else 0
    if distributed:
        coords: list = [None] * dist.get_world_size()
        dist.all_gather_object(coords, (c["pp_rank"], c["ep_rank"]))
    else:
        coords = [(c["pp_rank"], c["ep_rank"])]
    model_dtype = next(iter(tensors.values())).dtype
    shapes = hf_shapes(spec)

    for g in _global_order(spec, layout):
        holders = [r for r, (pp, ep) in enumerate(coords) if pp == g.pp and (g.ep is None or ep == g.ep)]
        src = holders[0]
        full: list[torch.Tensor] | None = None
        if g.hf in mine:
            full = _gather(mine[g.hf], tensors[mine[g.hf].megatron])
        out_dtype = torch.float32 if g.fp32 else (dtype or model_dtype)
        if owned_only or not distributed:
            if full is not None and me == src:
                for n, t in zip(g.hf, full):
                    yield n, t.to(out_dtype).clone()
            continue
        for i, n in enumerate(g.hf):
            if dst is not None and me not in (src, dst):
                continue  # one reader: only the holder and it take part (point to point, not a broadcast)
            buf = full[i].to(out_dtype).contiguous() if me == src else torch.empty(shapes[n], dtype=out_dtype,
                                                                                  device=_device(tensors))
            if dst is None:
                dist.broadcast(buf, src=src)
            elif src != dst:
                if me == src:
                    dist.send(buf, dst=dst)
                else:
                    dist.recv(buf, src=src)
            if dst is None or me == dst:
                yield n, buf if me != src else buf.clone()


def _device(tensors: dict[str, torch.Tensor]) -> torch.device:
    return next(iter(tensors.values())).device
