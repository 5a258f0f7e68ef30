"""A batched DeepSeek-V3 / Kimi-K2 forward for rollouts: MLA over a compressed KV cache, grouped MoE.

Why hand-written: transformers' DeepseekV3 re-expands the whole KV cache through `kv_b_proj` at every
decode step and grows its cache by concatenation, which makes sampling several times slower than
needed. Here attention is "absorbed" (as in DeepSeek's and SGLang's MLA kernels): the cache holds only
the normalized kv latent and the roped shared key per token (kv_lora_rank + qk_rope_head_dim numbers),
queries are mapped into latent space with kv_b_proj's key half, and the attention output is mapped
back with its value half. When the latent is no wider than the no-rope query and value heads (the
tiny recipe), those two per-head maps are folded into q_b_proj and o_proj once per weight load
("merged"), so a step runs two plain matmuls instead of two batched ones; wider latents (Kimi: 512 vs
128) would make the folded matmuls larger, so there the maps run per step. Routed experts run as one
grouped matmul over expert-sorted tokens.

Weights are the HF tensors under their HF names (on-disk per-expert names and transformers' in-memory
fused names both load), so weight sync can update the engine by name. Numerics follow transformers'
eager implementation (fp32 router, RMSNorm in fp32, q/kv latent norms at eps 1e-6 as transformers
builds them, YaRN tables from transformers' own rotary module); parity is tested on logits.

`decode_static` is the decode step with shapes fixed by its buffers and no host syncs, what static_decode.py runs
eagerly or captures in CUDA graphs. Weight loads write into the existing tensors (derived ones included), so the
addresses captured graphs read stay valid across weight updates.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.hf.names import HFLayout
from kimi_pipeline.hf.reader import HFCheckpointError, iter_stored_tensors
from kimi_pipeline.hf.source_formats import QuantFormatError, QuantizedParts
from kimi_pipeline.model.grouped_experts import grouped_mm_supported
from kimi_pipeline.model.hf_model import deepseek_config, read_config

# transformers builds q_a_layernorm / kv_a_layernorm with its RMSNorm default eps (not rms_norm_eps).
LATENT_NORM_EPS = 1e-6


class EngineWeightError(PermanentError):
    """Weights that do not fit the engine's model (unknown name, wrong shape, incomplete set)."""


def rope_frequencies(hf_config) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling) of the rotary embedding, as transformers' DeepseekV3RotaryEmbedding computes
    them: the rope type's init function from `transformers.modeling_rope_utils` (YaRN, the Kimi/DeepSeek-V3 type),
    or plain RoPE over rope_theta (`compute_default_rope_parameters`). Taken from modeling_rope_utils rather than the
    DeepSeek-V3 modeling module, whose import (torch._dynamo through masking_utils, hub kernels) cost ~1.2 CPU-s
    more in every engine process (measured: 2.0 against 0.8 CPU-s with the config module); `test_engine.py` checks
    both against that module."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = hf_config.rope_parameters
    if rope["rope_type"] != "default":
        return ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config)
    dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def attention_softmax_scale(rope_parameters: Mapping[str, Any], qk_head_dim: int) -> float:
    """DeepSeek-V3's attention scale: qk_head_dim^-0.5, times mscale^2 under a scaled RoPE with `mscale_all_dim`
    (mscale = 0.1 * mscale_all_dim * ln(factor) + 1 for factor > 1): transformers' `yarn_apply_mscale` and
    `yarn_get_mscale` (models/deepseek_v3/modeling_deepseek_v3.py), written out for the reason `rope_frequencies`
    gives."""
    scaling = qk_head_dim ** -0.5
    if rope_parameters.get("rope_type", "default") != "default":
        mscale_all_dim, factor = rope_parameters.get("mscale_all_dim", 0), rope_parameters.get("factor", 1.0)
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scaling = scaling * mscale * mscale
    return float(scaling)


@dataclass(frozen=True)
class EngineConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    first_k_dense: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    topk: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_interleave: bool
    softmax_scale: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.first_k_dense, self.num_layers))

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def merge_absorbed(self) -> bool:
        """Fold kv_b_proj's per-head maps into the q and o projections (no larger than the originals)."""
        return self.kv_lora_rank <= min(self.qk_nope_head_dim, self.v_head_dim)

    @classmethod
    def from_hf(cls, cfg) -> EngineConfig:
        """From a transformers DeepseekV3Config (see kimi_pipeline.model.hf_model.deepseek_config)."""
        if getattr(cfg, "attention_bias", False):
            raise EngineWeightError("attention_bias=true is not a DeepSeek-V3/Kimi layout; the engine lacks it")
        if getattr(cfg, "scoring_func", "sigmoid") != "sigmoid":
            raise EngineWeightError(
                f"scoring_func={cfg.scoring_func!r}: the engine (like transformers) implements sigmoid routing only")
        if getattr(cfg, "moe_layer_freq", 1) != 1:
            raise EngineWeightError("moe_layer_freq != 1 is not supported (every layer after first_k_dense is MoE)")
        eos = cfg.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            first_k_dense=cfg.first_k_dense_replace,
            num_heads=cfg.num_attention_heads,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            intermediate_size=cfg.intermediate_size,
            moe_intermediate_size=cfg.moe_intermediate_size,
            num_experts=cfg.n_routed_experts,
            topk=cfg.num_experts_per_tok,
            num_shared_experts=cfg.n_shared_experts or 0,
            n_group=cfg.n_group or 1,
            topk_group=cfg.topk_group or 1,
            norm_topk_prob=bool(cfg.norm_topk_prob),
            routed_scaling_factor=float(cfg.routed_scaling_factor),
            rms_norm_eps=float(cfg.rms_norm_eps),
            rope_interleave=bool(getattr(cfg, "rope_interleave", True)),
            softmax_scale=attention_softmax_scale(cfg.rope_parameters, qk_head_dim),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(cfg.tie_word_embeddings),
            eos_token_ids=eos_ids,
        )


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV3RMSNorm: normalize in fp32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class _Layer:
    """One decoder layer's tensors, fused where one matmul can serve two HF projections."""

    def __init__(self, c: EngineConfig, idx: int, device, dtype):
        H, nh = c.hidden_size, c.num_heads
        e = dict(device=device, dtype=dtype)
        self.moe = idx >= c.first_k_dense
        self.in_norm = torch.ones(H, **e)
        self.post_norm = torch.ones(H, **e)
        q_out = nh * (c.qk_nope_head_dim + c.qk_rope_head_dim)
        q_in = c.q_lora_rank if c.q_lora_rank is not None else q_out
        # rows [0, q_in): q_a_proj (or q_proj when q_lora_rank is None); then kv_a_proj_with_mqa
        self.qkv_a = torch.zeros(q_in + c.latent_dim, H, **e)
        self.q_norm = torch.ones(c.q_lora_rank, **e) if c.q_lora_rank is not None else None
        self.q_b = torch.zeros(q_out, c.q_lora_rank, **e) if c.q_lora_rank is not None else None
        self.kv_norm = torch.ones(c.kv_lora_rank, **e)
        self.kv_b = torch.zeros(nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, **e)
        self.o = torch.zeros(H, nh * c.v_head_dim, **e)
        if not self.moe:
            self.gate_up = torch.zeros(2 * c.intermediate_size, H, **e)
            self.down = torch.zeros(H, c.intermediate_size, **e)
            return
        F_, E = c.moe_intermediate_size, c.num_experts
        self.router = torch.zeros(E, H, device=device, dtype=torch.float32)  # transformers routes in fp32
        self.router_bias = torch.zeros(E, device=device, dtype=torch.float32)
        self.w13 = torch.zeros(E, 2 * F_, H, **e)  # transformers' fused gate_up_proj layout
        self.w2 = torch.zeros(E, H, F_, **e)
        Fs = F_ * c.num_shared_experts
        self.shared_gate_up = torch.zeros(2 * Fs, H, **e) if Fs else None
        self.shared_down = torch.zeros(H, Fs, **e) if Fs else None

    def kv_b_views(self, c: EngineConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [h, nope, lora] and W_UV [h, v, lora] (views, no copies)."""
        kvb = self.kv_b.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return kvb[:, : c.qk_nope_head_dim], kvb[:, c.qk_nope_head_dim :]

    def refresh(self, c: EngineConfig) -> None:
        """Derived (merged) weights; called after every weight load. Computed in fp32, stored in the model dtype.

        After the first call every derived tensor keeps its storage (the new values are copied in): captured CUDA
        graphs read weights by address, so a rebound tensor would leave them computing with the old one."""
        q_src = self.q_b if self.q_b is not None else self.qkv_a[: self.qkv_a.shape[0] - c.latent_dim]
        if not c.merge_absorbed:
            self.q_eff, self.qkv_a_eff, self.o_eff = q_src, self.qkv_a, self.o  # views of the weights themselves
            return
        nh, dn, dr, r, dv = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim
        w_uk, w_uv = (w.float() for w in self.kv_b_views(c))
        wq = q_src.float().view(nh, dn + dr, -1)
        # q_lat[h] = W_UK[h]^T q_nope[h]  ->  rows W_UK[h]^T @ Wq_nope[h]; the rope rows stay as they are
        merged_q = torch.cat((torch.bmm(w_uk.transpose(1, 2), wq[:, :dn]), wq[:, dn:]), dim=1)
        merged_q = merged_q.reshape(nh * (r + dr), -1).to(q_src.dtype)
        if self.q_b is not None:
            self._derive("q_eff", merged_q)
            self.qkv_a_eff = self.qkv_a
        else:
            self.q_eff = q_src
            self._derive("qkv_a_eff", torch.cat((merged_q, self.qkv_a[q_src.shape[0] :]), dim=0))
        # out = sum_h o_proj[:, h] @ W_UV[h] @ o_lat[h]  ->  o_eff[:, h] = o_proj[:, h] @ W_UV[h]
        wo = self.o.float().view(-1, nh, dv).transpose(0, 1)  # [nh, H, v]
        self._derive("o_eff", torch.bmm(wo, w_uv).transpose(0, 1).reshape(-1, nh * r).to(self.o.dtype))

    def _derive(self, name: str, value: torch.Tensor) -> None:
        """Set a derived weight: the first time by binding it, then by copying into the tensor already bound."""
        old = self.__dict__.get(name)
        if old is None or old.shape != value.shape:
            setattr(self, name, value)
        else:
            old.copy_(value)


class EngineModel:
    """DeepSeek-V3 forward with a preallocated latent KV cache; see the module docstring."""

    def __init__(self, config: EngineConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 *, hf_config, layout: HFLayout = HFLayout()):
        """`hf_config`: the transformers DeepseekV3Config `config` came from (its rotary parameters give the cos/sin
        tables). `layout`: how the served checkpoint names its language model (K2.5: `language_model.` before the names
        below); weights load under those stored names, as SGLang's K2.5 model loads them."""
        self.config, self.device, self.dtype, self.layout = config, torch.device(device), dtype, layout
        c = config
        e = dict(device=self.device, dtype=dtype)
        self.embed = torch.zeros(c.vocab_size, c.hidden_size, **e)
        self.lm_head = self.embed if c.tie_word_embeddings else torch.zeros(c.vocab_size, c.hidden_size, **e)
        self.final_norm = torch.ones(c.hidden_size, **e)
        self.layers = [_Layer(c, i, self.device, dtype) for i in range(c.num_layers)]
        for layer in self.layers:
            layer.refresh(c)
        self._params = self._registry()
        self._init_rope(hf_config)
        self._expert_ids = torch.arange(c.num_experts, device=self.device)  # group ends of the static MoE path
        # Bumped whenever a tensor the forward reads moves to new storage; captured CUDA graphs (static_decode.py)
        # hold addresses and are dropped when it changes. Weight loads copy in place, so it stays 0 in practice.
        self.storage_epoch = 0
        self._storage = self._storage_signature()

        self._parts = QuantizedParts()  # INT4 / FP8 weights (a sync in the engine's format) arrive as parts
        self._released: list[tuple[torch.UntypedStorage, int]] = []  # storages freed by release_weights, sizes
        self._static: dict[str, torch.Tensor] = {}
        self.unloaded: set[str] = set()  # weights not loaded since a resume (generation waits for all)

    # ------------------------------------------------------------------ construction / weights
    @classmethod
    def from_hf_model(cls, model, device: str | torch.device | None = None,
                      dtype: torch.dtype | None = None) -> EngineModel:
        """Copy an in-memory transformers DeepseekV3ForCausalLM (its fused expert tensors load as-is)."""
        dtype = dtype or next(model.parameters()).dtype
        device = device or next(model.parameters()).device
        engine = cls(EngineConfig.from_hf(model.config), device, dtype, hf_config=model.config)
        engine.load_weights(model.state_dict().items(), strict=True)
        return engine

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None, text_config_key: str | None = None) -> EngineModel:
        """Load a safetensors checkpoint directory (Kimi `kimi_k2` configs included) without transformers' loader."""

        raw = read_config(model_dir)
        cfg = deepseek_config(raw, text_config_key)
        if dtype is None:
            name = str(cfg.dtype).replace("torch.", "")
            dtype = cfg.dtype if isinstance(cfg.dtype, torch.dtype) else getattr(torch, name)
        engine = cls(EngineConfig.from_hf(cfg), device, dtype, hf_config=cfg, layout=HFLayout.of_config(raw))
        engine.load_weights(iter_safetensors(model_dir), strict=True)
        return engine

    def _registry(self) -> dict[str, torch.Tensor]:
        """HF name -> the engine tensor (or slice of a fused tensor) it fills."""
        c, reg = self.config, {}
        reg["model.embed_tokens.weight"] = self.embed
        reg["model.norm.weight"] = self.final_norm
        if not c.tie_word_embeddings:
            reg["lm_head.weight"] = self.lm_head
        q_in = self.layers[0].qkv_a.shape[0] - c.latent_dim
        for i, L in enumerate(self.layers):
            p = f"model.layers.{i}."
            reg[p + "input_layernorm.weight"] = L.in_norm
            reg[p + "post_attention_layernorm.weight"] = L.post_norm
            a = p + "self_attn."
            if c.q_lora_rank is not None:
                reg[a + "q_a_proj.weight"] = L.qkv_a[:q_in]
                reg[a + "q_a_layernorm.weight"] = L.q_norm
                reg[a + "q_b_proj.weight"] = L.q_b
            else:
                reg[a + "q_proj.weight"] = L.qkv_a[:q_in]
            reg[a + "kv_a_proj_with_mqa.weight"] = L.qkv_a[q_in:]
            reg[a + "kv_a_layernorm.weight"] = L.kv_norm
            reg[a + "kv_b_proj.weight"] = L.kv_b
            reg[a + "o_proj.weight"] = L.o
            m = p + "mlp."
            if not L.moe:
                n = c.intermediate_size
                reg[m + "gate_proj.weight"], reg[m + "up_proj.weight"] = L.gate_up[:n], L.gate_up[n:]
                reg[m + "down_proj.weight"] = L.down
                continue
            reg[m + "gate.weight"] = L.router
            reg[m + "gate.e_score_correction_bias"] = L.router_bias
            n = c.moe_intermediate_size
            for e in range(c.num_experts):
                reg[m + f"experts.{e}.gate_proj.weight"] = L.w13[e, :n]
                reg[m + f"experts.{e}.up_proj.weight"] = L.w13[e, n:]
                reg[m + f"experts.{e}.down_proj.weight"] = L.w2[e]
            if L.shared_gate_up is not None:
                ns = L.shared_down.shape[1]
                reg[m + "shared_experts.gate_proj.weight"] = L.shared_gate_up[:ns]
                reg[m + "shared_experts.up_proj.weight"] = L.shared_gate_up[ns:]
                reg[m + "shared_experts.down_proj.weight"] = L.shared_down
        return reg

    # transformers' in-memory fused expert tensors (the registry holds the per-expert on-disk names)
    _FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
    # buffers transformers may report that carry no weights
    _IGNORED = re.compile(r"(rotary_emb\.(inv_freq|original_inv_freq)$)|(^model\.layers\.\d+\.self_attn\.rotary_emb\.)")

    def weight_names(self) -> list[str]:
        return list(self._params)

    def _target(self, name: str) -> torch.Tensor | None:
        if name in self._params:
            return self._params[name]
        m = self._FUSED.match(name)
        if m and int(m.group(1)) < len(self.layers) and self.layers[int(m.group(1))].moe:
            L = self.layers[int(m.group(1))]
            return L.w13 if m.group(2) == "gate_up_proj" else L.w2
        if self._IGNORED.search(name):
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return self.lm_head
        raise EngineWeightError(
            f"weight {name!r} is not part of this DeepSeek-V3 model (wrong checkpoint or name mapping)")

    def check_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
        """Resolve names and shapes up front, so a bad payload changes nothing."""
        loads = []
        for name, src in named:
            dst = self._target(name)
            if dst is None:
                continue
            if tuple(src.shape) != tuple(dst.shape):
                raise EngineWeightError(
                    f"weight {name!r}: shape {tuple(src.shape)} but the engine expects {tuple(dst.shape)}")
            loads.append((dst, src, name))
        return loads

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                     strict: bool = False) -> list[str]:
        """Copy HF-named tensors in place (dtype/device converted). strict: every engine weight must be covered."""

        items = named.items() if isinstance(named, Mapping) else named
        try:
            loads = self.check_weights(self._parts.feed(self._language_model(items)))
        except QuantFormatError as e:
            raise EngineWeightError(str(e)) from None
        if strict:
            self.finish_update()
            missing = [n for n in self._params if n not in self._covered(loads)]
            if missing:
                raise EngineWeightError(f"checkpoint is missing {len(missing)} engine weights, e.g. {missing[:3]}")
        if self._released:
            raise EngineWeightError("the engine's weights are released: resume_memory_occupation(weights) first")
        for dst, src, _ in loads:
            dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
        for layer in self.layers:
            layer.refresh(self.config)
        self._note_storage()
        self.unloaded -= self._covered(loads)
        return [n for _, _, n in loads]

    def _language_model(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's weights under the registry's names: the served checkpoint's prefix taken off, its
        other parts (K2.5's vision tower and projector, which a text rollout never runs) left out."""
        for name, t in items:
            if self.layout.misplaced(name):
                raise EngineWeightError(
                    f"weight {name!r}: this engine serves a checkpoint that stores its language model under "
                    f"{self.layout.prefix!r}; send {self.layout.stored(name)!r} (hf.names.HFLayout)")
            logical = self.layout.logical(name)
            if logical is not None:
                yield logical, t

    def _covered(self, loads) -> set[str]:
        """The registry names these loads fill (a fused expert tensor fills every expert's parts)."""
        covered = set()
        for _, _, name in loads:
            m = self._FUSED.match(name)
            if m:
                stem = f"model.layers.{m.group(1)}.mlp.experts."
                parts = ("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else ("down_proj",)
                covered.update(stem + f"{e}.{p}.weight" for e in range(self.config.num_experts) for p in parts)
            else:
                covered.add(name)
        return covered

    def _note_storage(self) -> None:
        storage = self._storage_signature()
        if storage != self._storage:
            self._storage, self.storage_epoch = storage, self.storage_epoch + 1

    # ------------------------------------------------------------------ memory handoff (colocated)
    def _tensors(self) -> list[torch.Tensor]:
        tensors = [self.embed, self.lm_head, self.final_norm, self.cos, self.sin, self._expert_ids]
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        return tensors

    @torch.no_grad()
    def release_weights(self) -> None:
        """Free the device memory of every tensor the forward reads, as SGLang's memory saver pauses its weights
        region (`scheduler_components/weight_updater.py:361-367`): the values are gone. What no weight sync
        brings back (rope tables, expert ids: SGLang's "static state", stashed at :364) is kept on the host.
        Generation is refused until `resume_weights` and a sync that fills every weight."""
        if self._released:
            return
        self._static = {k: getattr(self, k).to("cpu", copy=True) for k in ("cos", "sin", "_expert_ids")}
        seen = {}
        for t in self._tensors():
            st = t.untyped_storage()
            seen.setdefault(st.data_ptr(), (st, st.nbytes()))
        self._released = list(seen.values())
        for st, _ in self._released:
            st.resize_(0)
        self.unloaded = set(self._params)

    @torch.no_grad()
    def resume_weights(self) -> None:
        """Take the memory back (values undefined until the next sync) and restore the static state."""
        if not self._released:
            return
        for st, nbytes in self._released:
            st.resize_(nbytes)
        self._released = []
        for k, v in self._static.items():
            getattr(self, k).copy_(v)
        self._static = {}
        self._note_storage()  # new addresses: captured graphs are dropped

    def unready_reason(self) -> str | None:
        """Why the model cannot generate now (weights released, or resumed and not all synced), else None."""
        if self._released:
            return "its weights are released (release_memory_occupation): resume_memory_occupation first"
        if self.unloaded:
            return (f"{len(self.unloaded)} of {len(self._params)} weights have not been loaded since its memory was "
                    f"resumed, e.g. {sorted(self.unloaded)[:2]}: sync the weights first")
        return None

    def _storage_signature(self) -> tuple[int, ...]:
        """The addresses of every tensor the forward reads (weights, derived weights, rope tables)."""
        return tuple(t.data_ptr() for t in self._tensors())

    def finish_update(self) -> None:
        """After the last bucket of a sync: no quantized weight may be left waiting for its other parts."""

        try:
            self._parts.check_complete()
        except QuantFormatError as e:
            raise EngineWeightError(str(e)) from None

    # ------------------------------------------------------------------ rope
    def _init_rope(self, hf_config) -> None:
        """cos/sin tables of every position from the rotary parameters (`rope_frequencies`: YaRN inv_freq and
        attention factor, or plain RoPE)."""
        c = self.config
        inv_freq, scale = rope_frequencies(hf_config)
        inv_freq, scale = inv_freq.float().cpu(), float(scale)
        pos = torch.arange(c.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        self.cos = (freqs.cos() * scale).to(self.device, self.dtype)
        self.sin = (freqs.sin() * scale).to(self.device, self.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, heads, d]; cos/sin [N, 1, d/2] of its positions. The interleaved variant returns (evens, odds)
        de-interleaved, as transformers does; q and k get the same permutation, so dot products are unchanged."""
        if self.config.rope_interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    # ------------------------------------------------------------------ forward
    def new_cache(self, batch: int, length: int) -> torch.Tensor:
        """[layers, batch, length, kv_lora_rank + qk_rope_head_dim]: normalized kv latent ‖ roped shared key.

        Zeroed, not empty: masked slots still enter q·k before the -inf mask, and NaN garbage would survive it."""
        c = self.config
        return torch.zeros(c.num_layers, batch, length, c.latent_dim, device=self.device, dtype=self.dtype)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, all_logits: bool = False, lengths: torch.Tensor | None = None):
        """Right-padded prompts ids [B, S] at positions 0..S-1.

        Returns (logits, cache [layers, B, S, latent], experts [B, S, moe_layers, topk] int16). logits are
        [B, S, V] if all_logits else the last real position's [B, V] (from `lengths`, default S).
        Padding sits after each prompt, so causal masking alone keeps it out of every real position.
        Scores are materialized ([B, S*heads, S]): right for short rollout prompts, not for long contexts
        (those belong on SGLang).
        """
        B, S = ids.shape
        pos = torch.arange(S, device=self.device)
        cache = self.new_cache(B, S)
        causal = torch.ones(S, S, dtype=torch.bool, device=self.device).tril()
        bias = torch.zeros(S, S, device=self.device, dtype=self.dtype).masked_fill(~causal, float("-inf"))
        # scores are [B, S*heads, S]: row (s, h) gets query position s's mask
        bias = bias[:, None, :].expand(S, self.config.num_heads, S).reshape(1, S * self.config.num_heads, S)
        h, experts = self._forward(ids.reshape(-1), pos.repeat(B), B, S, cache, None, S, bias)
        h = h.view(B, S, -1)
        if all_logits:
            logits = self._logits(h)
        else:
            last = (lengths - 1) if lengths is not None else torch.full((B,), S - 1, device=self.device)
            logits = self._logits(h[torch.arange(B, device=self.device), last])
        return logits, cache, experts.view(B, S, *experts.shape[1:])

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, kv_len: int):
        """One token per row: ids [B] at positions [B]; writes the cache there and attends to [0, kv_len).

        Returns (logits [B, V], experts [B, moe_layers, topk] int16).
        """
        B = ids.shape[0]
        h, experts = self._forward(ids, positions, B, 1, cache, positions, kv_len, self._decode_bias(positions, kv_len))
        return self._logits(h), experts

    @torch.inference_mode()
    def decode_static(self, ids: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor):
        """`decode` with every shape fixed by the arguments' shapes, so one CUDA graph can capture it.

        cache [layers, B, L, latent] (a view of a persistent buffer): each row attends all L slots, those beyond its
        position masked to -inf (no host-side kv_len), and the routed experts run without host syncs
        (`_moe(static=True)`). A row a caller pads with id 0 at position 0 writes its own slot 0 and reads only that.
        Returns (logits [B, V] fp32, experts [B, moe_layers, topk] int16) like `decode`.
        """
        B, L = ids.shape[0], cache.shape[2]
        h, experts = self._forward(ids, positions, B, 1, cache, positions, L, self._decode_bias(positions, L),
                                   static=True)
        return self._logits(h), experts

    def _decode_bias(self, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """[B, 1, kv_len]: 0 for keys at or before each row's position, -inf after."""
        keys = torch.arange(kv_len, device=self.device)
        bias = torch.zeros(positions.shape[0], 1, kv_len, device=self.device, dtype=self.dtype)
        return bias.masked_fill_(keys[None, None, :] > positions[:, None, None], float("-inf"))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms(h, self.final_norm, self.config.rms_norm_eps), self.lm_head).float()

    def _forward(self, ids, positions, B, S, cache, write_pos, kv_len, bias, static: bool = False):
        """Token-flattened forward (N = B*S rows). write_pos None: fill cache[:, :, :S] (prefill).
        static: the experts' sync-free variant (see `_moe`)."""
        c = self.config
        h = F.embedding(ids, self.embed)
        experts = []
        rows = torch.arange(B, device=self.device) if write_pos is not None else None
        rot = (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))  # shared by all layers
        for li, L in enumerate(self.layers):
            x = _rms(h, L.in_norm, c.rms_norm_eps)
            h = h + self._attention(L, x, rot, B, S, cache[li], rows, write_pos, kv_len, bias)
            x = _rms(h, L.post_norm, c.rms_norm_eps)
            if L.moe:
                y, idx = self._moe(L, x, static)
                experts.append(idx)
            else:
                g, u = F.linear(x, L.gate_up).chunk(2, dim=-1)
                y = F.linear(F.silu(g) * u, L.down)
            h = h + y
        if experts:
            ex = torch.stack(experts, dim=1).to(torch.int16)
        else:
            ex = torch.empty(h.shape[0], 0, c.topk, dtype=torch.int16, device=self.device)
        return h, ex

    def _attention(self, L: _Layer, x, rot, B, S, cache, rows, write_pos, kv_len, bias):
        c = self.config
        nh, dn, dr, r = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        N, merged = x.shape[0], c.merge_absorbed
        a = F.linear(x, L.qkv_a_eff)
        q_in = a.shape[1] - c.latent_dim
        q, kv, k_pe = a[:, :q_in], a[:, q_in : q_in + r], a[:, q_in + r :]
        if L.q_b is not None:
            q = F.linear(_rms(q, L.q_norm, LATENT_NORM_EPS), L.q_eff)
        dq = r if merged else dn  # merged: the query already lives in latent space
        q = q.view(N, nh, dq + dr)
        kv = _rms(kv, L.kv_norm, LATENT_NORM_EPS)
        # rope on the query heads and the shared key in one call
        pe = self._rope(torch.cat((q[..., dq:], k_pe.view(N, 1, dr)), dim=1), *rot)
        w_uk, w_uv = L.kv_b_views(c)
        if merged:
            q_lat = q[..., :r]
        else:
            q_lat = torch.bmm(q[..., :dn].transpose(0, 1), w_uk).transpose(0, 1)  # [N, nh, r]
        q_cat = torch.cat((q_lat, pe[:, :nh]), dim=-1)  # [N, nh, r + dr]
        latent = torch.cat((kv, pe[:, nh]), dim=-1)  # [N, r + dr]
        if write_pos is None:
            cache[:, :S] = latent.view(B, S, -1)
        else:
            cache[rows, write_pos] = latent
        keys = cache[:, :kv_len]
        scores = torch.baddbmm(bias, q_cat.reshape(B, S * nh, r + dr), keys.transpose(1, 2), alpha=c.softmax_scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
        o_lat = torch.bmm(probs, keys[..., :r])
        if merged:
            return F.linear(o_lat.view(N, nh * r), L.o_eff)
        o = torch.bmm(o_lat.view(N, nh, r).transpose(0, 1), w_uv.transpose(1, 2))  # [nh, N, v]
        return F.linear(o.transpose(0, 1).reshape(N, nh * c.v_head_dim), L.o)

    def _route(self, L: _Layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' noaux_tc routing: sigmoid scores, bias-corrected (group-limited) top-k, renormalized."""
        c = self.config
        scores = F.linear(x.float(), L.router).sigmoid()
        choice = scores + L.router_bias
        if c.n_group > 1:
            E = c.num_experts
            groups = choice.view(-1, c.n_group, E // c.n_group).topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(groups).scatter_(1, groups.topk(c.topk_group, dim=-1, sorted=False)[1], 1.0)
            keep = keep.unsqueeze(-1).expand(-1, c.n_group, E // c.n_group).reshape(-1, E)
            choice = choice.masked_fill(~keep.bool(), float("-inf"))
        idx = choice.topk(c.topk, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if c.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, w * c.routed_scaling_factor

    def _moe(self, L: _Layer, x: torch.Tensor, static: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Routed (+ shared) experts of tokens x [N, H]. static: no host syncs, so a CUDA graph can capture it
        (group ends from the sorted expert ids instead of bincount, which reads its input's max on the host on
        CUDA: aten/src/ATen/native/cuda/SummaryOps.cu, _bincount_cuda_template). Either way each token's expert
        outputs are summed in a fixed order, not by index_add_: its atomic adds on CUDA round differently run to
        run, so two prefills of one prompt differed in the last bits and a seeded sample drifted (seen on an H200)."""
        c = self.config
        idx, w = self._route(L, x)
        flat = idx.reshape(-1)
        if static:
            ranked, order = flat.sort(stable=True)
            counts, offs = None, torch.searchsorted(ranked, self._expert_ids, right=True, out_int32=True)
        else:
            order = flat.argsort(stable=True)  # assignments sorted by expert
            counts, offs = torch.bincount(flat, minlength=c.num_experts), None
        tok = order // c.topk
        xs = x.index_select(0, tok)
        hs = self._grouped(xs, L.w13, counts, offs)
        g, u = hs.chunk(2, dim=-1)
        # the routing weight scales the (narrower) activation rather than the output: same product
        act = F.silu(g) * (u * w.reshape(-1)[order].unsqueeze(1).to(u.dtype))
        out = self._grouped(act, L.w2, counts, offs)
        # back to (token, slot) order, then the topk slots of each token summed
        y = out.new_empty(out.shape).index_copy_(0, order, out).view(x.shape[0], c.topk, -1).sum(dim=1)
        if L.shared_gate_up is not None:
            g, u = F.linear(x, L.shared_gate_up).chunk(2, dim=-1)
            y = y + F.linear(F.silu(g) * u, L.shared_down)
        return y, idx

    @staticmethod
    def _grouped(xs: torch.Tensor, w: torch.Tensor, counts: torch.Tensor | None,
                 offs: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of xs sorted by expert; w [E, out, in]: out_rows = xs_rows @ w[e].T, one grouped matmul.
        Group sizes as counts [E], or as their running sums offs [E] int32 (what grouped_mm takes)."""
        if grouped_mm_supported(xs, w.shape[1], w.shape[2]):
            if offs is None:
                offs = counts.cumsum(0).to(torch.int32)
            return F.grouped_mm(xs, w.transpose(1, 2), offs=offs)
        if counts is None:
            counts = torch.diff(offs, prepend=offs.new_zeros(1))
        out, start = xs.new_empty(xs.shape[0], w.shape[1]), 0  # fallback: per-expert matmuls
        for e, n in enumerate(counts.tolist()):
            if n:
                out[start : start + n] = F.linear(xs[start : start + n], w[e])
                start += n
        return out


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stored tensor of a checkpoint directory (hf_reader's pass), its errors as EngineWeightError,
    which the server's update_weights_from_disk answers. Imported here: hf_reader pulls in the recipes,
    which the engine server does not otherwise load."""

    try:
        yield from iter_stored_tensors(model_dir)
    except HFCheckpointError as e:
        raise EngineWeightError(str(e)) from None


def config_summary(c: EngineConfig) -> dict[str, Any]:
    """What a client needs to decode routed experts (SGLang's layout: all layers × topk)."""
    return {
        "num_hidden_layers": c.num_layers,
        "first_k_dense_replace": c.first_k_dense,
        "num_experts_per_tok": c.topk,
        "n_routed_experts": c.num_experts,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "eos_token_ids": list(c.eos_token_ids),
    }
