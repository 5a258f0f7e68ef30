"""Per-GPU and per-node memory of a recipe's layout: the Megatron actor, the colocated SGLang engine, host RAM.

Why a model rather than a try: a Kimi layout needs 256 GPUs to find out it does not fit. The terms follow
what Megatron and SGLang allocate, and every guess is a named assumption printed with the plan.
All `_gb` figures are GiB (2**30 bytes).

Training actor, per GPU of the most-loaded pipeline stage:
  weights      bf16, 2 B/param; dense part / TP (the MLA down-projections, norms and router are duplicated
               on every TP rank, as megatron-core's TE spec builds them), routed experts / (EP x expert-TP)
  grads        fp32 main grads (accumulate-allreduce-grads-in-fp32), 4 B/param, not sharded
  optimizer    fp32 master + Adam m + v, 12 B/param, sharded by the distributed optimizer over DP x CP (dense)
               and expert-DP = world / (EP x ETP x PP) (experts); optimizer_cpu_offload moves them to host RAM
               => weights + grads + optimizer = 6 + 12/DP B/param: Megatron's theoretical_memory_usage rule
  activations  1F1B in-flight micro-batches x what the recompute setting stores, + one rebuilt chunk, + logits
SGLang engine, per GPU: weights in the served format at its TP / EP / DP-attention split; KV cache =
mem_fraction_static x GPU - weights; CUDA graphs (a rough, printed fit).
Host, per node: CPU optimizer states, the sleeping actor's backup, weight copies, checkpoint staging.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kimi_pipeline.model.params import ParamCounts, PPStageParams, pp_stage_params
from kimi_pipeline.plan.hardware import GPU
from kimi_pipeline.recipes.checks import PipelineSplitError, pipeline_layers
from kimi_pipeline.recipes.recipe import Recipe
from kimi_pipeline.weight_sync.formats import engine_weight_format

GIB = float(2**30)
BYTES_PARAM = 2  # bf16 model weights
BYTES_GRAD = 4  # fp32 main grads
BYTES_OPTIM = 12  # fp32 master weights + Adam exp_avg + exp_avg_sq
BYTES_CPU_GRAD = 4  # fp32 grad copy the CPU optimizer steps on (pinned when d2h/h2d overlap is on)


def megatron_bytes_per_param(distributed_optimizer: bool, dp: int) -> float:
    """Weights + grads + optimizer bytes per parameter, as Megatron-LM's theoretical memory formula states."""
    return 18.0 if not distributed_optimizer else 6.0 + 12.0 / dp


@dataclass(frozen=True)
class PlanLayout:
    """The training layout the plan evaluates (the recipe's, or one shrunk to fit fewer nodes). Unlike
    `model.parallel.Layout`, which refuses a layout that cannot run, it holds any layout so the plan can say why."""

    nodes: int
    gpus_per_node: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    first: int | None = None
    last: int | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dense_dp(self) -> int:
        """Ranks the distributed optimizer shards dense parameters over (Megatron's DP x CP group)."""
        return max(1, self.dp * self.cp)

    @property
    def expert_dp(self) -> int:
        return max(1, self.world // (self.ep * self.etp * self.pp))

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(world=self.world, expert_dp=self.expert_dp)
        return d


def layout_from_recipe(r: Recipe) -> PlanLayout:
    parallel, cluster = r.parallel, r.cluster
    return PlanLayout(
        cluster.nodes,
        cluster.gpus_per_node,
        parallel.tp,
        parallel.pp,
        parallel.cp,
        parallel.ep,
        parallel.etp,
        r.data_parallel_size,
        parallel.decoder_first_pipeline_num_layers,
        parallel.decoder_last_pipeline_num_layers,
    )


def pp_stage_layers_or_guess(num_layers: int, lay: PlanLayout) -> tuple[list[int], str | None]:
    """Layers per pipeline stage; on an impossible split, an as-even-as-possible guess plus the problem."""
    try:
        return pipeline_layers(num_layers, lay.pp, lay.first, lay.last), None
    except PipelineSplitError as e:
        pp = max(1, lay.pp)
        base, extra = divmod(num_layers, pp)
        return [base + (1 if i < extra else 0) for i in range(pp)], f"{e.field}: {e}"


@dataclass(frozen=True)
class MemoryAssumptions:
    """Guesses the memory model rests on; all printed with the plan."""

    residual_gb: float = 3.0  # CUDA contexts of trainer + engine, NCCL buffers, allocator fragmentation
    sglang_workspace_gb: float = 3.0  # SGLang forward workspace outside its static pool
    logits_bytes: int = 10  # per vocab entry per token on the last stage: bf16 logits + fp32 log-softmax + grad
    host_base_gb: float = 32.0  # OS, Ray, page cache floor per node
    host_per_gpu_gb: float = 8.0  # trainer + SGLang scheduler/tokenizer processes per GPU
    checkpoint_staging: bool = True  # saving stages each rank's GPU-resident state (weights, GPU optimizer) in host RAM
    graph_base_gb: float = 0.25  # CUDA-graph pool: base + per captured graph + per max batch entry
    graph_per_graph_gb: float = 0.02
    graph_per_bs_gb: float = 0.004


# --------------------------------------------------------------------------------------------------
# training actor


@dataclass
class PPStageMemory:
    """Per-GPU training memory (bytes) of one pipeline stage; host figures are per GPU too."""

    pp_rank: int
    layers: int
    params_per_gpu: float
    weights: float
    grads: float
    optimizer_gpu: float
    optimizer_host: float
    optimizer_shard_params: float
    activations: float

    @property
    def state_gpu(self) -> float:
        return self.weights + self.grads + self.optimizer_gpu

    @property
    def train_gpu(self) -> float:
        return self.state_gpu + self.activations


def per_gpu_params(sp: PPStageParams, pc: ParamCounts, lay: PlanLayout) -> tuple[float, float]:
    """(dense, expert) parameters one GPU of this stage holds."""
    dense = sp.tp_split / lay.tp + sp.replicated
    experts_per_rank = math.ceil(pc.num_experts / lay.ep)  # uneven EP rounds up (the check reports it)
    moe_layers = sp.layers - sp.dense_layers
    return dense, moe_layers * experts_per_rank * pc.expert / lay.etp


def layer_activation_bytes_per_token(r: Recipe, tp: int, moe: bool) -> float:
    """Bytes one layer keeps per token (this GPU's share) for its backward, bf16, flash attention.

    With sequence parallel, hidden-sized tensors are split over TP; the MLA down-projections and the
    shared-expert / dense-MLP inputs see the TP-gathered hidden state.
    """
    model = r.model
    sp = tp if r.parallel.sequence_parallel else 1
    h, heads = model.hidden_size, model.num_attention_heads
    qh = model.qk_head_dim + model.qk_pos_emb_head_dim
    attn = h  # gathered norm output feeding the duplicated down-projections
    attn += (
        2 * (model.q_lora_rank or 0) + 2 * model.kv_lora_rank + model.qk_pos_emb_head_dim
    )  # q_a/kv_a outputs + norms
    attn += heads * (qh + (model.qk_head_dim + model.v_head_dim) + 2 * qh + model.v_head_dim + model.v_head_dim) / tp
    attn += 2 * h / sp  # o_proj output + residual
    b = 2 * attn + 4 * heads / tp  # + fp32 softmax statistics
    if moe:
        f, k = model.moe_ffn_hidden_size, model.moe_router_topk
        fs = model.num_shared_experts * f
        mlp = h / sp + k * (3 * h + 3 * f) / sp  # norm out; per routed copy: permuted in, fc1, act, fc2, unpermuted
        if fs:  # shared experts: TP-gathered input, fc1/act split by TP, output back to the SP shard
            mlp += (h if sp > 1 else 0) + 3 * fs / tp + h / sp
        b += 2 * mlp + 2 * 4 * model.num_experts / sp  # router logits + probabilities, fp32
    else:
        mlp = h / sp + (h if sp > 1 else 0) + 3 * model.ffn_hidden_size / tp + h / sp
        b += 2 * mlp
    return b


def pp_stage_activations(
    r: Recipe, lay: PlanLayout, pp_rank: int, layers: int, dense_layers: int, microbatches: int, a: MemoryAssumptions
) -> float:
    """Activation bytes per GPU of a stage under Megatron's 1F1B schedule and the recompute settings.

    Tokens per GPU per micro-batch = max_tokens_per_gpu (dynamic batching packs up to max_tokens_per_gpu x CP
    tokens per micro-batch and CP splits them). Stage s keeps min(pp - s, micro-batches) micro-batches in flight.
    Full uniform recompute of N layers stores only each N-layer chunk's input and rebuilds N layers at a time.
    """
    parallel, model = r.parallel, r.model
    t = parallel.max_tokens_per_gpu
    sp = lay.tp if parallel.sequence_parallel else 1
    layer_in = t * model.hidden_size * 2 / sp
    full_moe = t * layer_activation_bytes_per_token(r, lay.tp, moe=True)
    full_dense = t * layer_activation_bytes_per_token(r, lay.tp, moe=False)
    moe_layers = layers - dense_layers
    largest = full_moe if moe_layers else full_dense
    all_full = moe_layers * full_moe + dense_layers * full_dense
    n = parallel.recompute_num_layers or 1
    if parallel.recompute_granularity == "full" and parallel.recompute_method == "uniform":
        stored, working = math.ceil(layers / n) * layer_in, min(n, layers) * largest
    elif parallel.recompute_granularity == "full" and parallel.recompute_method == "block":
        k = min(n, layers)
        stored, working = k * layer_in + all_full * (layers - k) / max(layers, 1), largest
    else:  # none, or selective (core attention only: flash attention already keeps no scores)
        stored, working = all_full, 0.0
    in_flight = max(1, min(lay.pp - pp_rank, microbatches))
    total = in_flight * stored + working + 2 * layer_in  # + the gradient flowing into the layer
    if pp_rank == lay.pp - 1:
        total += t * model.vocab_size / lay.tp * a.logits_bytes
    return total


def train_pp_stages(
    r: Recipe, pc: ParamCounts, lay: PlanLayout, microbatches: int, a: MemoryAssumptions
) -> list[PPStageMemory]:
    """Training memory of every pipeline stage (one GPU each)."""
    split, _ = pp_stage_layers_or_guess(r.model.num_layers, lay)
    optimizer = r.optimizer
    out, start = [], 0
    for s, n in enumerate(split):
        sp = pp_stage_params(pc, start, n, s == 0, s == len(split) - 1, lay.pp, r.model.tie_word_embeddings)
        dense, expert = per_gpu_params(sp, pc, lay)
        params = dense + expert
        shard = dense / lay.dense_dp + expert / lay.expert_dp if optimizer.use_distributed_optimizer else params
        opt_gpu = 0.0 if optimizer.optimizer_cpu_offload else shard * BYTES_OPTIM
        opt_host = shard * (BYTES_OPTIM + BYTES_CPU_GRAD) if optimizer.optimizer_cpu_offload else 0.0
        act = pp_stage_activations(r, lay, s, n, sp.dense_layers, microbatches, a)
        out.append(PPStageMemory(s, n, params, params * BYTES_PARAM, params * BYTES_GRAD, opt_gpu, opt_host, shard, act))
        start += n
    return out


# --------------------------------------------------------------------------------------------------
# SGLang engine


def rollout_formats(r: Recipe) -> tuple[str, str]:
    """(routed-expert, other-linear) weight formats the engine serves (`weight_sync.formats`): INT4 routed
    experts with the rest bf16 (the INT4 export's format), FP8 blocks for every Linear, or bf16."""

    fmt = engine_weight_format(r.rollout, r.quant.export_format, r.hub.source_format)
    return {"int4": ("int4", "bf16"), "fp8": ("fp8", "fp8")}.get(fmt, ("bf16", "bf16"))


def format_bytes(fmt: str, group_size: int) -> float:
    """Bytes per parameter including scales (INT4: bf16 scale per group; FP8: fp32 scale per 128x128 block)."""
    return {"bf16": 2.0, "fp8": 1.0 + 4.0 / (128 * 128), "int4": 0.5 + 2.0 / group_size}[fmt]


def default_cuda_graph_bs() -> list[int]:
    """Approximation of SGLang's default capture list on large GPUs (printed as an assumption)."""
    return [1, 2, 4, 8] + list(range(16, 257, 8))


@dataclass
class EngineMemory:
    """Per-GPU SGLang memory (bytes) and the KV capacity it leaves."""

    weights: float = 0.0  # the language model's and, for a multimodal model, the vision parts' (`vision_weights`)
    vision_weights: float = 0.0
    static_budget: float = 0.0
    kv_cache: float = 0.0
    cuda_graphs: float = 0.0
    kv_bytes_per_token: float = 0.0
    kv_tokens_per_gpu: int = 0  # = per attention-DP rank: its TP ranks all hold the same latent cache
    attn_tp: int = 1
    formats: tuple[str, str] = ("bf16", "bf16")
    graph_bs: list[int] = field(default_factory=list)


def engine_memory(r: Recipe, pc: ParamCounts, gpu: GPU, a: MemoryAssumptions) -> EngineMemory:
    """Weights at the engine's TP/EP/DP-attention split; KV = mem_fraction_static x GPU - weights.

    MLA caches kv_lora_rank + qk_pos_emb_head_dim values per token per layer, the same on every attention
    TP rank; with DP attention each DP rank caches its own requests.
    """
    if r.rollout.engine != "sglang":
        return EngineMemory()
    sglang, model = r.sglang, r.model
    g = sglang.gpus_per_engine
    attn_tp = max(1, g // sglang.dp_size) if sglang.enable_dp_attention else g
    ex_fmt, lin_fmt = rollout_formats(r)
    eb, lb = format_bytes(ex_fmt, r.quant.group_size), format_bytes(lin_fmt, r.quant.group_size)
    dense_tp = sglang.moe_dense_tp_size or g
    nl, nm = pc.num_layers, pc.num_moe_layers
    w = pc.routed_experts * eb / g  # EP x MoE-TP span the whole engine
    w += nl * (pc.attn_split * lb / attn_tp + pc.attn_replicated * lb + pc.layer_norms * 2)
    w += (pc.first_k_dense * pc.dense_mlp + nm * pc.shared) * lb / dense_tp + nm * pc.router * 2
    w += pc.embedding * 2 / (1 if sglang.enable_dp_attention else g)  # DP attention keeps the embedding whole
    w += pc.lm_head * 2 / (attn_tp if sglang.enable_dp_lm_head else g) + pc.final_norm * 2
    # K2.5's vision tower and projector ride along, bf16, whole on every GPU (SGLang does not shard the ViT by
    # the language model's TP/EP): text rollouts never run them, but the engine loads the checkpoint's model
    vision = model.vision.num_params(model.hidden_size) * 2.0 if model.vision is not None else 0.0
    w += vision
    static = sglang.mem_fraction_static * gpu.mem_gb * GIB
    kv = max(0.0, static - w)
    per_tok = (model.kv_lora_rank + model.qk_pos_emb_head_dim) * 2 * model.num_layers
    bs = sglang.cuda_graph_bs or default_cuda_graph_bs()
    graphs = (a.graph_base_gb + a.graph_per_graph_gb * len(bs) + a.graph_per_bs_gb * max(bs)) * GIB
    tokens = int(kv // per_tok)
    return EngineMemory(w, vision, static, kv, graphs, per_tok, tokens, attn_tp, (ex_fmt, lin_fmt), list(bs))


# --------------------------------------------------------------------------------------------------
# host RAM


def checkpoint_gather_bytes(st: PPStageMemory) -> float:
    """Host bytes one GPU's optimizer state takes when a checkpoint gathers it unsharded (fp32 main params + Adam
    moments of every parameter the GPU holds), on the data-parallel rank 0 that writes it."""
    return st.params_per_gpu * BYTES_OPTIM


def host_memory(r: Recipe, st: PPStageMemory, lay: PlanLayout, a: MemoryAssumptions) -> dict[str, float]:
    """Host RAM (bytes) of one node whose GPUs all sit in pipeline stage `st` (TP is innermost, so they do).

    Colocated, the actor sleeps while SGLang runs: torch_memory_saver backs its live GPU tensors (weights,
    grads, GPU optimizer states) up to pinned host memory, and a separate bf16 host copy of the weights feeds
    the weight sync (slime/miles' weights backuper), plus one for the reference model when KL is on.
    """
    n = lay.gpus_per_node
    kl = r.grpo.use_kl_loss or r.grpo.kl_loss_coef > 0
    offload = r.optimizer.optimizer_cpu_offload
    out = {
        "cpu_optimizer": n * st.optimizer_shard_params * BYTES_OPTIM if offload else 0.0,
        "pinned_grad_buffers": n * st.optimizer_shard_params * BYTES_CPU_GRAD if offload else 0.0,
        "actor_sleep_backup": n * st.state_gpu if r.cluster.colocate else 0.0,
        "actor_weights_copy": n * st.weights,
        "ref_model": n * st.weights if kl else 0.0,
        "checkpoint_staging": n * (st.weights + st.optimizer_gpu) if a.checkpoint_staging else 0.0,
        # saving the optimizer (megatron_train.SHARDED_METADATA): DP rank 0 of each model-parallel shard gathers
        # that shard's whole fp32 state in host memory; a node holding DP rank 0 holds it for all its GPUs
        "checkpoint_gather": n * checkpoint_gather_bytes(st) if r.optimizer.use_distributed_optimizer else 0.0,
        "processes": (a.host_base_gb + n * a.host_per_gpu_gb) * GIB,
    }
    out["total"] = sum(out.values())
    return out
