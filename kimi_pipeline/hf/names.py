"""THE one place for HF <-> megatron-core names and shard shapes (DeepSeek-V3 / Kimi-K2).

For a rank's coordinates (pipeline stage, expert-parallel rank, tensor-parallel ranks) and the layer
spec that built its model (local modules on CPU, Transformer Engine on GPU), `hf_to_megatron_names`
lists every megatron tensor of that rank's model with the HF tensors it is cut from and how:

* replicated: the HF tensor as is (norms, router weight, expert bias, q/kv down projections);
* split along `dim` over the TP group (column-parallel: dim 0, row-parallel: dim 1, vocab: dim 0);
  experts use the expert-TP group instead;
* gated linear units: megatron's fc1 is [gate; up] *per TP partition*, i.e. cat(gate_chunk, up_chunk),
  so a gathered fc1 is interleaved and must be split per partition, not in the middle;
* experts: megatron local expert `l` on EP rank `r` is HF expert `r * E/ep + l`; layers are global
  index = local index + pipeline offset.

Local vs TE naming (the only differences): q/kv latent norms are `self_attention.q_layernorm` /
`kv_layernorm` (local) or `linear_q_up_proj.layer_norm_weight` / `linear_kv_up_proj.layer_norm_weight`
(TE); the dense layers' post-attention norm is `pre_mlp_layernorm` (local) or
`mlp.linear_fc1.layer_norm_weight` (TE); routed experts are `experts.local_experts.{l}.linear_fc{1,2}.weight`
(local SequentialMLP) or `experts.linear_fc{1,2}.weight{l}` (TE grouped GEMM). The q/kv down projections
are duplicated (replicated) across TP in both specs. torch_dist checkpoints always use the TE
names (megatron_model adds the key map to the local spec), so a CPU-converted checkpoint loads on GPU.

The table is arithmetic over the recipe (no model, no process group): `model.hf_bridge` applies it to a live
model (`load_hf_tensors_into_model`, `export_hf_tensors`).

The table's HF names are the language model's (`model.layers.*`, `lm_head.weight`). Where a checkpoint
stores them behind a prefix (Kimi-K2.5: `language_model.`) is `HFLayout`, read from the checkpoint's own
config.json: the reader of the conversion and of bridge loading, the engines' loader, weight sync and the
export all go through it, so no other module knows a prefix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.recipes.layout import Layout
from kimi_pipeline.recipes.models import ModelSpec


class NameMappingError(PermanentError):
    """A checkpoint tensor is missing, has the wrong shape, or a model tensor has no HF source."""


# The language model's tensor prefix, by config.json model_type. Kimi-K2.5 (KimiK25ForConditionalGeneration)
# stores `language_model.model.*` and `language_model.lm_head.weight` beside its MoonViT `vision_tower.*` and
# `mm_projector.*` (the layout SGLang's, vLLM's and TensorRT-LLM's K2.5 loaders read); K2 and K2-Thinking
# (DeepseekV3ForCausalLM) store the language model at the top level.
LM_PREFIX_BY_MODEL_TYPE = {"kimi_k25": "language_model."}
_T = TypeVar("_T")


@dataclass(frozen=True)
class HFLayout:
    """Where a checkpoint keeps the language model RL trains: the table's names behind `prefix`. Every stored
    tensor outside it (K2.5's vision tower and projector) belongs to the model's other parts, which RL never
    trains and carries through to the export untouched."""

    prefix: str = ""

    @classmethod
    def of_config(cls, config: dict[str, Any]) -> HFLayout:
        return cls(LM_PREFIX_BY_MODEL_TYPE.get(config.get("model_type"), ""))

    @classmethod
    def of_dir(cls, model_dir: str | Path) -> HFLayout:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise NameMappingError(f"{path}: not found; the checkpoint's config.json says how it names its tensors")
        return cls.of_config(json.loads(path.read_text()))

    def stored(self, name: str) -> str:
        """The stored name of a language-model tensor of the table."""
        return self.prefix + name

    def logical(self, stored: str) -> str | None:
        """The table's name of a stored tensor; None for a tensor outside the language model."""
        return stored[len(self.prefix):] if stored.startswith(self.prefix) else None

    def misplaced(self, stored: str) -> bool:
        """A language-model name of the table stored without the prefix this checkpoint keeps it under."""
        return bool(self.prefix) and stored.startswith(("model.", "lm_head."))

    def stored_items(self, named: Iterable[tuple[str, _T]]) -> Iterator[tuple[str, _T]]:
        """(stored name, value) for the table's (name, value) pairs, streamed."""
        for name, value in named:
            yield self.prefix + name, value


@dataclass(frozen=True)
class Shard:
    """One megatron tensor of one rank and how it is cut from HF tensors."""

    megatron: str  # name in this rank's (unwrapped) model state_dict, layer index local to the stage
    hf: tuple[str, ...]  # HF tensor names: one, or (gate, up) for a fused fc1
    dim: int | None = None  # split dim across `group`, None = replicated
    group: str = "tp"  # "tp" (dense TP group) or "etp" (expert-TP group)
    rank: int = 0  # this rank's index in `group`
    size: int = 1  # `group` size (1 = whole tensor)
    expert: bool = False  # lives on one EP rank only
    owner_pp: int = 0  # pipeline stage holding it
    owner_ep: int | None = None  # EP rank holding it (experts only)
    fp32: bool = False  # kept in float32 whatever the model dtype (expert bias)

    @property
    def split(self) -> bool:
        return self.dim is not None and self.size > 1


@dataclass
class _Entry:
    """A logical tensor: its HF names, its megatron name per spec, and how it is sharded."""

    hf: tuple[str, ...]
    local: str
    te: str
    dim: int | None
    group: str = "tp"
    expert: bool = False
    fp32: bool = False
    extra: dict = field(default_factory=dict)


def _glu(prefix: str) -> tuple[str, str]:
    return (f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight")


def _layer_entries(spec: ModelSpec, layer: int, local_layer: int, layout: Layout, ep_rank: int) -> list[_Entry]:
    h = f"model.layers.{layer}"
    m = f"decoder.layers.{local_layer}"
    att_h, att_m = f"{h}.self_attn", f"{m}.self_attention"
    out = [_Entry((f"{h}.input_layernorm.weight",), f"{m}.input_layernorm.weight", f"{m}.input_layernorm.weight", None)]
    if spec.q_lora_rank is None:
        out.append(_Entry((f"{att_h}.q_proj.weight",), f"{att_m}.linear_q_proj.weight", f"{att_m}.linear_q_proj.weight", 0))
    else:
        out += [
            _Entry((f"{att_h}.q_a_proj.weight",), f"{att_m}.linear_q_down_proj.weight",
                   f"{att_m}.linear_q_down_proj.weight", None),
            _Entry((f"{att_h}.q_a_layernorm.weight",), f"{att_m}.q_layernorm.weight",
                   f"{att_m}.linear_q_up_proj.layer_norm_weight", None),
            _Entry((f"{att_h}.q_b_proj.weight",), f"{att_m}.linear_q_up_proj.weight",
                   f"{att_m}.linear_q_up_proj.weight", 0),
        ]
    out += [
        _Entry((f"{att_h}.kv_a_proj_with_mqa.weight",), f"{att_m}.linear_kv_down_proj.weight",
               f"{att_m}.linear_kv_down_proj.weight", None),
        _Entry((f"{att_h}.kv_a_layernorm.weight",), f"{att_m}.kv_layernorm.weight",
               f"{att_m}.linear_kv_up_proj.layer_norm_weight", None),
        _Entry((f"{att_h}.kv_b_proj.weight",), f"{att_m}.linear_kv_up_proj.weight", f"{att_m}.linear_kv_up_proj.weight", 0),
        _Entry((f"{att_h}.o_proj.weight",), f"{att_m}.linear_proj.weight", f"{att_m}.linear_proj.weight", 1),
    ]
    norm = (f"{h}.post_attention_layernorm.weight",)
    if layer < spec.first_k_dense:
        out += [
            _Entry(norm, f"{m}.pre_mlp_layernorm.weight", f"{m}.mlp.linear_fc1.layer_norm_weight", None),
            _Entry(_glu(f"{h}.mlp"), f"{m}.mlp.linear_fc1.weight", f"{m}.mlp.linear_fc1.weight", 0),
            _Entry((f"{h}.mlp.down_proj.weight",), f"{m}.mlp.linear_fc2.weight", f"{m}.mlp.linear_fc2.weight", 1),
        ]
        return out
    out += [
        _Entry(norm, f"{m}.pre_mlp_layernorm.weight", f"{m}.pre_mlp_layernorm.weight", None),
        _Entry((f"{h}.mlp.gate.weight",), f"{m}.mlp.router.weight", f"{m}.mlp.router.weight", None),
    ]
    if spec.moe_router_enable_expert_bias:
        out.append(_Entry((f"{h}.mlp.gate.e_score_correction_bias",), f"{m}.mlp.router.expert_bias",
                          f"{m}.mlp.router.expert_bias", None, fp32=True))
    if spec.num_shared_experts:
        sh_h, sh_m = f"{h}.mlp.shared_experts", f"{m}.mlp.shared_experts"
        out += [
            _Entry(_glu(sh_h), f"{sh_m}.linear_fc1.weight", f"{sh_m}.linear_fc1.weight", 0),
            _Entry((f"{sh_h}.down_proj.weight",), f"{sh_m}.linear_fc2.weight", f"{sh_m}.linear_fc2.weight", 1),
        ]
    per_rank = spec.num_experts // layout.ep
    for local in range(per_rank):
        g = ep_rank * per_rank + local
        ex_h, ex_m = f"{h}.mlp.experts.{g}", f"{m}.mlp.experts"
        out += [
            _Entry(_glu(ex_h), f"{ex_m}.local_experts.{local}.linear_fc1.weight", f"{ex_m}.linear_fc1.weight{local}",
                   0, group="etp", expert=True),
            _Entry((f"{ex_h}.down_proj.weight",), f"{ex_m}.local_experts.{local}.linear_fc2.weight",
                   f"{ex_m}.linear_fc2.weight{local}", 1, group="etp", expert=True),
        ]
    return out


def _pp_stage_entries(spec: ModelSpec, layout: Layout, pp_rank: int, ep_rank: int) -> list[_Entry]:
    out: list[_Entry] = []
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    if first:
        out.append(_Entry(("model.embed_tokens.weight",), "embedding.word_embeddings.weight",
                          "embedding.word_embeddings.weight", 0))
    offset = layout.layer_offset(spec.num_layers, pp_rank)
    for local in range(layout.pp_stage_layers(spec.num_layers)[pp_rank]):
        out += _layer_entries(spec, offset + local, local, layout, ep_rank)
    if last:
        out.append(_Entry(("model.norm.weight",), "decoder.final_layernorm.weight", "decoder.final_layernorm.weight", None))
        if not spec.tie_word_embeddings:
            out.append(_Entry(("lm_head.weight",), "output_layer.weight", "output_layer.weight", 0))
        elif not first:  # tied + PP: the last stage keeps its own copy of the embedding as output layer
            out.append(_Entry(("model.embed_tokens.weight",), "output_layer.weight", "output_layer.weight", 0,
                              extra={"tied_copy": True}))
    return out


def hf_to_megatron_names(
    spec: ModelSpec,
    layout: Layout,
    pp_rank: int = 0,
    ep_rank: int = 0,
    tp_rank: int = 0,
    *,
    etp_rank: int = 0,
    use_te: bool = False,
) -> list[Shard]:
    """Every tensor of the model on rank (pp_rank, ep_rank, tp_rank, etp_rank), with its HF sources."""
    if not 0 <= pp_rank < layout.pp or not 0 <= ep_rank < layout.ep:
        raise ValueError(f"pp_rank {pp_rank} / ep_rank {ep_rank} outside layout pp={layout.pp} ep={layout.ep}")
    layout.check_model(spec)
    shards = []
    for e in _pp_stage_entries(spec, layout, pp_rank, ep_rank):
        if e.group == "etp":
            rank, size = etp_rank, layout.etp
        else:
            rank, size = tp_rank, layout.tp
        dim = e.dim
        shards.append(
            Shard(
                megatron=e.te if use_te else e.local,
                hf=e.hf,
                dim=dim,
                group=e.group,
                rank=rank if dim is not None else 0,
                size=size if dim is not None else 1,
                expert=e.expert,
                owner_pp=pp_rank,
                owner_ep=ep_rank if e.expert else None,
                fp32=e.fp32,
            )
        )
    return shards


def hf_names_for_rank(spec: ModelSpec, layout: Layout, pp_rank: int = 0, ep_rank: int = 0) -> list[str]:
    """The HF tensors a rank at (pp_rank, ep_rank) reads (TP ranks read the same tensors, other slices)."""
    seen: dict[str, None] = {}
    for s in hf_to_megatron_names(spec, layout, pp_rank, ep_rank):
        for n in s.hf:
            seen.setdefault(n, None)
    return list(seen)


def all_hf_names(spec: ModelSpec) -> list[str]:
    """Every HF tensor name of the model (the checkpoint's logical contents)."""
    one = Layout()
    return hf_names_for_rank(spec, one)


def megatron_to_hf_names(spec: ModelSpec, layout: Layout, pp_rank: int = 0, ep_rank: int = 0, tp_rank: int = 0,
                         *, etp_rank: int = 0, use_te: bool = False) -> dict[str, Shard]:
    """Reverse lookup: megatron tensor name on that rank -> its Shard."""
    return {s.megatron: s for s in hf_to_megatron_names(spec, layout, pp_rank, ep_rank, tp_rank,
                                                         etp_rank=etp_rank, use_te=use_te)}


# --------------------------------------------------------------------------- slicing


def _chunk(t: torch.Tensor, dim: int, rank: int, size: int, name: str) -> torch.Tensor:
    if t.shape[dim] % size:
        raise NameMappingError(f"{name}: dim {dim} of shape {tuple(t.shape)} does not split into {size} parts")
    return t.chunk(size, dim=dim)[rank]


def shard_from_hf(shard: Shard, tensors: list[torch.Tensor]) -> torch.Tensor:
    """This rank's megatron tensor from the full HF tensors named in `shard.hf`."""
    if len(shard.hf) == 2:  # fc1 = [gate_chunk; up_chunk] per TP partition
        gate, up = tensors
        if shard.split:
            gate = _chunk(gate, 0, shard.rank, shard.size, shard.hf[0])
            up = _chunk(up, 0, shard.rank, shard.size, shard.hf[1])
        return torch.cat([gate, up], dim=0)
    (t,) = tensors
    if shard.split:
        t = _chunk(t, shard.dim, shard.rank, shard.size, shard.hf[0])
    return t


def hf_from_gathered(shard: Shard, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Full HF tensors from the megatron tensors of every rank of the shard's group (in group-rank order)."""
    if len(shard.hf) == 2:
        gates, ups = zip(*(p.chunk(2, dim=0) for p in parts))
        return [torch.cat(gates, dim=0), torch.cat(ups, dim=0)]
    if shard.split:
        return [torch.cat(parts, dim=shard.dim)]
    return [parts[0]]


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Full HF tensor shapes, derived from the spec (no model needed)."""
    h, heads = spec.hidden_size, spec.num_attention_heads
    qk = spec.qk_head_dim + spec.qk_pos_emb_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "lm_head.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
    }
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        shapes.update({
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{a}.kv_a_proj_with_mqa.weight": (spec.kv_lora_rank + spec.qk_pos_emb_head_dim, h),
            f"{a}.kv_a_layernorm.weight": (spec.kv_lora_rank,),
            f"{a}.kv_b_proj.weight": (heads * (spec.qk_head_dim + spec.v_head_dim), spec.kv_lora_rank),
            f"{a}.o_proj.weight": (h, heads * spec.v_head_dim),
        })
        if spec.q_lora_rank is None:
            shapes[f"{a}.q_proj.weight"] = (heads * qk, h)
        else:
            shapes.update({
                f"{a}.q_a_proj.weight": (spec.q_lora_rank, h),
                f"{a}.q_a_layernorm.weight": (spec.q_lora_rank,),
                f"{a}.q_b_proj.weight": (heads * qk, spec.q_lora_rank),
            })
        if i < spec.first_k_dense:
            f = spec.ffn_hidden_size
            shapes.update({f"{p}.mlp.gate_proj.weight": (f, h), f"{p}.mlp.up_proj.weight": (f, h),
                           f"{p}.mlp.down_proj.weight": (h, f)})
            continue
        e, f = spec.num_experts, spec.moe_ffn_hidden_size
        shapes[f"{p}.mlp.gate.weight"] = (e, h)
        shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (e,)
        fs = f * spec.num_shared_experts
        s = f"{p}.mlp.shared_experts"
        shapes.update({f"{s}.gate_proj.weight": (fs, h), f"{s}.up_proj.weight": (fs, h), f"{s}.down_proj.weight": (h, fs)})
        for j in range(e):
            x = f"{p}.mlp.experts.{j}"
            shapes.update({f"{x}.gate_proj.weight": (f, h), f"{x}.up_proj.weight": (f, h), f"{x}.down_proj.weight": (h, f)})
    return shapes


# --------------------------------------------------------------------------- HF state dict helpers


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def unfuse_hf_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers fuses experts in memory (gate_up_proj [E,2F,H], down_proj [E,H,F]); the checkpoint
    format has one tensor per expert. Returns the per-expert (on-disk) naming."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _EXPERT.match(name)
        if not m:
            out[name] = t
            continue
        layer, kind = m.groups()
        for e in range(t.shape[0]):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            if kind == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{p}.gate_proj.weight"], out[f"{p}.up_proj.weight"] = gate, up
            else:
                out[f"{p}.down_proj.weight"] = t[e]
    return out


def check_complete(names: Iterable[str], spec: ModelSpec) -> list[str]:
    """HF names the model needs that are not in `names` (empty = complete)."""
    have = set(names)
    return [n for n in all_hf_names(spec) if n not in have]
