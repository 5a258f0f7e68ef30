"""Time of one RL step (one rollout: generate, train its optimizer steps, sync weights) from FLOPs and rates.

Why: an order-of-magnitude step time tells you a run's cost before you book 256 GPUs. Every rate is an
assumption (MFU, decode throughput, per-sequence decode speed, CPU Adam and weight-sync bandwidth) that is
printed and can be overridden; the structure is what the model contributes:

  train     6 x active matmul params x tokens, + MLA attention (4 x heads x (qk + v dims) x ctx per token per
            layer, ctx = mean sequence / 2 for causal masks), x (3 fwd+bwd + 1 recompute + log-prob forwards)
  rollout   max(generated tokens / engine throughput, longest response / per-sequence decode speed)
  optimizer CPU Adam over the node's optimizer shard, once per optimizer step (when offloaded)
  sync      the sync's own bucket plan (`weight_sync.buckets.BucketSchedule`, what the trainers run): per bucket,
            the bytes each rank receives through each group (pipeline broadcast, TP / EP / expert-TP all-gather)
            at that group's link (NVLink when the group fits in a node, the inter-node fabric otherwise), the
            engine's load of the bucket in its format (a device copy) and a fixed cost per bucket (CUDA-IPC
            handles, the handles' gather, the load call, the barrier). Non-colocated: each stage gathers its
            own buckets and its source sends them, one stage at a time, to every engine over the fabric. The
            disk fallback writes and re-reads the bf16 model through shared storage. The recipes' framework
            measured 7.2 s (RDMA P2P) and 53.3 s (NCCL broadcast) for a 1 T Kimi on H100 (radixark/miles
            docs/advanced/p2p-weight-transfer.md); both are printed beside the model.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import torch

from kimi_pipeline.hf.names import NameMappingError
from kimi_pipeline.model.params import ParamCounts
from kimi_pipeline.plan.hardware import GPU
from kimi_pipeline.plan.memory import PlanLayout, format_bytes, rollout_formats
from kimi_pipeline.recipes.layout import Layout, LayoutError
from kimi_pipeline.recipes.models import ModelSpec
from kimi_pipeline.recipes.recipe import Recipe
from kimi_pipeline.weight_sync.buckets import BucketSchedule, received_by_group


@dataclass(frozen=True)
class TimeAssumptions:
    mfu: float = 0.25  # model FLOPs utilisation of the training passes (pipeline bubble included)
    decode_tok_s: float | None = None  # aggregate decode tokens/s per engine; None = GPU default x GPUs/engine
    seq_tok_s: float = 40.0  # decode speed of one sequence at RL concurrency: sets the long-tail latency
    mean_response_frac: float = 0.5  # mean response = this x max_response_len
    mean_prompt_frac: float = 0.25  # mean prompt = this x max_prompt_len
    cpu_adam_params_per_s_per_node: float = 2e9
    nvlink_gb_s: float = 360.0  # effective NVLink rate into one GPU in a collective (GiB/s; H100/H200 NVLink 4)
    fabric_gb_s: float = 40.0  # effective inter-node rate into one GPU (GiB/s; one 400 Gb/s NIC per GPU)
    weight_sync_bucket_overhead_s: float = 0.01  # IPC handles, their gather, the engine's load call, per bucket
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
    """Dynamic sampling generates over_sampling_batch_size prompts (assumed enough groups survive in one pass). The
    optimizer steps and their batch are the trainer's: with a dynamic global batch, every trained sample in one step
    (`RolloutSpec.optimizer_steps_per_rollout`, `rl.batching.step_batch_size`), whatever num_steps_per_rollout says."""
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
        optimizer_steps=rollout.optimizer_steps_per_rollout,
        global_batch=rollout.samples_per_rollout if rollout.use_dynamic_global_batch_size else r.global_batch_size,
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
        # the first optimizer step's tokens reuse their own training forward (rl/policy.py PolicyWorker.train)
        "old_logprob_forward": 1.0 - 1.0 / r.rollout.optimizer_steps_per_rollout,
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
    n_engines = max(1, lay.world // g)
    per_engine = a.decode_tok_s if a.decode_tok_s is not None else gpu.decode_tok_s_per_gpu * g
    throughput_s = wl.rollout_tokens / (n_engines * per_engine)
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
        "engines": n_engines,
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


# What the recipes' framework measured for a 1 T Kimi's weight update on H100 (radixark/miles
# docs/advanced/p2p-weight-transfer.md): printed beside the model, never used in it.
ANCHOR_SYNC_S = {"rdma_p2p": 7.2, "nccl_broadcast": 53.3}


def _links(lay: PlanLayout, a: TimeAssumptions) -> dict[str, float]:
    """Bytes/s into one GPU for each group of the sync: NVLink when the group's ranks fit in one node. megatron
    orders ranks tp-cp-ep-dp-pp (`parallel_state.RankGenerator`): TP groups are `tp` consecutive ranks, EP groups
    span etp x ep, expert-TP groups `etp`, pipeline groups one rank per stage, world / pp apart."""
    gib, node = 2**30, lay.gpus_per_node

    def link(span: int) -> float:
        return (a.nvlink_gb_s if span <= node else a.fabric_gb_s) * gib

    return {"tp": link(lay.tp), "ep": link(lay.ep * lay.etp), "etp": link(lay.etp),
            "pp": link(lay.world if lay.pp > 1 else 1)}


@functools.lru_cache(maxsize=32)
def _bucket_schedule(spec_json: str, layout: Layout, buffer_bytes: int) -> BucketSchedule:
    """The GPU run's plan (bf16, Transformer Engine names); cached: `kimi plan --nodes` and the tests ask for the
    same layout many times, and a 256-rank plan of a 1 T model takes about half a second."""
    return BucketSchedule.build(ModelSpec.model_validate_json(spec_json), layout, buffer_bytes=buffer_bytes,
                            dtype=torch.bfloat16, use_te=True)


def sync_time(r: Recipe, pc: ParamCounts, lay: PlanLayout, a: TimeAssumptions) -> dict:
    """Seconds to move the trained weights into the engines, by path (see the module docstring), with the bytes
    each GPU receives and the collectives each rank issues per sync."""

    ex_fmt, lin_fmt = rollout_formats(r)
    routed = pc.routed_experts
    # Linears other than the routed experts take the engine's linear format; norms, router, embedding stay 16-bit
    linears = pc.first_k_dense * (pc.attention + pc.dense_mlp) + pc.num_moe_layers * (pc.attention + pc.shared) + pc.lm_head
    engine_bytes = routed * format_bytes(ex_fmt, r.quant.group_size) + linears * format_bytes(lin_fmt, r.quant.group_size)
    engine_bytes += (pc.total - routed - linears) * 2.0
    gib = 2**30
    disk = pc.total * 2.0 / (a.shared_storage_gb_s * gib) * 2  # write once, every engine node reads it
    out: dict = {"engine_format": f"experts {ex_fmt}, linears {lin_fmt}", "engine_bytes": engine_bytes,
                 "disk_fallback_s": disk, "anchor_s": dict(ANCHOR_SYNC_S), "links_gb_s": {}}
    try:
        layout = Layout(world_size=lay.world, tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=lay.etp, cp=lay.cp,
                        first_pp_stage_layers=lay.first, last_pp_stage_layers=lay.last)
        plan = _bucket_schedule(r.model.model_dump_json(), layout, r.rollout.update_weight_buffer_size)
    except (LayoutError, NameMappingError) as e:
        return {**out, "buckets": 0, "colocated_s": float("nan"), "distributed_s": float("nan"),
                "unmodelled": f"no bucket plan for this layout: {e}"}
    links = _links(lay, a)
    out["links_gb_s"] = {g: v / gib for g, v in links.items()}
    to_engine = engine_bytes / max(plan.hf_bytes, 1)  # engine-format bytes per trainer (bf16) byte
    handoff = plan.hf_bytes * to_engine / (a.hbm_copy_gb_s * gib)
    overhead = len(plan.buckets) * a.weight_sync_bucket_overhead_s
    # colocated: every rank assembles every bucket; the slowest stage sets the time
    per_pp_stage = []
    for stage in range(lay.pp):
        by_group = dict.fromkeys(links, 0.0)
        for b in plan.buckets:
            for g, n in received_by_group(b, layout, stage).items():
                by_group[g] += n
        per_pp_stage.append(by_group)
    worst = max(range(lay.pp), key=lambda s: sum(v / links[g] for g, v in per_pp_stage[s].items()))
    network = sum(v / links[g] for g, v in per_pp_stage[worst].items())
    colocated = network + handoff + overhead
    # non-colocated: each stage's own gathers (no pipeline broadcast), then its source's sends, one stage at a time
    gather = max(sum(n / links[g] for b in plan.pp_stage_buckets(s) for g, n in received_by_group(b, layout, s).items()
                     if g != "pp") for s in range(lay.pp))
    send = engine_bytes / (a.fabric_gb_s * gib)
    distributed = gather + send + overhead
    collectives = plan.collectives()
    return {
        **out,
        "buckets": len(plan.buckets),
        "received_bytes_per_gpu": float(sum(per_pp_stage[worst].values())),
        "received_bytes_by_group": per_pp_stage[worst],
        # the handoff adds two per bucket (CUDA IPC: the handles' gather and the engine group's barrier), plus the
        # two barriers around the buckets
        "collectives_per_sync": sum(collectives.values()) + 2 * len(plan.buckets) + 2,
        "collectives_by_group": collectives,
        "network_s": network,
        "copy_s": handoff,
        "bucket_overhead_s": overhead,
        "colocated_s": colocated,
        "distributed_gather_s": gather,
        "distributed_send_s": send,
        "distributed_s": distributed,
    }
