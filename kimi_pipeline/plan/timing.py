"""Time of one RL step (one rollout: generate, train its optimizer steps, sync weights) from FLOPs and rates.

Why: an order-of-magnitude step time tells you a run's cost before you book 256 GPUs. Every rate is an
assumption (MFU, decode throughput, per-sequence decode speed, CPU Adam and weight-sync bandwidth) that is
printed and can be overridden; the structure is what the model contributes:

  train     6 x active matmul params x tokens, + MLA attention (4 x heads x (qk + v dims) x ctx per token per
            layer, ctx = mean sequence / 2 for causal masks), x (3 fwd+bwd + 1 recompute + log-prob forwards)
  rollout   max(generated tokens / engine throughput, longest response / per-sequence decode speed)
  optimizer CPU Adam over the node's optimizer shard, once per optimizer step (when offloaded)
  sync      colocated (the seeds' mode): every bucket of engine-format weights (INT4 / FP8 / bf16, as the
            engine serves them) is broadcast from the ranks that own it to every node, then handed to the
            engine on each GPU through a CUDA-IPC handle (one device copy); plus a fixed cost per bucket
            (engine pause/flush, handle serialization, the load call). The disk fallback writes and
            re-reads the bf16 model through shared storage; both are printed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kimi_pipeline.model.params import ParamCounts
from kimi_pipeline.plan.hardware import GPU
from kimi_pipeline.plan.memory import PlanLayout, format_bytes, rollout_formats
from kimi_pipeline.recipes.recipe import Recipe


@dataclass(frozen=True)
class TimeAssumptions:
    mfu: float = 0.25  # model FLOPs utilisation of the training passes (pipeline bubble included)
    decode_tok_s: float | None = None  # aggregate decode tokens/s per engine; None = GPU default x GPUs/engine
    seq_tok_s: float = 40.0  # decode speed of one sequence at RL concurrency: sets the long-tail latency
    mean_response_frac: float = 0.5  # mean response = this x max_response_len
    mean_prompt_frac: float = 0.25  # mean prompt = this x max_prompt_len
    cpu_adam_params_per_s_per_node: float = 2e9
    weight_sync_gb_s_per_node: float = 50.0  # inter-node broadcast rate into one node (GiB/s)
    weight_sync_bucket_overhead_s: float = 0.05  # pause/flush + IPC handles + engine load call, per bucket
    hbm_copy_gb_s: float = 1000.0  # device-to-device copy into the engine's weights (GiB/s)
    shared_storage_gb_s: float = 10.0  # aggregate write / read rate of the shared filesystem (GiB/s)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Workload:
    """Tokens one RL step moves."""

    mean_prompt: float
    mean_response: float
    samples_trained: int  # per rollout
    prompts_generated: int  # per rollout (over-sampling included)
    n_samples: int
    optimizer_steps: int
    global_batch: int

    @property
    def mean_seq(self) -> float:
        return self.mean_prompt + self.mean_response

    @property
    def train_tokens(self) -> float:
        return self.samples_trained * self.mean_seq

    @property
    def rollout_tokens(self) -> float:
        return self.prompts_generated * self.n_samples * self.mean_response

    def microbatches(self, r: Recipe, lay: PlanLayout) -> int:
        """Micro-batches per optimizer step per DP rank under dynamic batching (max_tokens_per_gpu x CP each)."""
        per_rank = self.global_batch * self.mean_seq / max(1, lay.dp)
        return max(1, math.ceil(per_rank / (r.parallel.max_tokens_per_gpu * lay.cp)))


def workload(r: Recipe, a: TimeAssumptions) -> Workload:
    """Dynamic sampling generates over_sampling_batch_size prompts (assumed enough groups survive in one pass)."""
    rollout = r.rollout
    gen = (
        rollout.over_sampling_batch_size
        if (rollout.dynamic_sampling and rollout.over_sampling_batch_size)
        else rollout.rollout_batch_size
    )
    return Workload(
        mean_prompt=rollout.max_prompt_len * a.mean_prompt_frac,
        mean_response=rollout.max_response_len * a.mean_response_frac,
        samples_trained=rollout.samples_per_rollout,
        prompts_generated=max(gen, rollout.rollout_batch_size),
        n_samples=rollout.n_samples_per_prompt,
        optimizer_steps=rollout.num_steps_per_rollout,
        global_batch=r.global_batch_size,
    )


def forward_flops_per_token(r: Recipe, pc: ParamCounts, mean_seq: float) -> float:
    model = r.model
    ctx = mean_seq / 2  # causal: a token attends to half the sequence on average
    attn = (
        2
        * model.num_attention_heads
        * (model.qk_head_dim + model.qk_pos_emb_head_dim + model.v_head_dim)
        * ctx
        * model.num_layers
    )
    return 2 * pc.active_matmul + attn


def train_passes(r: Recipe, layers_per_pp_stage: float) -> dict[str, float]:
    """Forward-pass equivalents per trained token."""
    parallel, grpo = r.parallel, r.grpo
    if parallel.recompute_granularity == "full" and parallel.recompute_method == "uniform":
        recompute = 1.0
    elif parallel.recompute_granularity == "full" and parallel.recompute_method == "block":
        recompute = min(1.0, (parallel.recompute_num_layers or 0) / max(layers_per_pp_stage, 1))
    else:
        recompute = 0.0
    return {
        "forward_backward": 3.0,
        "recompute": recompute,
        "old_logprob_forward": 1.0,
        "ref_logprob_forward": 1.0 if (grpo.use_kl_loss or grpo.kl_loss_coef > 0) else 0.0,
    }


def step_time(
    r: Recipe,
    pc: ParamCounts,
    lay: PlanLayout,
    gpu: GPU,
    a: TimeAssumptions,
    node_shard_params: float,
    engine_weight_bytes_per_gpu: float,
) -> dict:
    """Seconds per RL step and the pieces behind it."""
    wl = workload(r, a)
    passes = train_passes(r, r.model.num_layers / max(lay.pp, 1))
    fwd = forward_flops_per_token(r, pc, wl.mean_seq)
    train_flops = wl.train_tokens * fwd * sum(passes.values())
    train_s = train_flops / (lay.world * gpu.bf16_tflops * 1e12 * a.mfu)

    g = r.sglang.gpus_per_engine if r.rollout.engine == "sglang" else 1
    engines = max(1, lay.world // g)
    per_engine = a.decode_tok_s if a.decode_tok_s is not None else gpu.decode_tok_s_per_gpu * g
    throughput_s = wl.rollout_tokens / (engines * per_engine)
    tail_s = r.rollout.max_response_len / a.seq_tok_s
    rollout_s = max(throughput_s, tail_s)

    opt_s = 0.0
    if r.optimizer.optimizer_cpu_offload:
        opt_s = wl.optimizer_steps * node_shard_params / a.cpu_adam_params_per_s_per_node
    sync = sync_time(r, pc, lay, a)
    sync_s = sync["colocated_s"] if r.cluster.colocate else sync["distributed_s"]
    return {
        "mean_prompt_tokens": wl.mean_prompt,
        "mean_response_tokens": wl.mean_response,
        "train_tokens_per_step": wl.train_tokens,
        "rollout_tokens_per_step": wl.rollout_tokens,
        "prompts_generated_per_step": wl.prompts_generated,
        "optimizer_steps_per_step": wl.optimizer_steps,
        "forward_gflop_per_token": fwd / 1e9,
        "passes": passes,
        "train_pflop_per_step": train_flops / 1e15,
        "engines": engines,
        "decode_tok_s_per_engine": per_engine,
        "rollout_throughput_s": throughput_s,
        "rollout_tail_s": tail_s,
        "rollout_s": rollout_s,
        "train_s": train_s,
        "optimizer_s": opt_s,
        "weight_sync_s": sync_s,
        "weight_sync": sync,
        "step_s": rollout_s + train_s + opt_s + sync_s,
    }


def sync_time(r: Recipe, pc: ParamCounts, lay: PlanLayout, a: TimeAssumptions) -> dict:
    """Seconds to move the trained weights into the engines, by protocol (see the module docstring)."""

    ex_fmt, lin_fmt = rollout_formats(r)
    routed = pc.routed_experts
    # Linears other than the routed experts take the engine's linear format; norms, router, embedding stay 16-bit
    linears = pc.first_k_dense * (pc.attention + pc.dense_mlp) + pc.num_moe_layers * (pc.attention + pc.shared) + pc.lm_head
    engine_bytes = routed * format_bytes(ex_fmt, r.quant.group_size) + linears * format_bytes(lin_fmt, r.quant.group_size)
    engine_bytes += (pc.total - routed - linears) * 2.0
    buckets = math.ceil(engine_bytes / r.rollout.update_weight_buffer_size)
    gib = 2**30
    network_s = engine_bytes * (lay.nodes - 1) / max(lay.nodes, 1) / (a.weight_sync_gb_s_per_node * gib)
    copy_s = engine_bytes / (a.hbm_copy_gb_s * gib)
    overhead_s = buckets * a.weight_sync_bucket_overhead_s
    colocated = network_s + copy_s + overhead_s
    # non-colocated: one broadcast from the trainer to every engine node over the same links
    distributed = engine_bytes / (a.weight_sync_gb_s_per_node * gib) + overhead_s
    disk = pc.total * 2.0 / (a.shared_storage_gb_s * gib) * 2  # write once, every engine node reads it
    return {
        "engine_format": f"experts {ex_fmt}, linears {lin_fmt}",
        "engine_bytes": engine_bytes,
        "buckets": buckets,
        "network_s": network_s,
        "copy_s": copy_s,
        "bucket_overhead_s": overhead_s,
        "colocated_s": colocated,
        "distributed_s": distributed,
        "disk_fallback_s": disk,
    }
