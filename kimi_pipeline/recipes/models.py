"""Typed recipe sections.

A recipe is everything a run needs to know, in one validated object: the model shape, where the
weights and data come from, the conversion and training layouts, the GRPO algorithm, eval,
optimizer, quantization and paths. Field names follow the Megatron/miles flags they stand for so
that users can map a launcher script onto a recipe line by line.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator


class Section(BaseModel):
    """Base for every section: unknown keys are errors (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class VisionSpec(Section):
    """The MoonViT vision tower and patch-merger projector a multimodal Kimi (K2.5) ships beside its language model,
    as its config.json's `vision_config` gives them (`vt_*` keys). RL trains the language model only; these weights
    ride along: the engines hold them (`kimi plan` counts them) and the INT4 export carries them as stored. Tensors:
    `vision_tower.patch_embed.{proj,pos_emb}`, `vision_tower.encoder.blocks.{i}.{norm0,norm1,wqkv,wo,mlp.fc0,mlp.fc1}`,
    `vision_tower.encoder.final_layernorm`, `mm_projector.{pre_norm,proj.0,proj.2}`."""

    num_layers: int = Field(27, gt=0, description="vt_num_hidden_layers")
    hidden_size: int = Field(1152, gt=0, description="vt_hidden_size")
    ffn_hidden_size: int = Field(4304, gt=0, description="vt_intermediate_size")
    num_attention_heads: int = Field(16, gt=0, description="vt_num_attention_heads")
    patch_size: int = Field(14, gt=0)
    pos_emb_height: int = Field(64, gt=0, description="init_pos_emb_height")
    pos_emb_width: int = Field(64, gt=0, description="init_pos_emb_width")
    merge_kernel_size: tuple[int, int] = Field((2, 2), description="patches merged into one projector input")

    def shapes(self, text_hidden_size: int) -> dict[str, tuple[int, ...]]:
        """Every tensor of the tower and the projector (into a language model of `text_hidden_size`), by its
        stored name, as K2.5 ships them."""
        h, f, p = self.hidden_size, self.ffn_hidden_size, self.patch_size
        merged = h * self.merge_kernel_size[0] * self.merge_kernel_size[1]  # the projector's input: merged patches
        out: dict[str, tuple[int, ...]] = {
            "vision_tower.patch_embed.proj.weight": (h, 3, p, p), "vision_tower.patch_embed.proj.bias": (h,),
            "vision_tower.patch_embed.pos_emb.weight": (self.pos_emb_height, self.pos_emb_width, h),
        }
        for i in range(self.num_layers):
            b = f"vision_tower.encoder.blocks.{i}."
            out.update({b + "norm0.weight": (h,), b + "norm0.bias": (h,), b + "norm1.weight": (h,),
                        b + "norm1.bias": (h,), b + "wqkv.weight": (3 * h, h), b + "wqkv.bias": (3 * h,),
                        b + "wo.weight": (h, h), b + "wo.bias": (h,), b + "mlp.fc0.weight": (f, h),
                        b + "mlp.fc0.bias": (f,), b + "mlp.fc1.weight": (h, f), b + "mlp.fc1.bias": (h,)})
        out.update({"vision_tower.encoder.final_layernorm.weight": (h,),
                    "vision_tower.encoder.final_layernorm.bias": (h,),
                    "mm_projector.pre_norm.weight": (h,), "mm_projector.pre_norm.bias": (h,),
                    "mm_projector.proj.0.weight": (merged, merged), "mm_projector.proj.0.bias": (merged,),
                    "mm_projector.proj.2.weight": (text_hidden_size, merged),
                    "mm_projector.proj.2.bias": (text_hidden_size,)})
        return out

    def num_params(self, text_hidden_size: int) -> int:
        """Parameters of the tower and the projector."""
        return sum(math.prod(s) for s in self.shapes(text_hidden_size).values())


class ModelSpec(Section):
    """DeepSeek-V3-shaped model (MLA attention, sigmoid-routed MoE with expert bias).

    Read by: `model.megatron_model` (builds it), `hf.names` (HF ↔ megatron names), the engines
    (`engine.model`, via `rl.rollout_manager`), `rl.policy`, `weightjobs.export_rank`, `kimi plan`."""

    model_type: str = Field("kimi_k2", description="config.json model_type as the checkpoint ships it")
    num_layers: int = Field(gt=0)
    first_k_dense: int = Field(1, ge=0, description="leading dense (non-MoE) layers")
    hidden_size: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0, description="intermediate size of the dense layers")
    num_attention_heads: int = Field(gt=0)
    q_lora_rank: int | None = Field(gt=0)
    kv_lora_rank: int = Field(gt=0)
    qk_head_dim: int = Field(gt=0, description="no-rope part of the q/k head (qk_nope_head_dim)")
    qk_pos_emb_head_dim: int = Field(gt=0, description="rope part of the q/k head (qk_rope_head_dim)")
    v_head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    num_experts: int = Field(gt=0, description="routed experts per MoE layer")
    moe_router_topk: int = Field(gt=0)
    moe_ffn_hidden_size: int = Field(gt=0)
    num_shared_experts: int = Field(1, ge=0)
    moe_router_score_function: Literal["sigmoid", "softmax"] = "sigmoid"
    moe_router_enable_expert_bias: bool = True
    moe_router_dtype: Literal["fp32", "fp64", "bf16"] = "fp32"
    moe_router_topk_scaling_factor: float = Field(gt=0)
    moe_router_num_groups: int = Field(1, gt=0)
    moe_router_group_topk: int = Field(1, gt=0)
    norm_epsilon: float = Field(gt=0)
    rotary_base: float = Field(gt=0)
    rotary_scaling_factor: float = Field(gt=0, description="YaRN factor")
    original_max_position_embeddings: int = Field(4096, gt=0)
    max_position_embeddings: int = Field(gt=0, description="context length")
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    tie_word_embeddings: bool = False
    params_dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    vision: VisionSpec | None = Field(
        None, description="the vision tower + projector of a multimodal checkpoint (K2.5); not trained by RL")

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense


SourceFormat = Literal["bf16", "fp8", "int4"]


class Source(Section):
    """Where a model or dataset comes from: the HF hub (pinned revision) or a local directory/file.

    Local paths are relative to the project root unless absolute.
    """

    kind: Literal["hub", "local"]
    repo_id: str | None = None
    revision: str = "main"
    repo_type: Literal["model", "dataset"] = "model"
    allow_patterns: list[str] | None = None
    path: str | None = Field(None, description="local directory or file (kind=local)")
    filename: str | None = Field(None, description="the file to use inside a dataset repo/dir")

    def describe(self) -> str:
        if self.kind == "hub":
            return f"hf://{self.repo_id}@{self.revision}" + (f"/{self.filename}" if self.filename else "")
        return f"local:{self.path}" + (f"/{self.filename}" if self.filename else "")


class HubSpec(Section):
    """Model sources: the policy checkpoint, an optional separate reference checkpoint, and access.

    Read by: the download stage (`hub.fetch`); `text_config_key` / `trust_remote_code` by every reader of the
    checkpoint (`weightjobs.conversion.ConvertSections`, `rl.policy`, `stages.validate`, `eval.record.EvalSections`,
    the engines' `engine.kinds.EngineSections`)."""

    model: Source
    ref_model: Source | None = Field(None, description="separate reference checkpoint (K2.5: BF16 ref)")
    source_format: SourceFormat = Field("bf16", description="weight format of the policy checkpoint")
    text_config_key: str | None = Field(
        None, description="config.json key holding the language model config (K2.5: text_config)"
    )
    trust_remote_code: bool = Field(False, description="needed only for Kimi's tiktoken tokenizer")
    token: SecretStr | None = Field(None, description="HF token; prefer HF_TOKEN env or a Prefect Secret")
    offline: bool = Field(False, description="only use local files / the HF cache, never the network")
    verify: Literal["sha256", "size"] = Field("sha256", description="how reused files are re-verified")


class DataSpec(Section):
    """The train and eval data sets and their columns. Read by: `hub.fetch`, `data.validation`, the prompt
    stream (`rl.rollout_manager`) and the eval (`eval.record`)."""

    train: Source
    eval: Source
    input_key: str = "prompt"
    label_key: str = "label"
    max_bad_fraction: float = Field(0.01, ge=0, le=1, description="validate fails above this")
    max_contamination: float = Field(0.0, ge=0, le=1, description="train/eval prompt overlap allowed")
    apply_chat_template: bool = True


class ConvertSpec(Section):
    """The weight jobs' layout (a torch.distributed job over N nodes) and the conversion's own switches.

    Both distributed weight jobs run in this layout: the HF -> Megatron torch_dist conversion and the INT4 export
    (`weightjobs.job.JobLayout.of`: nodes, ranks per node, split, launcher); `mode` and `verify` are the
    conversion's (`weightjobs.conversion`)."""

    mode: Literal["torch_dist", "bridge"] = "torch_dist"
    nodes: int = Field(4, gt=0)
    gpus_per_node: int = Field(8, gt=0, description="ranks per node (GPUs, or CPU processes)")
    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    ep: int = Field(1, gt=0)
    etp: int = Field(1, gt=0)
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    verify: bool = Field(True, description="reload + compare every tensor; skip only for huge models")
    launcher: Literal["auto", "local", "ray", "manual"] = Field(
        "auto", description="who starts the per-node torchrun agents of the conversion and INT4 export jobs: auto = "
        "one per Ray node when cluster.address names a cluster with enough nodes, else all on this host; manual = "
        "print the per-node command and wait for every rank to report")
    master_port: int = Field(29500, gt=0, lt=65536, description="rendezvous port on node 0 (manual launcher)")


class ParallelSpec(Section):
    """Training (actor) parallel layout, as Megatron flags.

    Read by: `model.parallel.Layout.from_parallel` (the trainer's process groups), `rl.actor_layout` (ranks →
    nodes/GPUs), `rl.policy` and `rl.samples` (micro-batches), `kimi plan`."""

    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    cp: int = Field(1, gt=0)
    ep: int = Field(1, gt=0)
    etp: int = Field(1, gt=0)
    dp: int | None = Field(None, gt=0, description="data parallel size; derived from the GPU count if unset")
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    sequence_parallel: bool = False
    use_dynamic_batch_size: bool = True
    max_tokens_per_gpu: int = Field(16384, gt=0)
    recompute_granularity: Literal["full", "selective"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = None
    moe_token_dispatcher_type: Literal["alltoall", "flex"] = Field(
        "alltoall", description="flex = DeepEP (seed 000's K2-Instruct); falls back to alltoall where deep_ep is absent")


class ClusterSpec(Section):
    """The Ray cluster a run needs. Read by: the cluster stage (`cluster.lifecycle`, `cluster.readiness`,
    `cluster.preflight`), `cluster.placement` and `rl.actor_layout` (where actors go), `weightjobs.job`, and the
    records that resolve it for a component: `weight_sync.updaters.SyncSections`, `engine.kinds.EngineSections`,
    `weightjobs.conversion.ConvertSections`, `weightjobs.int4_export.ExportSections`, `eval.record.EvalSections`."""

    nodes: int = Field(1, gt=0, description="actor nodes (--actor-num-nodes)")
    gpus_per_node: int = Field(8, gt=0, description="GPUs per node; on device=cpu, trainer ranks per node")
    device: Literal["cuda", "cpu"] = "cuda"
    colocate: bool = True
    address: str | None = Field(None, description="existing Ray cluster address; None = embedded local head")
    keep: bool = Field(False, description="keep the embedded cluster running after the flow")
    cpus_per_node: int | None = Field(None, gt=0, description="required CPUs per node (health check)")
    memory_gb_per_node: float | None = Field(None, gt=0, description="required RAM per node (health check)")
    allow_insecure: bool = Field(
        False, description="run on a Ray cluster of several nodes without token auth (RAY_AUTH_MODE=disabled): "
        "anyone who reaches a node's ports can run code as the run's user; refused unless true")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


class RolloutSpec(Section):
    """Generation and rewards per rollout, and the step schedule. Read by: `rl.rollout` / `rl.rollout_manager`
    (sampling, dynamic sampling, rewards), `rl.samples` (the split into steps), `rl.policy`,
    `weight_sync.updaters.SyncSections`, `engine.kinds.EngineSections`, `eval.record.EvalSections` (seed and grader),
    `rl.loop`, `data.validation` (prompt length)."""

    engine: Literal["sglang", "embedded"] = "sglang"
    num_rollout: int = Field(gt=0)
    rollout_batch_size: int = Field(gt=0, description="prompts per rollout")
    n_samples_per_prompt: int = Field(gt=0)
    max_prompt_len: int = Field(2048, gt=0)
    max_response_len: int = Field(gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 = disabled (RL needs the untruncated distribution)")
    global_batch_size: int | None = Field(None, gt=0, description="samples per optimizer step")
    num_steps_per_rollout: int = Field(1, gt=0)
    use_dynamic_global_batch_size: bool = False
    over_sampling_batch_size: int | None = Field(None, gt=0)
    dynamic_sampling: bool = Field(False, description="keep only groups with reward std > 1e-8")
    dynamic_sampling_max_draws: int = Field(
        4, gt=0, description="over-sampled batches drawn per rollout before training on the groups found so far")
    shuffle: bool = True
    balance_data: bool = True
    rm_type: str = Field(
        "math", description="answer grader: math, deepscaler, or your own function path package.module:function "
        "(like slime's custom_rm_path) returning a kimi_pipeline.reward.Verdict")
    thinking: bool = Field(False, description="responses open with <think>…</think>: grade only the text after it")
    reward_strict: bool = Field(
        False, description="stricter than the seeds' reward: the answer region must END with the boxed answer")
    update_weight_buffer_size: int = Field(4 * 512 * 1024 * 1024, gt=0, description="bytes per weight-sync chunk")
    weight_sync: Literal["auto", "disk"] = Field(
        "auto", description="auto: shared memory / a weight-update process group (SGLang colocated: shared storage "
        "until its CUDA-IPC path is proven on a GPU); disk: an HF checkpoint on shared storage, the explicit fallback")
    engine_weight_format: Literal["auto", "model", "bf16", "fp8", "int4"] = Field(
        "auto", description="what weight sync sends: the engine's own format (auto: SGLang serves INT4 when the "
        "policy exports to INT4, FP8 for an FP8 hub checkpoint, else bf16; the embedded engine: the trainer's dtype)")
    routing_replay: bool = False
    routing_agreement: bool = Field(
        False, description="with routing replay off: the engines return their routed expert ids and each step's row "
        "gets `routing_agreement`, the fraction of (response token, MoE layer) pairs where the trainer's routers "
        "pick the engine's experts. The ids cost what routing replay's do (SGLang --enable-return-routed-experts: "
        "MoE layers x top-k int32 per token, 1.9 KB for K2), so it is off in the large presets")
    save_data: bool = Field(
        False, description="save each rollout (tokens, log-probs, rewards, advantages, routed experts, metrics) under "
        "DIR/train/rollouts, to train on again with `kimi train --replay-rollouts`")
    max_engine_restarts: int = Field(
        3, ge=0, description="restarts of one rollout engine that stopped answering (its requests go to the "
        "others, it comes back at the policy's weights after the next sync); one more death fails the stage, "
        "retryably")
    seed: int = 42

    @property
    def returns_routed_experts(self) -> bool:
        """The engines return routed expert ids: for routing replay, or to measure routing agreement."""
        return self.routing_replay or self.routing_agreement

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def samples_per_step(self) -> int:
        """Samples per optimizer step: `global_batch_size`, else the rollout over `num_steps_per_rollout` steps."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        return self.samples_per_rollout // self.num_steps_per_rollout

    @property
    def optimizer_steps_per_rollout(self) -> int:
        """The optimizer steps the trainer takes per rollout: one with a dynamic global batch (every kept sample in
        one step: `rl.batching.step_batch_size`), else `num_steps_per_rollout` (the recipe checks make a
        global_batch_size agree with it)."""
        return 1 if self.use_dynamic_global_batch_size else self.num_steps_per_rollout


class SGLangSpec(Section):
    """SGLang's own server settings. Read by: `engine.sglang` (its launch command, through
    `engine.kinds.EngineSections`),
    `rl.actor_layout` (GPUs per engine), `weight_sync.updaters.SyncSections`."""

    gpus_per_engine: int = Field(8, gt=0)
    mem_fraction_static: float = Field(0.7, gt=0, le=1)
    ep_size: int = Field(1, gt=0)
    dp_size: int = Field(1, gt=0)
    enable_dp_attention: bool = False
    moe_dense_tp_size: int | None = None
    enable_dp_lm_head: bool = False
    disable_radix_cache: bool = False
    server_concurrency: int = Field(512, gt=0)
    cuda_graph_bs: list[int] | None = None
    host: str = Field("127.0.0.1", description="bind address on a one-node layout (loopback unless you mean it); "
                      "a layout over several nodes binds each engine to its node's address")
    python: str | None = Field(None, description="interpreter of SGLang's own environment (`make sglang-env`); "
                               "None: $KIMI_SGLANG_PYTHON, else .venv-sglang beside this environment")


class GRPOSpec(Section):
    """The GRPO objective. Read by: `rl.grpo` (advantages and the loss, through `rl.policy`) and the train
    stage (whether a KL reference is loaded)."""

    advantage_estimator: Literal["grpo"] = Field("grpo", description="rl.grpo.ADVANTAGE_ESTIMATORS entry")
    eps_clip: float = Field(0.2, gt=0)
    eps_clip_high: float = Field(0.28, gt=0)
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0)
    kl_loss_type: Literal["low_var_kl", "k1", "k2"] = "low_var_kl"
    entropy_coef: float = Field(0.0, ge=0)
    use_tis: bool = False
    tis_clip: float = Field(2.0, gt=0)
    tis_clip_low: float = Field(0.0, ge=0)


class EvalSpec(Section):
    """The periodic evaluation. Read by: `eval.record` (`EvalSections`) / `eval.evaluate` and `rl.loop` (when it
    runs)."""

    name: str = Field("aime", description="the eval set's name: labels its reports and eval.jsonl rows (eval_set)")
    interval: int = Field(20, gt=0, description="evaluate every N rollouts")
    n_samples_per_prompt: int = Field(16, gt=0)
    max_response_len: int = Field(16384, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)


class OptimizerSpec(Section):
    """The trainer's optimizer and learning-rate schedule. Read by: `model.megatron_train` (through `rl.policy`)."""

    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = Field(gt=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    lr_warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.98, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, ge=0)
    use_distributed_optimizer: bool = True
    optimizer_cpu_offload: bool = False
    overlap_cpu_optimizer_d2h_h2d: bool = False
    use_precision_aware_optimizer: bool = False


class QuantSpec(Section):
    """INT4 QAT in training and the export format. Read by: `rl.policy` (QAT), `weight_sync.updaters.SyncSections` and
    `weight_sync.formats` (what the engines are sent), the export stage (`weightjobs.int4_export.ExportSections`)."""

    int4_qat: bool = Field(False, description="fake-INT4 routed experts in the forward (env OPEN_TRAINING_INT4_FAKE_QAT_FLAG)")
    group_size: int = Field(32, gt=0, description="env OPEN_TRAINING_INT4_GROUP_SIZE")
    export_format: Literal["int4", "bf16"] = "int4"


class ExportSpec(Section):
    """The export scored as it will be served. Read by: the export stage (`eval.served.ServedSections`)."""

    score: bool = Field(True, description="after the export is written, the recipe's rollout engine (embedded on CPU, "
                                          "SGLang on GPU) loads it from disk and the eval set is scored on it")
    max_eval_drop: float | None = Field(0.05, ge=0, description="avg@n the served export may lose against the training "
                                                                "eval at the exported step; more fails the stage "
                                                                "(permanent; the export stays on disk, marked "
                                                                "unpublished). None: record the scores only")


class CheckpointSpec(Section):
    """Training checkpoints. Read by: `rl.loop` (when to save, what to keep)."""

    save_interval: int = Field(20, gt=0, description="rollouts between torch_dist checkpoints")
    keep_last: int | None = Field(None, gt=0, description="delete older iterations after each save (None: keep all)")


MismatchMetric = Literal["mismatch_k3", "mismatch_abs_logp_mean", "mismatch_abs_logp_max"]


class MismatchRule(Section):
    """Stop when the engines sample from a policy the trainer does not hold (broken weight sync, a drifting kernel):
    the step's `metric` above `max` for `steps` consecutive steps."""

    metric: MismatchMetric = Field("mismatch_k3", description="a train/rollout mismatch column of the step's row")
    max: float = Field(0.05, gt=0, description="bound on the metric; k3 0.05 nats per token is a sampler that "
                                               "disagrees with the trainer on a sizeable share of tokens (a healthy "
                                               "run's k3 is orders of magnitude lower: tiny CPU < 1e-6)")
    steps: int = Field(3, gt=0, description="consecutive steps above the bound before the run stops")


class CollapseRule(Section):
    """Stop on reward collapse: the moving mean of the training reward (over `window` steps) below `fraction` of its
    best so far for `steps` consecutive steps. The stop names the last checkpoint from before the collapse began."""

    window: int = Field(10, gt=0, description="steps in the moving mean of `reward`")
    fraction: float = Field(0.5, gt=0, le=1, description="collapse: the moving mean below this share of its best")
    steps: int = Field(5, gt=0, description="consecutive collapsed steps before the run stops")


class TruncationRule(Section):
    """Warn (never stop) when many responses hit `rollout.max_response_len`: rewards of cut-off answers say
    little, and a rising share is the first sign of a policy that rambles."""

    max_fraction: float = Field(0.5, ge=0, le=1, description="warn above this `truncated_fraction` of a rollout")


class HealthSpec(Section):
    """Rules a run checks at every step, each with a default and `off` (`health.<rule>: off`). A stop is a
    permanent error naming the rule, the step, the values and the checkpoint to resume from; each step's row
    records every rule's verdict (`health_<rule>`: 0 ok, 1 warn, 2 stop). Read by: `rl.loop` (`rl.health_rules`) and the
    trainer (`nonfinite`, checked before the optimizer step)."""

    nonfinite: Literal["stop", "off"] = Field(
        "stop", description="a non-finite gradient norm or loss stops the run before the optimizer step (and so "
                            "before any checkpoint) takes the values")
    mismatch: MismatchRule | Literal["off"] = Field(default_factory=MismatchRule)
    collapse: CollapseRule | Literal["off"] = Field(default_factory=CollapseRule)
    truncation: TruncationRule | Literal["off"] = Field(default_factory=TruncationRule)

    @field_validator("nonfinite", "mismatch", "collapse", "truncation", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false


class PathsSpec(Section):
    """Where runs live. Read by: `stages.prepare_run`, `hub.fetch`, `cluster.preflight` (shared storage)."""

    base_dir: str = Field("runs", description="shared filesystem root reachable from every node")
