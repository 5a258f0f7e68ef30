"""Parameter counts from the ModelSpec alone (DeepSeek-V3 / Kimi-K2 shape: MLA + sigmoid-routed MoE).

Every memory and FLOP figure of `kimi plan` derives from these counts, so they are split the way the
trainer shards them: pieces tensor parallel splits, pieces it duplicates on every TP rank, and routed
experts (split by expert parallel).

Kimi-K2 (K2-Instruct / K2-Thinking shape) comes out at 1,026,408,232,448 parameters, exactly the logical
count of the released safetensors (router `e_score_correction_bias` included). The K2 report rounds this
to "1.04 T"; no per-tensor convention reproduces 1.04 T from config.json (an extra MTP layer would, but
K2 ships none), so we report the checkpoint-exact 1.026 T (1.3 % below the headline).

Active parameters per token follow the published convention (it is what matches 32.6 B best): attention,
norms, the dense layer, the router, the top-k routed plus the shared experts of every MoE layer, and both
the input embedding and the untied lm_head: 32.86 B for K2 (+0.8 % vs 32.6 B). Dropping the input
embedding (a lookup, no FLOPs) gives 31.69 B (-2.8 %), so the published figure counts it;
`active_matmul` is that embedding-free number and is what the FLOP model uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimi_pipeline.recipes.models import ModelSpec


@dataclass(frozen=True)
class ParamCounts:
    """Per-piece parameter counts of one model; per-layer fields are for a single layer."""

    attn_split: int  # q_b (or q), kv_b, o: split by tensor parallel
    attn_replicated: int  # q_a, kv_a and their norms: duplicated on every TP rank (megatron-core TE spec)
    layer_norms: int  # input_layernorm + pre_mlp_layernorm
    dense_mlp: int  # gate + up + down of a dense layer
    router: int  # router weight E x hidden (+ expert bias E)
    expert: int  # one routed expert (gate + up + down)
    shared: int  # all shared experts of one MoE layer
    embedding: int
    lm_head: int  # 0 when tied
    final_norm: int
    num_layers: int
    first_k_dense: int
    num_experts: int
    topk: int

    @property
    def attention(self) -> int:
        return self.attn_split + self.attn_replicated

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense

    @property
    def dense_layer(self) -> int:
        return self.attention + self.layer_norms + self.dense_mlp

    @property
    def moe_layer(self) -> int:
        return self.attention + self.layer_norms + self.router + self.num_experts * self.expert + self.shared

    @property
    def routed_experts(self) -> int:
        """All routed-expert parameters of the model (the part expert parallel splits)."""
        return self.num_moe_layers * self.num_experts * self.expert

    @property
    def total(self) -> int:
        return (
            self.first_k_dense * self.dense_layer
            + self.num_moe_layers * self.moe_layer
            + self.embedding
            + self.lm_head
            + self.final_norm
        )

    @property
    def active(self) -> int:
        """Parameters one token touches, published convention (embeddings included)."""
        inactive = self.num_moe_layers * (self.num_experts - self.topk) * self.expert
        return self.total - inactive

    @property
    def active_matmul(self) -> int:
        """Active parameters that cost FLOPs: the input embedding is a lookup and is left out."""
        return self.active - self.embedding


def mla_attention(m: ModelSpec) -> tuple[int, int]:
    """(TP-split, TP-replicated) parameters of one MLA attention block."""
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    heads = m.num_attention_heads
    if m.q_lora_rank is None:
        q_split, q_rep = m.hidden_size * heads * q_head, 0
    else:
        q_split = m.q_lora_rank * heads * q_head  # q_b
        q_rep = m.hidden_size * m.q_lora_rank + m.q_lora_rank  # q_a + q_a_layernorm
    kv_rep = m.hidden_size * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank  # kv_a(+mqa rope) + norm
    kv_split = m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim)  # kv_b
    o_split = heads * m.v_head_dim * m.hidden_size
    return q_split + kv_split + o_split, q_rep + kv_rep


def count_params(m: ModelSpec) -> ParamCounts:
    """Count every parameter of the model described by `m`."""
    h = m.hidden_size
    attn_split, attn_rep = mla_attention(m)
    expert = 3 * h * m.moe_ffn_hidden_size
    return ParamCounts(
        attn_split=attn_split,
        attn_replicated=attn_rep,
        layer_norms=2 * h,
        dense_mlp=3 * h * m.ffn_hidden_size,
        router=h * m.num_experts + (m.num_experts if m.moe_router_enable_expert_bias else 0),
        expert=expert,
        shared=m.num_shared_experts * expert,
        embedding=m.vocab_size * h,
        lm_head=0 if m.tie_word_embeddings else m.vocab_size * h,
        final_norm=h,
        num_layers=m.num_layers,
        first_k_dense=min(m.first_k_dense, m.num_layers),
        num_experts=m.num_experts,
        topk=m.moe_router_topk,
    )


@dataclass(frozen=True)
class PPStageParams:
    """Parameters of one pipeline stage, grouped by how the trainer shards them."""

    tp_split: int  # divided by tensor parallel
    replicated: int  # whole on every TP rank
    experts: int  # routed experts, divided by EP x expert-TP
    layers: int
    dense_layers: int

    @property
    def dense(self) -> int:
        return self.tp_split + self.replicated

    @property
    def total(self) -> int:
        return self.dense + self.experts


def pp_stage_params(pc: ParamCounts, start: int, layers: int, first: bool, last: bool, pp: int, tied: bool) -> PPStageParams:
    """Parameters of the stage holding global layers [start, start+layers).

    The first stage holds the input embedding; the last stage holds the final norm and lm_head (with tied
    embeddings and pp > 1 Megatron keeps a second copy of the embedding there).
    """
    dense = max(0, min(start + layers, pc.first_k_dense) - start)
    moe = layers - dense
    split = layers * pc.attn_split + dense * pc.dense_mlp + moe * pc.shared
    rep = layers * (pc.attn_replicated + pc.layer_norms) + moe * pc.router
    if first:
        split += pc.embedding
    if last:
        split += pc.lm_head if not tied else (pc.embedding if pp > 1 else 0)
        rep += pc.final_norm
    return PPStageParams(split, rep, moe * pc.num_experts * pc.expert, layers, dense)
