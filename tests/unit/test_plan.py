"""`kimi plan`: parameter counts, the memory model against Megatron's formula, verdicts and the CLI."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

from kimi_pipeline.model.params import pp_stage_params
from kimi_pipeline.plan import count_params, get_gpu, make_plan, megatron_bytes_per_param, plan_command
from kimi_pipeline.plan.memory import MemoryAssumptions, PlanLayout, train_pp_stages
from kimi_pipeline.plan.timing import TimeAssumptions, forward_flops_per_token
from kimi_pipeline.recipes import load_recipe, pipeline_layers

KIMI = ["kimi-k2-instruct", "kimi-k2-thinking", "kimi-k2.5"]
REQUIRED = {
    "params_total", "params_active", "fits", "gpu_mem_gb", "host_mem_gb", "step_seconds_estimate",
    "assumptions", "layout", "gpu", "largest_consumer", "headroom_gb", "reason",
}
GPU_FIELDS = {
    "weights", "grads", "optimizer", "activations", "weight_sync_buffer", "sglang_weights", "sglang_kv_cache",
    "cuda_graphs", "total_train", "total_rollout", "peak",
}


@pytest.fixture(scope="module")
def recipes():
    return {name: load_recipe(name) for name in [*KIMI, "tiny"]}


def _cli(*args: str):
    app = typer.Typer()
    app.command("plan")(plan_command)
    app.command("noop")(lambda: None)  # a second command keeps `plan` a sub-command
    return CliRunner().invoke(app, ["plan", *args])


# ---------------------------------------------------------------------------------------------- params


def test_tiny_param_count_by_hand(recipes):
    """hidden 128, 4 heads, q_lora 64, kv_lora 32, qk 32 + rope 16, v 32, vocab 384, 16 experts top-4, 1 shared."""
    pc = count_params(recipes["tiny"].model)
    q_a, q_norm, q_b = 128 * 64, 64, 64 * 4 * (32 + 16)
    kv_a, kv_norm, kv_b = 128 * (32 + 16), 32, 32 * 4 * (32 + 32)
    o = 4 * 32 * 128
    attn = q_a + q_norm + q_b + kv_a + kv_norm + kv_b + o
    assert (pc.attn_split, pc.attn_replicated) == (q_b + kv_b + o, q_a + q_norm + kv_a + kv_norm)
    norms, dense, expert, router = 2 * 128, 3 * 128 * 384, 3 * 128 * 64, 128 * 16 + 16
    dense_layer = attn + norms + dense
    moe_layer = attn + norms + router + 16 * expert + expert
    total = dense_layer + 3 * moe_layer + 2 * 384 * 128 + 128
    assert pc.total == total == 1_711_664
    assert pc.active == total - 3 * (16 - 4) * expert == 826_928
    assert pc.active_matmul == pc.active - 384 * 128


def test_kimi_k2_counts_match_checkpoint_and_published(recipes):
    pc = count_params(recipes["kimi-k2-thinking"].model)
    assert pc.total == 1_026_408_232_448  # logical parameter count of the released safetensors
    assert abs(pc.total / 1.04e12 - 1) < 0.015  # report's "1.04 T" headline (1.3 % above the exact count)
    assert abs(pc.active / 32.6e9 - 1) < 0.01  # "32.6 B activated": embeddings + lm_head + top-8 + shared
    # the Instruct and K2.5 text backbones have the same shape
    assert count_params(recipes["kimi-k2-instruct"].model).total == pc.total
    assert count_params(recipes["kimi-k2.5"].model).total == pc.total


def test_deepseek_v3_shape_gives_671b(recipes):
    m = recipes["kimi-k2-thinking"].model.model_copy(
        update=dict(first_k_dense=3, num_attention_heads=128, vocab_size=129280, num_experts=256)
    )
    assert count_params(m).total == 671_026_419_200


def test_stages_partition_the_model(recipes):
    r = recipes["kimi-k2-thinking"]
    pc = count_params(r.model)
    split = pipeline_layers(61, 8, None, 5)
    start, total = 0, 0
    for s, n in enumerate(split):
        sp = pp_stage_params(pc, start, n, s == 0, s == 7, 8, False)
        total += sp.total
        start += n
        if s == 0:
            assert sp.dense_layers == 1
    assert total == pc.total


# ---------------------------------------------------------------------------------------------- Megatron


def _megatron_params(a: SimpleNamespace) -> int:
    """Megatron-LM theoretical_memory_usage.compute_weight_and_optimizer_memory, MLA branch, re-derived:
    per layer MLA q/kv LoRA terms (+ norm), rope projection, o_proj; 2 x hidden x (1.5 x ffn + 1) for a SwiGLU
    MLP with its RMSNorms; MoE layers sum routed + shared FFNs; untied embeddings twice; final norm.
    (It leaves the router out.)"""
    q = a.q_lora_rank * (a.hidden_size + a.num_attention_heads * (a.qk_head_dim + a.qk_pos_emb_head_dim) + 1)
    attn = (
        q
        + a.kv_lora_rank * (a.hidden_size + a.num_attention_heads * (a.qk_head_dim + a.v_head_dim) + 1)
        + a.hidden_size * a.qk_pos_emb_head_dim
        + a.num_attention_heads * a.v_head_dim * a.hidden_size
    )
    dense = 2 * a.hidden_size * (a.ffn_hidden_size * 3 / 2 + 1) + attn
    moe = 2 * a.hidden_size * (a.moe_ffn_hidden_size * a.num_experts * 3 / 2 + a.moe_ffn_hidden_size * 3 / 2 + 1) + attn
    block = dense * a.num_dense + moe * a.num_moe + a.hidden_size
    return int(block + 2 * a.hidden_size * a.padded_vocab_size)


def _megatron_weight_and_optimizer_bytes(a: SimpleNamespace) -> float:
    # tp = pp = 1: the most-loaded shard is the whole model
    return _megatron_params(a) * (18 if not a.use_distributed_optimizer else 6 + 12 / a.data_parallel_size)


@pytest.mark.parametrize("distributed", [True, False])
@pytest.mark.parametrize("dp", [1, 8, 64])
def test_reproduces_megatron_theoretical_memory(dp, distributed):
    r = load_recipe(
        "kimi-k2-thinking",
        [
            "parallel.tp=1", "parallel.pp=1", "parallel.cp=1", "parallel.ep=1",
            "parallel.decoder_last_pipeline_num_layers=null", "parallel.sequence_parallel=false",
            f"optimizer.use_distributed_optimizer={str(distributed).lower()}", "optimizer.optimizer_cpu_offload=false",
        ],
        check=False,
    )
    m, pc = r.model, count_params(r.model)
    args = SimpleNamespace(
        hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads, q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank, qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim, ffn_hidden_size=m.ffn_hidden_size, moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        num_experts=m.num_experts, num_dense=m.first_k_dense, num_moe=m.num_moe_layers,
        padded_vocab_size=m.vocab_size, use_distributed_optimizer=distributed, data_parallel_size=dp,
    )
    routers = pc.num_moe_layers * pc.router
    assert _megatron_params(args) == pc.total - routers  # same model, bar the router Megatron omits

    lay = PlanLayout(nodes=dp, gpus_per_node=1, tp=1, pp=1, cp=1, ep=1, etp=1, dp=dp)
    (st,) = train_pp_stages(r, pc, lay, 1, MemoryAssumptions())
    assert st.params_per_gpu == pc.total
    per_param = megatron_bytes_per_param(distributed, dp)
    assert st.state_gpu == pytest.approx(st.params_per_gpu * per_param, rel=1e-12)
    assert st.state_gpu - routers * per_param == pytest.approx(_megatron_weight_and_optimizer_bytes(args), rel=1e-12)


def test_expert_optimizer_shards_over_expert_dp():
    r = load_recipe("kimi-k2.5", ["optimizer.optimizer_cpu_offload=false"])
    pc = count_params(r.model)
    lay = PlanLayout(nodes=32, gpus_per_node=8, tp=8, pp=8, cp=4, ep=32, etp=1, dp=1, last=5)
    st = train_pp_stages(r, pc, lay, 8, MemoryAssumptions())[1]
    experts = 8 * (384 // 32) * pc.expert  # 8 MoE layers x 12 local experts, expert-DP = 256 / (32 x 8) = 1
    dense = st.params_per_gpu - experts
    assert st.optimizer_gpu == pytest.approx(12 * (dense / 4 + experts))  # dense over DP x CP = 4


def test_checkpoint_gather_is_the_unsharded_optimizer_state_of_a_dp_rank_0_node():
    """Saving gathers each model-parallel shard's whole fp32 optimizer state on its DP rank 0, in host memory
    (megatron_train.SHARDED_METADATA, mem_efficient): 12 bytes per parameter of every GPU of that node."""
    from kimi_pipeline.model.megatron_train import SHARDED_METADATA
    from kimi_pipeline.plan.memory import host_memory

    assert SHARDED_METADATA["distrib_optim_fully_reshardable_mem_efficient"] is True
    r = load_recipe("kimi-k2-thinking")
    pc = count_params(r.model)
    lay = PlanLayout(nodes=32, gpus_per_node=8, tp=8, pp=8, cp=4, ep=32, etp=1, dp=1, last=5)
    st = train_pp_stages(r, pc, lay, 8, MemoryAssumptions())[1]
    host = host_memory(r, st, lay, MemoryAssumptions())
    assert host["checkpoint_gather"] == pytest.approx(8 * 12 * st.params_per_gpu)
    assert host["checkpoint_gather"] > host["cpu_optimizer"]  # unsharded over DP: more than the live shard
    plan = make_plan(r, get_gpu("h200"))
    assert plan["host_mem_gb"]["checkpoint_gather"] == pytest.approx(host["checkpoint_gather"] / 2**30, rel=1e-3)


# ---------------------------------------------------------------------------------------------- verdicts


@pytest.mark.parametrize("name", KIMI)
def test_kimi_recipes_fit_on_32x8_h200(recipes, name):
    plan = make_plan(recipes[name], get_gpu("h200"))
    assert plan["fits"], plan["reason"]
    assert plan["layout"]["world"] == 256 and not plan["layout"]["adjusted"]
    mem = plan["gpu_mem_gb"]
    assert 0 < mem["peak"] <= mem["capacity"] and plan["headroom_gb"] > 0
    assert mem["peak"] == max(mem["total_train"], mem["total_rollout"], mem["total_weight_sync"])
    assert plan["host_mem_gb"]["total"] < plan["host_mem_gb"]["capacity"]
    assert plan["step_seconds_estimate"] > 0


def test_one_h100_node_does_not_fit(recipes):
    plan = make_plan(recipes["kimi-k2-thinking"], get_gpu("h100"), nodes=1)
    assert plan["fits"] is False
    assert "8 GPUs cannot hold the layout" in plan["reason"] and "at least 4 node(s)" in plan["reason"]


def test_fewer_nodes_shrink_dp_then_pp(recipes):
    plan = make_plan(recipes["kimi-k2-thinking"], get_gpu("h200"), nodes=16)
    lay = plan["layout"]
    assert lay["adjusted"] and (lay["pp"], lay["dp"], lay["tp"], lay["cp"], lay["ep"]) == (4, 1, 8, 4, 32)
    assert sum(lay["layers_per_stage"]) == 61 and len(lay["layers_per_stage"]) == 4
    more = make_plan(recipes["kimi-k2-thinking"], get_gpu("h200"), nodes=64)["layout"]
    assert (more["dp"], more["pp"]) == (2, 8)


def test_k25_engines_hold_the_vision_tower(recipes):
    """K2.5's MoonViT + projector ride along on every engine GPU (bf16, whole): counted in sglang_weights, by hand."""
    r = recipes["kimi-k2.5"]
    h, f, layers, merged = 1152, 4304, 27, 1152 * 4
    block = 4 * h + 3 * h * h + 3 * h + h * h + h + f * h + f + h * f + h
    tower = 3 * 14 * 14 * h + h + 64 * 64 * h + layers * block + 2 * h
    projector = 2 * h + merged * merged + merged + 7168 * merged + 7168
    assert r.model.vision.num_params(r.model.hidden_size) == tower + projector == 471_143_920
    with_vision = make_plan(r, get_gpu("h200"))
    without = make_plan(r.model_copy(update={"model": r.model.model_copy(update={"vision": None})}), get_gpu("h200"))
    assert with_vision["params"]["vision"] == tower + projector and without["params"]["vision"] == 0
    assert with_vision["gpu_mem_gb"]["sglang_vision_weights"] == round((tower + projector) * 2 / 2**30, 2)
    assert with_vision["gpu_mem_gb"]["sglang_weights"] - without["gpu_mem_gb"]["sglang_weights"] == \
        pytest.approx((tower + projector) * 2 / 2**30, abs=0.011)
    assert with_vision["params_total"] == without["params_total"]  # the language model's count, as published


def test_sglang_weights_too_big_for_h100(recipes):
    plan = make_plan(recipes["kimi-k2.5"], get_gpu("h100"))
    assert plan["fits"] is False and "no room for a KV cache" in plan["reason"]


def test_time_assumptions_are_used(recipes):
    r, gpu = recipes["kimi-k2.5"], get_gpu("h200")
    base = make_plan(r, gpu)["timing"]
    fast = make_plan(r, gpu, ta=TimeAssumptions(mfu=0.5, mean_response_frac=0.25, decode_tok_s=1e9, seq_tok_s=1e9))
    assert fast["timing"]["train_s"] < base["train_s"] / 2 + 1e-6
    assert fast["timing"]["rollout_tokens_per_step"] == base["rollout_tokens_per_step"] / 2
    assert fast["assumptions"]["mfu"] == 0.5 and fast["assumptions"]["decode_tok_s"] == 1e9
    pc = count_params(r.model)
    attn = 2 * 64 * (128 + 64 + 128) * (1000 / 2) * 61
    assert forward_flops_per_token(r, pc, 1000) == pytest.approx(2 * pc.active_matmul + attn)


def test_a_dynamic_global_batch_is_planned_as_the_trainer_steps_it(recipes):
    """With use_dynamic_global_batch_size the trainer takes every kept sample in one optimizer step
    (rl.batching.step_batch_size) whatever num_steps_per_rollout says: the plan's optimizer steps, CPU Adam time and
    micro-batches are those of one step over the whole rollout."""
    gpu = get_gpu("h200")
    one = make_plan(recipes["kimi-k2.5"], gpu)  # 256 samples, global batch 256, one step
    four_steps = ["rollout.global_batch_size=null", "rollout.num_steps_per_rollout=4"]
    four = make_plan(load_recipe("kimi-k2.5", four_steps), gpu)
    assert four["timing"]["optimizer_steps_per_step"] == one["timing"]["optimizer_steps_per_step"] == 1
    assert four["timing"]["optimizer_s"] == one["timing"]["optimizer_s"] > 0
    micro = "microbatches_per_step_per_dp_rank"
    assert four["assumptions"][micro] == one["assumptions"][micro]
    assert four["timing"]["passes"]["old_logprob_forward"] == 0.0  # one step: its forward is the old logprobs
    fixed = make_plan(load_recipe("kimi-k2.5", [*four_steps, "rollout.use_dynamic_global_batch_size=false"]), gpu)
    assert fixed["timing"]["optimizer_steps_per_step"] == 4
    assert fixed["timing"]["optimizer_s"] == pytest.approx(4 * one["timing"]["optimizer_s"], rel=1e-3)  # rounded


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_json_fields():
    res = _cli("kimi-k2-thinking", "--gpu", "h200", "--json")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    assert REQUIRED <= plan.keys() and GPU_FIELDS <= plan["gpu_mem_gb"].keys()
    assert plan["fits"] is True and plan["params_total"] == 1_026_408_232_448
    assert {"mfu", "decode_tok_s", "mean_response_frac"} <= plan["assumptions"].keys()


def test_cli_one_node_h100_answers_fits_false():
    res = _cli("kimi-k2-thinking", "--gpu", "h100", "--nodes", "1", "--json")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    assert plan["fits"] is False and plan["reason"]


def test_cli_impossible_ep_is_an_answer_not_a_crash():
    res = _cli("kimi-k2-thinking", "--set", "parallel.ep=5", "--json")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    assert plan["fits"] is False and "parallel.ep" in plan["reason"]


def test_cli_invalid_value_and_unknown_recipe():
    res = _cli("kimi-k2-thinking", "--set", "parallel.tp=0", "--json")
    assert res.exit_code == 0 and json.loads(res.output)["fits"] is False
    res = _cli("no-such-recipe")
    assert res.exit_code == 2 and "no preset" in res.output


def test_cli_table_and_overrides():
    res = _cli("kimi-k2.5", "--gpu", "h200", "--mfu", "0.4", "--decode-tok-s", "5000", "--mean-response-frac", "0.3")
    assert res.exit_code == 0, res.output
    assert "FITS" in res.output and "mfu: 0.4" in res.output and "decode_tok_s: 5000.0" in res.output


@pytest.mark.parametrize("name", KIMI)
def test_weight_sync_estimate_follows_the_engine_format(recipes, name):
    """The sync's model is the sync's own bucket plan at the recipe's layout: the engine's format (INT4 experts for
    Thinking / K2.5, FP8 for Instruct) copied into the engines, the bytes each GPU receives (at most the bf16 model
    once) through each group at that group's link, a bounded number of collectives (fewer than one per tensor),
    and the recipes' framework's measured 7.2 s / 53.3 s printed beside it; the disk fallback takes minutes."""
    r = recipes[name]
    ws = make_plan(r, get_gpu("h200"))["timing"]["weight_sync"]
    pc = count_params(r.model)
    per_param = ws["engine_bytes"] / pc.total
    assert per_param == pytest.approx({"kimi-k2-instruct": 1.0}.get(name, 0.59), abs=0.05)
    assert ws["buckets"] >= math.ceil(2 * pc.total / r.rollout.update_weight_buffer_size)
    assert ws["received_bytes_per_gpu"] <= 2 * pc.total  # bf16, once
    assert ws["received_bytes_per_gpu"] == pytest.approx(sum(ws["received_bytes_by_group"].values()))
    tensors = r.model.num_layers * (3 * r.model.num_experts + 16)  # about: routed expert projections + the rest
    assert ws["collectives_per_sync"] < tensors / 10
    assert ws["links_gb_s"]["tp"] > ws["links_gb_s"]["ep"]  # TP 8 inside a node, EP 32 across four
    assert ws["colocated_s"] == pytest.approx(ws["network_s"] + ws["copy_s"] + ws["bucket_overhead_s"])
    assert ws["distributed_s"] == pytest.approx(ws["distributed_gather_s"] + ws["distributed_send_s"]
                                                + ws["bucket_overhead_s"])
    assert 5 < ws["colocated_s"] < 120 < ws["disk_fallback_s"]
    res = _cli(name, "--gpu", "h200")
    text = " ".join(res.output.split())
    assert f"weight sync: {ws['colocated_s']:.1f} s colocated" in text
    assert "7.2 s RDMA P2P, 53.3 s NCCL broadcast" in text and f"{ws['collectives_per_sync']} collectives" in text


# what each engine memory tag and trainer part holds, in the plan's component names
_ENGINE_PARTS = {"weights": ("sglang_weights",), "kv_cache": ("sglang_kv_cache", "sglang_workspace"),
                 "cuda_graph": ("cuda_graphs",)}


@pytest.mark.parametrize("name", ["kimi-k2-thinking", "kimi-k2-instruct", "kimi-k2.5"])
def test_the_colocated_peak_counts_what_the_handoff_keeps_on_the_gpu(name):
    """Colocated, each phase's total is exactly what `plan.residency.RESIDENT` (the table the train loop's handoff
    runs, tests/integration/test_engine_protocol.py) keeps on the GPU then, plus activations while training, the
    sync buffer while syncing and the residual: the plan's peak is the sequence the code runs."""
    from kimi_pipeline.plan.residency import RESIDENT

    r = load_recipe(name)
    assert r.cluster.colocate and r.rollout.engine == "sglang"
    plan = make_plan(r, get_gpu("h200"))
    extra = {"train": ("activations",), "weight_sync": ("weight_sync_buffer",), "rollout": ()}
    for phase, (tags, parts) in RESIDENT.items():
        names = [n for t in tags for n in _ENGINE_PARTS[t]] + list(parts) + list(extra[phase]) + ["residual"]
        assert sorted(plan["phases_gb"][phase]) == sorted(names), phase
        assert plan["gpu_mem_gb"][f"total_{phase}"] == pytest.approx(sum(plan["phases_gb"][phase].values()), abs=0.05)
    assert plan["peak_phase"] == max(RESIDENT, key=lambda p: plan["gpu_mem_gb"][f"total_{p}"])
