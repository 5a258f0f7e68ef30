"""ModelSpec -> megatron-core GPTModel (MLA + sigmoid-routed MoE), matching HF DeepseekV3ForCausalLM.

Semantics follow transformers' DeepSeek-V3 implementation (the architecture Kimi-K2 ships):
sigmoid router scores in fp32, expert bias used for expert *selection* only, top-k weights normalised
then multiplied by the routed scaling factor, shared expert, first-k dense layers, YaRN rope with the
mscale_all_dim softmax scale, interleaved rope dims (megatron's MLA de-interleaves them like HF's
`rope_interleave`), RMSNorm, untied lm_head. Local (pure-PyTorch) layer specs on CPU or without
Transformer Engine; TE specs when TE is installed and the device is a GPU (parameter names differ: see
hf/names.py).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from kimi_pipeline.model.grouped_experts import stackable, stacked_experts
from kimi_pipeline.model.megatron_compat import apply_compat, megatron_kernels
from kimi_pipeline.recipes.layout import Layout, LayoutError
from kimi_pipeline.recipes.models import ModelSpec

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def use_te_default(device: torch.device) -> bool:
    """TE layer specs where Transformer Engine is installed and the model lives on a GPU; megatron's local
    modules everywhere else (a TE-less GPU runs the local modules the CPU tests run)."""
    return device.type == "cuda" and megatron_kernels()[0]


def fused_mla_rope(device: torch.device) -> bool:
    """Whether MLA applies YaRN RoPE with megatron's fused kernels (`fusions/fused_mla_yarn_rope_apply.py`, no TE
    needed): they are Triton kernels, so only where Triton runs them, a CUDA device with Triton installed
    (`HAVE_TRITON`, line 11-20). megatron takes them for training only (`multi_latent_attention.py:558` asserts no
    inference context; this project's forwards never pass one). Elsewhere MLA's unfused rope, the same maths."""
    if device.type != "cuda":
        return False
    try:
        from megatron.core.fusions import fused_mla_yarn_rope_apply
    except ImportError:
        return False
    return bool(fused_mla_yarn_rope_apply.HAVE_TRITON)


def _grad_accum_fusion_available() -> bool:
    from megatron.core.tensor_parallel import layers

    return bool(layers._grad_accum_fusion_available)


def _sdpa_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> int:
    """The SDPA kernel torch's dispatcher would run for causal attention on these inputs (`SDPBackend` value)."""
    return torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=scale)


def _process_backend() -> str | None:
    return torch.distributed.get_backend() if torch.distributed.is_initialized() else None


def moe_layer_pattern(spec: ModelSpec) -> list[int]:
    """megatron's moe_layer_freq list: 0 = dense (the first `first_k_dense` layers), 1 = MoE."""
    return [0 if i < spec.first_k_dense else 1 for i in range(spec.num_layers)]


def transformer_config(
    spec: ModelSpec,
    layout: Layout,
    *,
    device: torch.device,
    use_te: bool | None = None,
    expert_bias_update_rate: float = 0.0,
    recompute_granularity: str | None = None,
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
    **overrides: Any,
):
    """The MLATransformerConfig for `spec` under `layout`.

    expert_bias_update_rate: 0 keeps the router's expert bias fixed (the rollout engine routes with the
    same bias; aux-loss-free rebalancing is a pre-training mechanism). Extra keyword arguments override
    config fields (e.g. moe_enable_routing_replay=True).
    """
    apply_compat(device, _process_backend())
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    layout.check_model(spec)
    use_te = use_te_default(device) if use_te is None else use_te
    cuda = device.type == "cuda"
    groups = spec.moe_router_num_groups
    if groups > 1 and spec.moe_router_topk // spec.moe_router_group_topk != 2:
        # HF scores a group by its top-2 experts; megatron by its top-(topk/group_topk). Equal only here.
        raise LayoutError(
            f"model.moe_router_num_groups={groups}: group-limited routing matches HF only when "
            f"moe_router_topk / moe_router_group_topk == 2 (got {spec.moe_router_topk}/{spec.moe_router_group_topk})"
        )
    if layout.cp > 1 and not use_te:
        raise LayoutError("context parallelism (cp > 1) needs Transformer Engine attention (CUDA + TE)")
    dtype = _DTYPES[spec.params_dtype]
    kwargs: dict[str, Any] = dict(
        # shape
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        kv_channels=spec.v_head_dim,
        # MLA
        multi_latent_attention=True,
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_head_dim=spec.qk_head_dim,
        qk_pos_emb_head_dim=spec.qk_pos_emb_head_dim,
        v_head_dim=spec.v_head_dim,
        qk_layernorm=True,  # q_a_layernorm / kv_a_layernorm
        # YaRN rope
        rope_type="yarn",
        rotary_base=spec.rotary_base,
        rotary_scaling_factor=spec.rotary_scaling_factor,
        original_max_position_embeddings=spec.original_max_position_embeddings,
        beta_fast=spec.beta_fast,
        beta_slow=spec.beta_slow,
        mscale=spec.mscale,
        mscale_all_dim=spec.mscale_all_dim,
        rotary_interleaved=False,
        apply_rope_fusion=fused_mla_rope(device),
        # block
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        # MoE
        num_moe_experts=spec.num_experts,
        moe_layer_freq=moe_layer_pattern(spec),
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=(
            spec.moe_ffn_hidden_size * spec.num_shared_experts if spec.num_shared_experts else None
        ),
        moe_shared_expert_overlap=False,
        moe_router_topk=spec.moe_router_topk,
        moe_router_score_function=spec.moe_router_score_function,
        moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=spec.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=expert_bias_update_rate,
        moe_router_dtype=spec.moe_router_dtype,
        moe_router_topk_scaling_factor=spec.moe_router_topk_scaling_factor,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=spec.moe_router_group_topk if groups > 1 else None,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=use_te,
        # TE's fused (un)permute kernels (moe_utils.py:321-334 raise without TE); unfused, megatron_compat's TE-absent
        # rows keep the permutation free of host syncs
        moe_permute_fusion=use_te,
        moe_router_fusion=False,  # TE's fused top-k router: not checked against HF's group-limited sigmoid routing
        # parallelism
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        # MoE + TP requires SP in megatron, and MLA's shared rope key is only reduced correctly with it.
        sequence_parallel=layout.tp > 1,
        num_layers_in_first_pipeline_stage=layout.first_pp_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_pp_stage_layers,
        pipeline_dtype=dtype,
        variable_seq_lengths=True,
        # precision
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # recompute
        recompute_granularity=recompute_granularity,
        recompute_method=recompute_method,
        recompute_num_layers=recompute_num_layers,
        # on CUDA megatron creates its parallel layers' weights on the current device, build_model moves the rest
        # (local norms, router, modelopt Linear)
        use_cpu_initialization=not cuda,
        # kernels, each on unless its cause forbids it: SwiGLU and bias-dropout-add are megatron's own compiled
        # functions (core/fusions/fused_bias_swiglu.py, fused_bias_dropout.py: torch.compile where dynamo runs,
        # plain torch where it is off), so any device takes them
        bias_activation_fusion=True,
        bias_dropout_fusion=True,
        # the scaled masked softmax kernel is TE's (or apex's); the local attention takes SDPA for causal anyway
        masked_softmax_fusion=use_te,
        # wgrad accumulated into main_grad inside the GEMM: megatron's own output layer needs apex's
        # fused_weight_gradient_mlp_cuda for it (tensor_parallel/layers.py:924-931), TE's layers need TE
        gradient_accumulation_fusion=use_te and _grad_accum_fusion_available(),
        persist_layer_norm=False,  # apex's persistent LayerNorm: this model has RMSNorm only
        attention_backend=AttnBackend.auto if use_te else AttnBackend.local,
    )
    kwargs.update(overrides)
    return MLATransformerConfig(**kwargs)


@functools.cache
def _local_mla_core_attention() -> type:
    """megatron's local DotProductAttention, accepting the k/v channel arguments MLA passes.

    megatron-core 0.16.1's MLA always passes k_channels/v_channels, which only TE's attention accepts;
    the local module reads the value head size from config.kv_channels (= v_head_dim here) instead.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any):
            super().__init__(*args, **kwargs)
            if v_channels is not None and v_channels != self.config.kv_channels:
                raise ValueError(f"local MLA attention needs config.kv_channels == v_head_dim ({v_channels})")

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            """Causal attention through torch's fused SDPA where the spec's mask type is causal; anything else goes
            to megatron.

            - The mask type decides, not the mask tensor: the layer spec builds self-attention with
              `AttnMaskType.causal` (`models/gpt/gpt_layer_specs.py:116`) and MLA passes it on
              (`transformer/multi_latent_attention.py:300`), as TE's attention reads it. Comparing the tensor with a
              causal one was a host sync per layer and micro-batch.
            - q/k/v go in as [b, n, s, d] views of MLA's contiguous [s, b, n, d] tensors
              (`multi_latent_attention.py:268-273`): last dim contiguous, which every SDPA kernel takes (measured
              on CPU: as fast as copies; on CUDA the copies were pure traffic).
            - MLA's value heads are narrower than its query/key heads (K2: 128 vs 192). Where no fused kernel takes
              that (torch's choice for these inputs is its math path: on CPU, whose flash kernel needs one head
              size), V is zero-padded to the q/k size and the output sliced back: equal to float rounding
              (tested), 1.5x faster fwd+bwd on CPU at tiny's 48/32. On an H200 cuDNN's attention takes 192/128 as
              it is, and padding made it 1.6x slower (bench/gpu_attention.py), so there it stays unpadded.
            """
            from megatron.core.transformer.enums import AttnMaskType

            mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
            dropout = self.attention_dropout.p if self.training else 0.0
            if (dropout or attention_bias is not None or packed_seq_params is not None
                    or self.softmax_offset is not None or query.shape[2] != key.shape[2]
                    or mask_type != AttnMaskType.causal or query.shape[0] != key.shape[0]):
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d] views
            dv = v.shape[-1]
            if dv < q.shape[-1] and _sdpa_choice(q, k, v, self.softmax_scale) == SDPBackend.MATH.value:
                v = F.pad(v, (0, q.shape[-1] - dv))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)[..., :dv]
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)  # [s, b, n * dv]

    return MLADotProductAttention


# transformers' DeepSeek-V3 builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps (1e-6), not
# rms_norm_eps; megatron uses layernorm_epsilon for them. Kimi/DeepSeek ship 1e-6, so only small test
# models with another eps notice; the local spec reproduces HF exactly.
HF_LATENT_NORM_EPS = 1e-6


@functools.cache
def _latent_norm() -> type:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    class LatentRMSNorm:
        """megatron's torch RMSNorm with HF's fixed latent-norm eps."""

        def __new__(cls, config, hidden_size: int, eps: float = HF_LATENT_NORM_EPS, **kwargs: Any):
            return WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=HF_LATENT_NORM_EPS, **kwargs)

    return LatentRMSNorm


def decoder_block_spec(config, use_te: bool, pp_rank: int | None = None):
    """Layer specs for this pipeline stage (dense for the first_k_dense layers, MoE after)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm", pp_rank=pp_rank)
    if use_te and config.layernorm_epsilon != HF_LATENT_NORM_EPS:
        log.warning("TE spec: q/kv latent norms use eps %g, HF uses %g", config.layernorm_epsilon, HF_LATENT_NORM_EPS)
    if not use_te:
        from megatron.core.post_training.modelopt.layers import Linear
        from megatron.core.transformer.mlp import MLP
        from megatron.core.transformer.moe.experts import SequentialMLP

        attention = _local_mla_core_attention()
        stack = stackable(config, config.expert_tensor_parallel_size)
        for layer in block.layer_specs:
            sub = layer.submodules
            sub.self_attention.submodules.core_attention = attention
            # The local spec's column-parallel q/kv down projections drop the other TP ranks' gradient
            # of the shared rope key (k_pos_emb) in backward (measured: TP2 grads off by ~1%). Use
            # megatron's duplicated local Linear instead, as the TE spec does (duplicated TELinear).
            sub.self_attention.submodules.linear_q_down_proj = Linear
            sub.self_attention.submodules.linear_kv_down_proj = Linear
            sub.self_attention.submodules.q_layernorm = _latent_norm()
            sub.self_attention.submodules.kv_layernorm = _latent_norm()
            sub.sharded_state_dict_keys_map = dict(LOCAL_TO_TE_CHECKPOINT_KEYS)
            if sub.mlp.module is MLP:  # dense layer: TE fuses this norm into fc1
                sub.sharded_state_dict_keys_map.update(LOCAL_TO_TE_DENSE_KEYS)
            experts = getattr(getattr(sub.mlp, "submodules", None), "experts", None)
            if experts is not None and experts.module is SequentialMLP and stack:
                experts.module = stacked_experts()  # same weights and checkpoint layout, stacked, grouped GEMMs
    return block


# torch_dist checkpoint keys always use TE names, so a checkpoint written by a CPU (local spec) job loads
# into a TE model on GPU and back (same mapping as hf/names.py).
LOCAL_TO_TE_CHECKPOINT_KEYS = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}
LOCAL_TO_TE_DENSE_KEYS = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def build_model(
    spec: ModelSpec,
    layout: Layout,
    *,
    device: torch.device,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    use_te: bool | None = None,
    config=None,
    **config_overrides: Any,
):
    """The GPTModel of the current pipeline stage on `device`, every parameter and buffer (parallel_state must
    be initialised). megatron creates only its parallel layers on the GPU (`use_cpu_initialization=False`); the
    local spec's torch norms, the router weight and the modelopt Linear are created on the CPU and only DDP's
    buffers would move them, so a model used without DDP (the reference model, verification) is moved here."""
    apply_compat(device, _process_backend())
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    use_te = use_te_default(device) if use_te is None else use_te
    if config is None:
        config = transformer_config(spec, layout, device=device, use_te=use_te, **config_overrides)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_block_spec(config, use_te),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="none",  # MLA applies YaRN rope itself
    )
    if not use_te and config.perform_initialization:
        _init_duplicated_linears(model, config)
    model.to(device)  # in place: the same Parameter objects (DDP and megatron's param attributes keep them)
    model.kimi_use_te = use_te  # names.py reads which spec (TE or local) built the parameters
    return model


@torch.no_grad()
def _init_duplicated_linears(model, config) -> None:
    """megatron's local Linear keeps torch's default init; give it the model's init like every other layer."""
    from megatron.core.post_training.modelopt.layers import Linear

    for module in model.modules():
        if isinstance(module, Linear):
            config.init_method(module.weight)


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, s, s] boolean mask, True = masked (future positions): megatron's local attention needs it explicit."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def check_positions(position_ids: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """MLA applies rope to positions 0..s-1 regardless of position_ids: only those are accepted."""
    expected = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    if position_ids is not None and not torch.equal(position_ids.to(expected), expected):
        raise ValueError(
            "megatron MLA uses positions 0..s-1 for every row; right-pad sequences instead of left-padding"
        )
    return expected


def causal_forward(model, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [b, s, vocab/tp] (vocab-parallel on TP>1) with an explicit causal mask; last stage only."""
    position_ids = check_positions(position_ids, tokens)
    mask = causal_mask(tokens.shape[1], device=tokens.device)
    return model(tokens, position_ids, mask)


def unwrap(model) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (or a one-element list of chunks)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise NotImplementedError("virtual pipeline stages (several model chunks per rank) are not supported")
        model = model[0]
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model
