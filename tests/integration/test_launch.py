"""The launch plan of the seeds' 32 × 8 layouts (issue 14 items 1, 2, 8): what the train stage asks Ray for.

Pure planning, no Ray: the Ray-side rehearsal (placement groups + stand-in actors on simulated nodes) is
tests/integration/test_rehearse.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

from kimi_pipeline.cluster.placement import COLOCATED_ENGINE_FRACTION, COLOCATED_TRAINER_FRACTION
from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.rl.actor_layout import lay_out_actors

CPU = torch.device("cpu")

KIMI = ("kimi-k2-instruct", "kimi-k2-thinking", "kimi-k2.5")


@pytest.mark.parametrize("name", KIMI)
def test_seed_layouts_request_exactly_their_256_gpus(name):
    recipe = load_recipe(name)
    plan = lay_out_actors(recipe)
    assert plan.ok, plan.problems
    assert plan.gpus_requested == 256 and len(plan.ranks) == 256
    # what the actors ask of each node's bundle: trainer shares + engine shares must fit its 8 GPUs
    # (main asked 1 whole GPU per trainer rank plus gpus_per_engine per engine: 512 GPUs, Ray waits forever)
    per_node = defaultdict(float)
    for r in plan.ranks:
        per_node[r.node] += plan.placement.trainer_actor["GPU"]
    for e in plan.engines:
        for n in e.nodes:
            per_node[n.node] += plan.placement.engine_actor["GPU"]
    assert len(per_node) == 32 and max(per_node.values()) <= 8
    assert plan.placement.trainer_actor["GPU"] == COLOCATED_TRAINER_FRACTION
    assert plan.placement.engine_actor["GPU"] == COLOCATED_ENGINE_FRACTION


@pytest.mark.parametrize("name", KIMI)
def test_ranks_groups_and_engines_land_where_megatron_and_sglang_expect(name):
    recipe = load_recipe(name)
    plan = lay_out_actors(recipe)
    p, per = recipe.parallel, recipe.cluster.gpus_per_node
    assert plan.ranks[0].node == plan.master_addr_node == 0  # MASTER_ADDR is rank 0's node
    for r in plan.ranks:
        assert r.node == r.rank // per and r.gpus == (r.rank % per,)
    tp_groups = defaultdict(set)
    for r in plan.ranks:  # megatron's coordinates: every (pp, cp, dp) slice holds a full TP group on one node
        tp_groups[(r.pp, r.cp, r.dp)].add(r.node)
        assert 0 <= r.tp < p.tp and 0 <= r.pp < p.pp and 0 <= r.cp < p.cp and 0 <= r.ep < p.ep
    assert all(len(nodes) == 1 for nodes in tp_groups.values())
    assert len({(r.tp, r.pp, r.cp, r.dp) for r in plan.ranks}) == 256
    g = recipe.sglang.gpus_per_engine
    assert len(plan.engines) == 256 // g
    for e in plan.engines:  # colocated: engine e runs on exactly the GPUs of ranks [e*g, (e+1)*g)
        want = sorted((plan.ranks[r].node, plan.ranks[r].gpus[0]) for r in range(e.id * g, (e.id + 1) * g))
        assert sorted((n.node, gpu) for n in e.nodes for gpu in n.gpus) == want
        for j, n in enumerate(e.nodes):
            cmd = " ".join(n.command)
            assert f"--tp-size {g}" in cmd and f"--ep-size {recipe.sglang.ep_size}" in cmd
            assert f"--base-gpu-id {n.base_gpu_id}" in cmd and "--enable-memory-saver" in cmd  # colocated
            assert (f"--attn-dp-size {recipe.sglang.dp_size}" in cmd) == recipe.sglang.enable_dp_attention
            assert ("--enable-return-routed-experts" in cmd) == recipe.rollout.routing_replay
            if g > per:  # an engine across nodes: SGLang's multi-node flags, node 0 hosts the rendezvous
                assert f"--nnodes {g // per} --node-rank {j} --dist-init-addr" in cmd
                assert f"<node {e.nodes[0].node} ip>" in cmd
    assert plan.env["NCCL_TIMEOUT"] == "3600" and plan.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # seed 001


def test_trust_remote_code_reaches_the_sglang_command_only_when_the_recipe_opts_in():
    plain = lay_out_actors(load_recipe("kimi-k2-thinking", ["hub.trust_remote_code=false"]))
    opted = lay_out_actors(load_recipe("kimi-k2-thinking"))  # the preset opts in, at a pinned commit
    assert all("--trust-remote-code" not in n.command for e in plain.engines for n in e.nodes)
    assert all("--trust-remote-code" in n.command for e in opted.engines for n in e.nodes)


def test_k2_engines_span_two_nodes_and_k25_engines_one():
    assert {len(e.nodes) for e in lay_out_actors(load_recipe("kimi-k2-instruct")).engines} == {2}
    assert {len(e.nodes) for e in lay_out_actors(load_recipe("kimi-k2.5")).engines} == {1}


def test_plan_problems_name_their_field():
    plan = lay_out_actors(load_recipe("kimi-k2-instruct", ["cluster.gpus_per_node=4", "cluster.nodes=64"], check=False))
    assert not plan.ok
    assert "parallel.tp" in {p.field for p in plan.problems}  # TP 8 cannot stay inside a 4-GPU node


def test_rehearse_refuses_an_oversubscribed_recipe_naming_the_field(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kimi_pipeline.cli", "rehearse", "kimi-k2-instruct",
                          "--set", "sglang.gpus_per_engine=24", "--out", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    d = json.loads((tmp_path / "kimi-k2-instruct" / "launch-plan.json").read_text())
    assert d["ok"] is False and "sglang.gpus_per_engine" in {p["field"] for p in d["problems"]}
    assert "sglang.gpus_per_engine" in (tmp_path / "kimi-k2-instruct" / "launch-plan.md").read_text()


def test_recompute_and_dispatcher_fields_reach_the_megatron_config():
    """Issue 14 item 6/8: the recompute fields (which `kimi plan` credits) and the dispatcher field are read."""
    from kimi_pipeline.model.megatron_model import transformer_config
    from kimi_pipeline.recipes.layout import Layout
    from kimi_pipeline.rl.policy import trainer_config_overrides

    r = load_recipe("tiny", ["parallel.recompute_granularity=full", "parallel.recompute_method=uniform",
                             "parallel.recompute_num_layers=1", "parallel.moe_token_dispatcher_type=flex"])
    config = transformer_config(r.model, Layout.from_parallel(r.parallel, 1), device=CPU, use_te=False,
                                **trainer_config_overrides(r.parallel, r.rollout.routing_replay, CPU))
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "uniform", 1)
    assert config.moe_token_dispatcher_type == "alltoall"  # flex needs DeepEP on a GPU and TP x EP > 1: not here
    assert load_recipe("kimi-k2-instruct").parallel.moe_token_dispatcher_type == "flex"  # seed 000


def test_remote_code_needs_a_pinned_revision():
    """Issue 14 item 7 / the security rule: trust_remote_code only with a commit SHA, never a moving branch."""
    import re

    from kimi_pipeline.recipes import RecipeError

    sha = "0123456789abcdef" * 2 + "01234567"
    # remote code from a moving branch, or from anything that is not 40 hex digits (a 40-character branch name too)
    for revision in ("main", "v1.0", "g" * 40, "main-" + "a" * 35, sha[:39], sha + "0"):
        with pytest.raises(RecipeError, match="hub.model.revision"):
            load_recipe("kimi-k2-thinking", [f"hub.model.revision={revision}"])
    assert load_recipe("kimi-k2-thinking", [f"hub.model.revision={sha}"]).hub.model.revision == sha
    for name in ("kimi-k2-instruct", "kimi-k2-thinking", "kimi-k2.5"):  # on in the presets, each pinned
        hub = load_recipe(name).hub
        assert hub.trust_remote_code and re.fullmatch(r"[0-9a-f]{40}", hub.model.revision), name
    assert not load_recipe("tiny").hub.trust_remote_code  # off by default
    load_recipe("tiny", ["hub.trust_remote_code=true"])  # a local model directory: no revision to pin
