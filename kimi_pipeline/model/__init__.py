"""The model and its training machinery, below `rl`: the megatron-core GPTModel built from a `ModelSpec`
(`megatron_model`, with `grouped_experts` and the `megatron_compat` patches), its training step, optimizer and
torch_dist checkpoints (`megatron_train`, `checkpoint_dirs`, `checkpoint_manifest`), the parallel bring-up
(`parallel`, `context_parallel`, `vocab_parallel`), colocated offload (`offload`) and the HF side (`hf_model`,
`hf_config`, `tokenizer`); `params` counts parameters for `kimi plan`. No entry of its own: `rl.policy.PolicyWorker`
trains with it, `convert` and `weight_sync` load through it."""

from kimi_pipeline.model.megatron_import import eager_fused_functions_when_dynamo_is_off, megatron_without_wandb

# Before megatron can be imported through this package (every megatron import of ours is below it): megatron's fused
# functions without torch.compile's wrappers where dynamo is off (megatron_import: ~1 CPU-s a process, measured), and
# its modules that import wandb for writers we never pass without it (~0.3 CPU-s a process).
eager_fused_functions_when_dynamo_is_off()
megatron_without_wandb()
