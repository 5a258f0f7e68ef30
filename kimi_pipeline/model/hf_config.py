"""ModelSpec <-> HF config.json (DeepSeek-V3 keys, `model_type` as Kimi ships it).

Kimi's config says `model_type: kimi_k2` (K2.5: `kimi_k25` with the text model under
`text_config`); it is the DeepSeek-V3 architecture, which is how upstream converters treat it.
"""

from __future__ import annotations

from typing import Any

from kimi_pipeline.recipes.models import ModelSpec

KIMI_MODEL_TYPES = {"kimi_k2", "kimi_k25", "deepseek_v3"}


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


def text_config(config: dict[str, Any], key: str | None) -> dict[str, Any]:
    """The language-model part of a config (K2.5 nests it under `text_config`)."""
    if key and isinstance(config.get(key), dict):
        return config[key]
    return config


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
