"""ModelSpec <-> HF config.json (DeepSeek-V3 keys, `model_type` as Kimi ships it).

Kimi's config says `model_type: kimi_k2` (K2.5: `kimi_k25` with the text model under
`text_config`); it is the DeepSeek-V3 architecture, which is how upstream converters treat it.
"""

from __future__ import annotations

import copy
from typing import Any

from kimi_pipeline.recipes.models import ModelSpec

KIMI_MODEL_TYPES = {"kimi_k2", "kimi_k25", "deepseek_v3"}
# Multimodal checkpoints nest the language model's config: Kimi-K2.5 (`kimi_k25`,
# KimiK25ForConditionalGeneration) keeps it under `text_config`, beside `vision_config`.
TEXT_CONFIG_KEY_BY_MODEL_TYPE = {"kimi_k25": "text_config"}


def hf_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """The config.json a Kimi-K2-shaped checkpoint of this spec carries."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": spec.model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size,
        "moe_intermediate_size": spec.moe_ffn_hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_attention_heads,
        "n_shared_experts": spec.num_shared_experts,
        "n_routed_experts": spec.num_experts,
        "num_experts_per_tok": spec.moe_router_topk,
        "routed_scaling_factor": spec.moe_router_topk_scaling_factor,
        "scoring_func": spec.moe_router_score_function,
        "topk_method": "noaux_tc" if spec.moe_router_enable_expert_bias else "greedy",
        "n_group": spec.moe_router_num_groups,
        "topk_group": spec.moe_router_group_topk,
        "norm_topk_prob": True,
        "first_k_dense_replace": spec.first_k_dense,
        "moe_layer_freq": 1,
        "q_lora_rank": spec.q_lora_rank,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.qk_head_dim,
        "qk_rope_head_dim": spec.qk_pos_emb_head_dim,
        "v_head_dim": spec.v_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.norm_epsilon,
        "rope_theta": spec.rotary_base,
        "rope_scaling": {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": spec.rotary_scaling_factor,
            "original_max_position_embeddings": spec.original_max_position_embeddings,
            "beta_fast": spec.beta_fast,
            "beta_slow": spec.beta_slow,
            "mscale": spec.mscale,
            "mscale_all_dim": spec.mscale_all_dim,
        },
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": spec.params_dtype,
        "bos_token_id": 1,
        "eos_token_id": 3,
        "pad_token_id": 0,
    }


# (config.json key, ModelSpec attribute) pairs that must agree for the recipe to describe the checkpoint.
SHAPE_KEYS = [
    ("hidden_size", "hidden_size"),
    ("intermediate_size", "ffn_hidden_size"),
    ("moe_intermediate_size", "moe_ffn_hidden_size"),
    ("num_hidden_layers", "num_layers"),
    ("num_attention_heads", "num_attention_heads"),
    ("n_routed_experts", "num_experts"),
    ("num_experts_per_tok", "moe_router_topk"),
    ("n_shared_experts", "num_shared_experts"),
    ("first_k_dense_replace", "first_k_dense"),
    ("q_lora_rank", "q_lora_rank"),
    ("kv_lora_rank", "kv_lora_rank"),
    ("qk_nope_head_dim", "qk_head_dim"),
    ("qk_rope_head_dim", "qk_pos_emb_head_dim"),
    ("v_head_dim", "v_head_dim"),
    ("vocab_size", "vocab_size"),
]


def text_config_key(config: dict[str, Any], key: str | None = None) -> str | None:
    """The key of the language model's nested config: `key` when given (the recipe's hub.text_config_key), else
    the one the config's model_type nests it under (K2.5: text_config), else None (a causal-LM config)."""
    key = key or TEXT_CONFIG_KEY_BY_MODEL_TYPE.get(config.get("model_type"))
    return key if key and isinstance(config.get(key), dict) else None


def text_config(config: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    """The language-model part of a config (K2.5 nests it under `text_config`)."""
    nested = text_config_key(config, key)
    return config[nested] if nested else config


def quantization_config(config: dict[str, Any], key: str | None = None) -> dict[str, Any] | None:
    """A checkpoint's `quantization_config`: the language model's own (K2.5 nests it in text_config), else the
    top-level one."""
    return text_config(config, key).get("quantization_config") or config.get("quantization_config")


def with_quantization_config(config: dict[str, Any], qc: dict[str, Any] | None, dtype: str) -> dict[str, Any]:
    """A copy of `config` declaring `qc` (None: unquantized) and `dtype`, `qc` where the checkpoint keeps it: where
    `config` had one (K2.5 ships it in text_config), else in the language model's config; never two copies."""
    out = copy.deepcopy(config)
    nested = text_config_key(out)
    text = out[nested] if nested else out
    target = out if nested and "quantization_config" in out and "quantization_config" not in text else text
    for part in (out, text):
        part.pop("quantization_config", None)
        if "torch_dtype" in part or part is text:
            part["torch_dtype"] = dtype
    if qc is not None:
        target["quantization_config"] = qc
    return out


def shape_mismatches(spec: ModelSpec, config: dict[str, Any]) -> list[str]:
    """Differences between the recipe's model shape and a checkpoint's config.json."""
    out = []
    for key, attr in SHAPE_KEYS:
        if key not in config:
            out.append(f"{key}: missing from config.json (recipe model.{attr}={getattr(spec, attr)})")
        elif config[key] != getattr(spec, attr):
            out.append(f"{key}: checkpoint has {config[key]!r}, recipe model.{attr}={getattr(spec, attr)!r}")
    scaling = config.get("routed_scaling_factor")
    if scaling is not None and abs(float(scaling) - spec.moe_router_topk_scaling_factor) > 1e-6:
        out.append(
            f"routed_scaling_factor: checkpoint has {scaling}, recipe model.moe_router_topk_scaling_factor="
            f"{spec.moe_router_topk_scaling_factor}"
        )
    mt = config.get("model_type")
    if mt is not None and mt not in KIMI_MODEL_TYPES:
        out.append(f"model_type: {mt!r} is not a Kimi/DeepSeek-V3 architecture ({', '.join(sorted(KIMI_MODEL_TYPES))})")
    return out


# (vision_config key, VisionSpec attribute): K2.5's remote code names the tower's sizes vt_*.
VISION_KEYS = [
    ("vt_num_hidden_layers", "num_layers"),
    ("vt_hidden_size", "hidden_size"),
    ("vt_intermediate_size", "ffn_hidden_size"),
    ("vt_num_attention_heads", "num_attention_heads"),
    ("patch_size", "patch_size"),
    ("init_pos_emb_height", "pos_emb_height"),
    ("init_pos_emb_width", "pos_emb_width"),
]


def vision_mismatches(spec: ModelSpec, config: dict[str, Any]) -> list[str]:
    """Differences between the recipe's `model.vision` and a multimodal checkpoint's `vision_config` (both absent:
    a text-only model, none)."""
    vc, v = config.get("vision_config"), spec.vision
    if vc is None and v is None:
        return []
    if vc is None:
        return ["vision_config: missing from config.json, but the recipe has model.vision (a K2.5 recipe on a "
                "text-only checkpoint?)"]
    if v is None:
        return ["vision_config: the checkpoint ships a vision tower, but the recipe has no model.vision; set it "
                "(the kimi-k2.5 preset does) so that `kimi plan` counts the weights the engines hold"]
    out = [f"vision_config.{key}: checkpoint has {vc.get(key)!r}, recipe model.vision.{attr}={getattr(v, attr)!r}"
           for key, attr in VISION_KEYS if vc.get(key) != getattr(v, attr)]
    if list(vc.get("merge_kernel_size", [])) != list(v.merge_kernel_size):
        out.append(f"vision_config.merge_kernel_size: checkpoint has {vc.get('merge_kernel_size')!r}, recipe "
                   f"model.vision.merge_kernel_size={list(v.merge_kernel_size)!r}")
    return out
