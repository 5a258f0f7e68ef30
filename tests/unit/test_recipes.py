"""Recipes: preset values against the seeds, the layout checks, overrides and the CLI."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kimi_pipeline.cli import app
from kimi_pipeline.recipes import RecipeError, check_recipe, load_recipe, pipeline_layers, preset_names

KIMI = ["kimi-k2-instruct", "kimi-k2-thinking", "kimi-k2.5"]
runner = CliRunner()

# (preset, dotted field, value) straight from the seeds' launchers and model definitions.
SEED_VALUES = [
    *[(p, f, v) for p in KIMI for f, v in [
        ("model.num_layers", 61), ("model.first_k_dense", 1), ("model.hidden_size", 7168),
        ("model.ffn_hidden_size", 18432), ("model.num_attention_heads", 64), ("model.q_lora_rank", 1536),
        ("model.kv_lora_rank", 512), ("model.qk_head_dim", 128), ("model.qk_pos_emb_head_dim", 64),
        ("model.v_head_dim", 128), ("model.vocab_size", 163840), ("model.num_experts", 384),
        ("model.moe_router_topk", 8), ("model.moe_ffn_hidden_size", 2048), ("model.num_shared_experts", 1),
        ("model.moe_router_score_function", "sigmoid"), ("model.moe_router_enable_expert_bias", True),
        ("model.moe_router_dtype", "fp32"), ("model.moe_router_topk_scaling_factor", 2.827),
        ("model.rotary_base", 50000), ("model.model_type", "kimi_k2"),
        ("parallel.tp", 8), ("parallel.pp", 8), ("parallel.cp", 4), ("parallel.ep", 32), ("parallel.etp", 1),
        ("parallel.decoder_last_pipeline_num_layers", 5), ("parallel.sequence_parallel", True),
        ("parallel.recompute_granularity", "full"), ("parallel.recompute_method", "uniform"),
        ("parallel.recompute_num_layers", 1), ("parallel.use_dynamic_batch_size", True),
        ("cluster.nodes", 32), ("cluster.gpus_per_node", 8), ("cluster.colocate", True),
        ("rollout.update_weight_buffer_size", 4 * 512 * 1024 * 1024), ("rollout.n_samples_per_prompt", 8),
        ("grpo.eps_clip", 0.2), ("grpo.eps_clip_high", 0.28), ("grpo.kl_loss_coef", 0.0),
        ("grpo.kl_loss_type", "low_var_kl"), ("grpo.entropy_coef", 0.0),
        ("optimizer.optimizer", "adam"), ("optimizer.lr", 1e-6), ("optimizer.lr_decay_style", "constant"),
        ("optimizer.weight_decay", 0.1), ("optimizer.adam_beta1", 0.9), ("optimizer.adam_beta2", 0.98),
        ("optimizer.optimizer_cpu_offload", True), ("optimizer.overlap_cpu_optimizer_d2h_h2d", True),
        ("optimizer.use_precision_aware_optimizer", True), ("optimizer.use_distributed_optimizer", True),
        ("eval.interval", 20), ("convert.nodes", 4), ("convert.gpus_per_node", 8),
        ("data.train.repo_id", "zhuzilin/dapo-math-17k"), ("data.eval.repo_id", "zhuzilin/aime-2024"),
        ("sglang.mem_fraction_static", 0.7), ("sglang.server_concurrency", 1024),
    ]],
    # Instruct vs Thinking
    ("kimi-k2-instruct", "parallel.max_tokens_per_gpu", 16384),
    ("kimi-k2-instruct", "rollout.max_response_len", 32768),
    ("kimi-k2-instruct", "rollout.num_rollout", 100),
    ("kimi-k2-instruct", "rollout.rollout_batch_size", 128),
    ("kimi-k2-instruct", "rollout.num_steps_per_rollout", 4),
    ("kimi-k2-instruct", "rollout.over_sampling_batch_size", 256),
    ("kimi-k2-instruct", "rollout.rm_type", "math"),
    ("kimi-k2-instruct", "eval.n_samples_per_prompt", 8),
    ("kimi-k2-instruct", "grpo.use_tis", False),
    ("kimi-k2-instruct", "model.rotary_scaling_factor", 32.0),
    ("kimi-k2-instruct", "model.norm_epsilon", 1e-6),
    ("kimi-k2-instruct", "sglang.gpus_per_engine", 16),
    ("kimi-k2-instruct", "sglang.ep_size", 16),
    ("kimi-k2-instruct", "sglang.dp_size", 8),
    ("kimi-k2-instruct", "hub.source_format", "fp8"),
    ("kimi-k2-thinking", "parallel.max_tokens_per_gpu", 16384),
    ("kimi-k2-thinking", "rollout.max_response_len", 16384),
    ("kimi-k2-thinking", "rollout.rollout_batch_size", 128),
    ("kimi-k2-thinking", "eval.n_samples_per_prompt", 16),
    ("kimi-k2-thinking", "grpo.use_tis", True),
    ("kimi-k2-thinking", "model.rotary_scaling_factor", 64.0),
    ("kimi-k2-thinking", "model.norm_epsilon", 1e-5),
    ("kimi-k2-thinking", "quant.int4_qat", True),
    ("kimi-k2-thinking", "quant.group_size", 32),
    ("kimi-k2-thinking", "hub.source_format", "int4"),
    # K2.5 (seed 001)
    ("kimi-k2.5", "parallel.max_tokens_per_gpu", 4096),
    ("kimi-k2.5", "rollout.num_rollout", 20),
    ("kimi-k2.5", "rollout.rollout_batch_size", 32),
    ("kimi-k2.5", "rollout.max_response_len", 16384),
    ("kimi-k2.5", "rollout.temperature", 1.0),
    ("kimi-k2.5", "rollout.global_batch_size", 256),
    ("kimi-k2.5", "rollout.use_dynamic_global_batch_size", True),
    ("kimi-k2.5", "rollout.dynamic_sampling", True),
    ("kimi-k2.5", "rollout.rm_type", "deepscaler"),
    ("kimi-k2.5", "rollout.routing_replay", True),
    ("kimi-k2.5", "eval.n_samples_per_prompt", 16),
    ("kimi-k2.5", "eval.max_response_len", 16384),
    ("kimi-k2.5", "eval.top_p", 1.0),
    ("kimi-k2.5", "sglang.gpus_per_engine", 8),
    ("kimi-k2.5", "sglang.ep_size", 8),
    ("kimi-k2.5", "sglang.cuda_graph_bs", [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128]),
    ("kimi-k2.5", "convert.mode", "bridge"),
    ("kimi-k2.5", "quant.int4_qat", True),
    ("kimi-k2.5", "quant.group_size", 32),
    ("kimi-k2.5", "hub.text_config_key", "text_config"),
]


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(("preset", "field", "value"), SEED_VALUES, ids=lambda x: str(x)[:40])
def test_preset_carries_seed_value(preset, field, value):
    assert _get(load_recipe(preset), field) == value


def test_presets_listed_and_valid():
    assert preset_names() == ["kimi-k2-instruct", "kimi-k2-thinking", "kimi-k2.5", "tiny"]
    for name in preset_names():
        assert check_recipe(load_recipe(name)) == []


def test_kimi_layout_derivations():
    r = load_recipe("kimi-k2-thinking")
    assert r.cluster.world_size == 256
    assert r.data_parallel_size == 1
    assert r.global_batch_size == 128 * 8 // 4
    assert pipeline_layers(61, 8, None, 5) == [8, 8, 8, 8, 8, 8, 8, 5]
    assert pipeline_layers(61, 8, 7, 6) == [7, 8, 8, 8, 8, 8, 8, 6]
    assert load_recipe("kimi-k2.5").global_batch_size == 256


def test_tiny_shape_is_deepseek_v3_like():
    m = load_recipe("tiny").model
    assert m.first_k_dense == 1 and m.num_layers > m.first_k_dense
    assert m.num_shared_experts == 1 and m.moe_router_score_function == "sigmoid" and m.moe_router_enable_expert_bias
    assert m.q_lora_rank and m.kv_lora_rank and m.rotary_scaling_factor > 1
    assert m.moe_router_topk_scaling_factor == 2.827


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("parallel.ep=5", "parallel.ep"),
        ("cluster.gpus_per_node=7", "cluster.gpus_per_node"),
        ("cluster.nodes=16", "cluster.gpus_per_node"),
        ("parallel.dp=2", "parallel.dp"),
        ("parallel.decoder_last_pipeline_num_layers=4", "parallel.decoder_last_pipeline_num_layers"),
        ("model.num_layers=60", "parallel.decoder_last_pipeline_num_layers"),
        ("parallel.tp=3", "parallel.tp"),
        ("rollout.global_batch_size=100", "rollout.global_batch_size"),
        ("rollout.max_response_len=300000", "rollout.max_response_len"),
        ("eval.interval=101", "eval.interval"),
        ("convert.ep=5", "convert.ep"),
        ("sglang.ep_size=5", "sglang.ep_size"),
    ],
)
def test_invalid_layouts_name_the_field(override, field):
    with pytest.raises(RecipeError) as e:
        load_recipe("kimi-k2-thinking", [override])
    assert any(p.field == field for p in e.value.problems), str(e.value)
    assert field in str(e.value)


def test_unknown_field_and_type_errors():
    with pytest.raises(RecipeError, match=r"parallel has no field 'tpp'.*tp"):
        load_recipe("tiny", ["parallel.tpp=2"])
    with pytest.raises(RecipeError, match=r"parallel\.tp"):
        load_recipe("tiny", ["parallel.tp=two"])
    with pytest.raises(RecipeError, match="no preset or file named 'kimi-k3'"):
        load_recipe("kimi-k3")
    # the token alone, or inside a whole section (issue 40 item 5: `hub={...}` used to carry it past the check)
    for assignment in ("hub.token=hf_abcdef", "hub={token: hf_abcdef}",
                       "hub={model: {kind: local, path: m}, token: hf_abcdef}", "hub.token={a: hf_abcdef}"):
        with pytest.raises(RecipeError, match=r"hub\.token: secrets are not accepted") as e:
            load_recipe("tiny", [assignment])
        assert "hf_abcdef" not in str(e.value), assignment


def test_yaml_extends_and_env_alias(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("extends: kimi-k2-thinking\nname: mine\nrollout:\n  num_rollout: 40\nparallel:\n  ep: 16\n")
    r = load_recipe(f, ["optimizer.lr=2e-6"], env={})
    assert (r.name, r.rollout.num_rollout, r.parallel.ep, r.optimizer.lr) == ("mine", 40, 16, 2e-6)
    assert r.parallel.tp == 8  # inherited
    r = load_recipe("kimi-k2-instruct", env={"OPEN_TRAINING_INT4_FAKE_QAT_FLAG": "1", "OPEN_TRAINING_INT4_GROUP_SIZE": "64"})
    assert r.quant.int4_qat is True and r.quant.group_size == 64
    bad = tmp_path / "bad.yaml"
    bad.write_text("extends: kimi-k2-thinking\nparallel: {ep: 5}\n")
    with pytest.raises(RecipeError, match="parallel.ep"):
        load_recipe(bad)


def test_cli_recipe_commands():
    assert "kimi-k2.5" in runner.invoke(app, ["recipe", "list"]).output
    for name in preset_names():
        res = runner.invoke(app, ["recipe", "check", name])
        assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["recipe", "check", "kimi-k2-thinking", "--set", "parallel.ep=5"])
    assert res.exit_code == 1 and "parallel.ep" in res.output
    res = runner.invoke(app, ["recipe", "show", "kimi-k2.5", "--json"])
    assert res.exit_code == 0 and '"max_tokens_per_gpu": 4096' in res.output
    res = runner.invoke(app, ["recipe", "show", "tiny"])
    assert "num_layers: 4" in res.output
