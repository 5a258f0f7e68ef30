"""Layout and consistency checks that run before any GPU is touched.

Each problem names the recipe field and says how to fix it, because the alternative is a
256-GPU job dying minutes into start-up with an assertion deep inside Megatron.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from kimi_pipeline.recipes.recipe import Recipe
from kimi_pipeline.reward import RewardError, grader_for


@dataclass(frozen=True)
class Problem:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class PipelineSplitError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def pipeline_layers(
    num_layers: int, pp: int, first: int | None = None, last: int | None = None, prefix: str = "parallel"
) -> list[int]:
    """Layers per pipeline stage, Megatron's rule: first/last stages as given, the rest split evenly.

    61 layers, pp 8, last 5 -> [8, 8, 8, 8, 8, 8, 8, 5].
    """
    if pp == 1:
        if first not in (None, num_layers) or last not in (None, num_layers):
            raise PipelineSplitError(
                f"{prefix}.decoder_last_pipeline_num_layers",
                f"pipeline size is 1, so first/last stage layer counts must be unset (got first={first}, last={last})",
            )
        return [num_layers]
    fixed = [x for x in (first, last) if x is not None]
    for name, x in (("first", first), ("last", last)):
        if x is not None and x <= 0:
            raise PipelineSplitError(f"{prefix}.decoder_{name}_pipeline_num_layers", f"must be > 0 (got {x})")
    middle_pp_stages = pp - len(fixed)
    rest = num_layers - sum(fixed)
    if middle_pp_stages == 0:
        if rest != 0:
            raise PipelineSplitError(
                f"{prefix}.decoder_last_pipeline_num_layers",
                f"first ({first}) + last ({last}) = {sum(fixed)} layers but the model has {num_layers}",
            )
        return [first, last]  # type: ignore[list-item]
    if rest <= 0 or rest % middle_pp_stages:
        which = "last" if last is not None else "first" if first is not None else "last"
        hint = _split_hint(num_layers, pp)
        raise PipelineSplitError(
            f"{prefix}.decoder_{which}_pipeline_num_layers",
            f"{num_layers} layers over pp={pp} stages does not split: with first={first}, last={last} the "
            f"remaining {rest} layers do not divide evenly over {middle_pp_stages} stage(s). {hint}",
        )
    per = rest // middle_pp_stages
    split = [per] * middle_pp_stages
    if first is not None:
        split.insert(0, first)
    if last is not None:
        split.append(last)
    return split


def _split_hint(num_layers: int, pp: int) -> str:
    if num_layers % pp == 0:
        return f"Unset it for an even split of {num_layers // pp} per stage."
    options = [
        f"decoder_last_pipeline_num_layers={last}"
        for last in range(1, num_layers)
        if (num_layers - last) % (pp - 1) == 0 and (num_layers - last) // (pp - 1) > 0
    ]
    return "Valid choices: " + ", ".join(options[:4]) if options else "Choose another pipeline size."


_COMMIT = re.compile(r"[0-9a-f]{40}")


Add = Callable[[str, str], None]  # (field, message)


def check_recipe(r: Recipe) -> list[Problem]:
    """All problems with a recipe (empty list = valid), section by section."""
    out: list[Problem] = []

    def add(field: str, message: str) -> None:
        out.append(Problem(field, message))

    for check in (_check_model, _check_hub, _check_training_layout, _check_conversion, _check_rollout,
                  _check_engines, _check_quant):
        check(r, add)
    return out


def _check_model(r: Recipe, add: Add) -> None:
    """Model shape."""
    model = r.model
    if model.first_k_dense >= model.num_layers:
        add("model.first_k_dense", f"{model.first_k_dense} dense layers leaves no MoE layer of {model.num_layers}")
    if model.moe_router_topk > model.num_experts:
        add("model.moe_router_topk", f"top-{model.moe_router_topk} of only {model.num_experts} experts; lower it")
    if model.num_experts % model.moe_router_num_groups:
        add("model.moe_router_num_groups", f"must divide num_experts={model.num_experts}")
    if model.moe_router_group_topk > model.moe_router_num_groups:
        add("model.moe_router_group_topk", f"cannot exceed moe_router_num_groups={model.moe_router_num_groups}")
    if model.max_position_embeddings < model.original_max_position_embeddings:
        add("model.max_position_embeddings", "is below original_max_position_embeddings; check the YaRN settings")


def _check_hub(r: Recipe, add: Add) -> None:
    """Remote code runs only at a pinned commit (a moving branch could change the code under a nightly run)."""
    if r.hub.trust_remote_code and r.hub.model.kind == "hub" and not _COMMIT.fullmatch(r.hub.model.revision):
        add("hub.model.revision", f"hub.trust_remote_code runs code from {r.hub.model.repo_id}: pin revision to a "
                                  f"40-hex commit SHA, not {r.hub.model.revision!r}")


def _check_training_layout(r: Recipe, add: Add) -> None:
    """The trainer's TP/PP/CP/EP/DP layout on the cluster."""
    model, parallel, cluster = r.model, r.parallel, r.cluster
    world = cluster.world_size
    mp = parallel.tp * parallel.pp * parallel.cp
    if parallel.dp is not None:
        if mp * parallel.dp != world:
            add(
                "parallel.dp",
                f"TP·PP·CP·DP = {parallel.tp}·{parallel.pp}·{parallel.cp}·{parallel.dp} = {mp * parallel.dp} but the cluster has "
                f"{cluster.nodes} nodes × {cluster.gpus_per_node} GPUs = {world}; set parallel.dp={world // mp if world % mp == 0 else '?'} "
                "or change cluster.nodes / cluster.gpus_per_node",
            )
    elif world % mp:
        add(
            "cluster.gpus_per_node",
            f"the cluster has {cluster.nodes} × {cluster.gpus_per_node} = {world} GPUs, not a multiple of TP·PP·CP = "
            f"{parallel.tp}·{parallel.pp}·{parallel.cp} = {mp}; use a GPU count that is a multiple of {mp} or shrink parallel.tp/pp/cp",
        )
    if model.num_experts % parallel.ep:
        divisors = [d for d in range(1, min(model.num_experts, 512) + 1) if model.num_experts % d == 0]
        near = sorted(divisors, key=lambda d: abs(d - parallel.ep))[:3]
        add(
            "parallel.ep",
            f"expert parallel size {parallel.ep} does not divide the {model.num_experts} routed experts; "
            f"choose a divisor such as {', '.join(map(str, sorted(near)))}",
        )
    if world % mp == 0 or parallel.dp is not None:
        dp = r.data_parallel_size
        expert_group = parallel.ep * parallel.etp
        dense_group = parallel.tp * parallel.cp * dp
        if expert_group > dense_group or dense_group % expert_group:
            add(
                "parallel.ep",
                f"EP·expert-TP = {parallel.ep}·{parallel.etp} = {expert_group} must divide TP·CP·DP = {parallel.tp}·{parallel.cp}·{dp} = "
                f"{dense_group} (the GPUs of one pipeline stage); lower parallel.ep or parallel.etp",
            )
    if model.num_attention_heads % parallel.tp:
        add("parallel.tp", f"{model.num_attention_heads} attention heads are not divisible by TP={parallel.tp}")
    if parallel.sequence_parallel and parallel.tp == 1:
        add("parallel.sequence_parallel", "needs TP > 1; set it to false")
    try:
        pipeline_layers(
            model.num_layers,
            parallel.pp,
            parallel.decoder_first_pipeline_num_layers,
            parallel.decoder_last_pipeline_num_layers,
        )
    except PipelineSplitError as e:
        add(e.field, str(e))
    if parallel.recompute_granularity == "full" and (
        parallel.recompute_method is None or parallel.recompute_num_layers is None
    ):
        add("parallel.recompute_method", "full recompute needs recompute_method and recompute_num_layers")


def _check_conversion(r: Recipe, add: Add) -> None:
    """The HF → torch_dist conversion's layout."""
    model = r.model
    convert = r.convert
    if convert.mode == "torch_dist":
        cworld = convert.nodes * convert.gpus_per_node
        cmp = convert.tp * convert.pp
        if cworld % cmp:
            add(
                "convert.pp",
                f"conversion world {convert.nodes}×{convert.gpus_per_node}={cworld} is not a multiple of TP·PP={cmp}",
            )
        elif (cworld // cmp * convert.tp) % (convert.ep * convert.etp):
            add(
                "convert.ep",
                f"conversion EP·expert-TP={convert.ep * convert.etp} must divide TP·DP={cworld // cmp * convert.tp}",
            )
        if model.num_experts % convert.ep:
            add("convert.ep", f"{convert.ep} does not divide the {model.num_experts} routed experts")
        try:
            pipeline_layers(
                model.num_layers,
                convert.pp,
                convert.decoder_first_pipeline_num_layers,
                convert.decoder_last_pipeline_num_layers,
                "convert",
            )
        except PipelineSplitError as e:
            add(e.field, str(e))


def _check_rollout(r: Recipe, add: Add) -> None:
    """Rollout, batches, eval cadence, reward and loss settings."""
    model, parallel, cluster = r.model, r.parallel, r.cluster
    world, mp = cluster.world_size, parallel.tp * parallel.pp * parallel.cp
    rollout = r.rollout
    if rollout.global_batch_size is not None:
        if rollout.samples_per_rollout % rollout.global_batch_size and not rollout.use_dynamic_global_batch_size:
            add(
                "rollout.global_batch_size",
                f"rollout_batch_size × n_samples_per_prompt = {rollout.rollout_batch_size}×{rollout.n_samples_per_prompt} = "
                f"{rollout.samples_per_rollout} samples is not a multiple of global_batch_size={rollout.global_batch_size}; "
                f"use a divisor (e.g. {rollout.samples_per_rollout // rollout.num_steps_per_rollout})",
            )
        elif (
            rollout.samples_per_rollout // rollout.global_batch_size != rollout.num_steps_per_rollout
            and not rollout.use_dynamic_global_batch_size
        ):
            add(
                "rollout.num_steps_per_rollout",
                f"{rollout.samples_per_rollout} samples / global_batch_size {rollout.global_batch_size} = "
                f"{rollout.samples_per_rollout // rollout.global_batch_size} steps, but num_steps_per_rollout="
                f"{rollout.num_steps_per_rollout}; make them agree or unset rollout.global_batch_size",
            )
    elif rollout.samples_per_rollout % rollout.num_steps_per_rollout:
        add(
            "rollout.num_steps_per_rollout",
            f"{rollout.samples_per_rollout} samples per rollout do not split into {rollout.num_steps_per_rollout} equal steps",
        )
    gbs = r.global_batch_size
    if (world % mp == 0 or parallel.dp is not None) and gbs % r.data_parallel_size:
        add("rollout.global_batch_size", f"global batch {gbs} is not divisible by data-parallel size {r.data_parallel_size}")
    if rollout.over_sampling_batch_size is not None and rollout.over_sampling_batch_size < rollout.rollout_batch_size:
        add("rollout.over_sampling_batch_size", f"must be ≥ rollout_batch_size={rollout.rollout_batch_size}")
    if rollout.max_prompt_len + rollout.max_response_len > model.max_position_embeddings:
        add(
            "rollout.max_response_len",
            f"max_prompt_len + max_response_len = {rollout.max_prompt_len}+{rollout.max_response_len} exceeds the "
            f"context length model.max_position_embeddings={model.max_position_embeddings}",
        )
    if r.eval.max_response_len + rollout.max_prompt_len > model.max_position_embeddings:
        add(
            "eval.max_response_len", f"prompt + eval response exceed the context length {model.max_position_embeddings}"
        )
    if r.eval.interval > rollout.num_rollout:
        add(
            "eval.interval",
            f"eval every {r.eval.interval} rollouts never fires within rollout.num_rollout={rollout.num_rollout}; "
            f"set eval.interval ≤ {rollout.num_rollout}",
        )
    try:
        grader_for(rollout.rm_type)  # a custom grader's module must import here, not hours into the run
    except RewardError as e:
        add("rollout.rm_type", str(e))
    if r.grpo.eps_clip_high < r.grpo.eps_clip:
        add("grpo.eps_clip_high", f"should be ≥ eps_clip={r.grpo.eps_clip} (asymmetric clip-higher)")
    if r.grpo.kl_loss_coef > 0 and not r.grpo.use_kl_loss:
        add("grpo.use_kl_loss", "kl_loss_coef > 0 has no effect unless use_kl_loss is true")
    if r.optimizer.optimizer_cpu_offload and not r.optimizer.use_distributed_optimizer:
        add("optimizer.use_distributed_optimizer", "Megatron's CPU-offloaded optimizer requires the distributed optimizer")


def _check_engines(r: Recipe, add: Add) -> None:
    """Rollout engines."""
    model, cluster, rollout = r.model, r.cluster, r.rollout
    world = cluster.world_size
    sglang = r.sglang
    if rollout.engine == "sglang":
        if cluster.device != "cuda":
            add("rollout.engine", "sglang needs CUDA GPUs; use rollout.engine=embedded on CPU")
        if world % sglang.gpus_per_engine:
            add("sglang.gpus_per_engine", f"{world} GPUs cannot be split into engines of {sglang.gpus_per_engine}")
        if sglang.gpus_per_engine % sglang.ep_size:
            add("sglang.ep_size", f"must divide gpus_per_engine={sglang.gpus_per_engine}")
        if model.num_experts % sglang.ep_size:
            add("sglang.ep_size", f"{sglang.ep_size} does not divide the {model.num_experts} routed experts")
        if sglang.enable_dp_attention and sglang.gpus_per_engine % sglang.dp_size:
            add("sglang.dp_size", f"must divide gpus_per_engine={sglang.gpus_per_engine}")
        if sglang.dp_size > 1 and not sglang.enable_dp_attention:  # --dp-size replicas (sglang 0.5.23
            # tokenizer_control_mixin.py:451, 509, 569: weight-update groups and tensor updates assert dp_size == 1)
            add(
                "sglang.dp_size",
                f"{sglang.dp_size} data-parallel replicas in one SGLang server cannot take weight "
                "updates; set sglang.enable_dp_attention=true (attention DP, --attn-dp-size) or use "
                "more engines (sglang.gpus_per_engine)",
            )


def _check_quant(r: Recipe, add: Add) -> None:
    """INT4 groups must tile the quantized dimensions."""
    model = r.model
    if r.quant.int4_qat or r.quant.export_format == "int4":
        for name, dim in (
            ("model.hidden_size", model.hidden_size),
            ("model.moe_ffn_hidden_size", model.moe_ffn_hidden_size),
        ):
            if dim % r.quant.group_size:
                add("quant.group_size", f"{name}={dim} is not a multiple of the INT4 group size {r.quant.group_size}")
