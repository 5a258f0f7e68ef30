"""Routing replay: the trainer's routers use the rollout engine's expert ids (probabilities from the live
router). With the engine's own ids the trainer reproduces the engine's logprobs; with other ids it does not —
so the ids really drive the megatron forward. Also covers bridge-mode loading (HF weights straight into
megatron, each rank reading its own slice)."""

from __future__ import annotations

import pytest

from support.common import TINY, engine_samples


@pytest.fixture(scope="module")
def worker():
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.rl.policy import PolicyWorker

    recipe = load_recipe("tiny", ["rollout.routing_replay=true", "quant.int4_qat=false"])
    w = PolicyWorker(recipe)
    assert w.load("/nonexistent-checkpoints", str(TINY / "model")) is None  # fresh start, bridge load
    yield w
    w.close()


def test_replayed_routing_reproduces_engine_logprobs(worker):
    samples = engine_samples(worker.recipe)
    assert all(s.routed_experts.shape[1:] == (3, 4) for s in samples)  # 3 MoE layers, top-4
    trainer = worker._token_logprobs(worker.model, samples)
    for s, lp in zip(samples, trainer):
        assert max(abs(a - b) for a, b in zip(lp, s.rollout_logprobs)) < 1e-3


def test_other_expert_ids_change_the_trainer_forward(worker):
    import numpy as np

    samples = engine_samples(worker.recipe)
    base = worker._token_logprobs(worker.model, samples)
    experts = worker.recipe.model.num_experts
    for s in samples:
        s.routed_experts = ((s.routed_experts.astype(np.int64) + 5) % experts).astype(np.int16)
    moved = worker._token_logprobs(worker.model, samples)
    diff = max(abs(a - b) for x, y in zip(base, moved) for a, b in zip(x, y))
    assert diff > 1e-2, diff  # replay drives the routers
    # and without replay ids the live router decides again
    for s in samples:
        s.routed_experts = None
    live = worker._token_logprobs(worker.model, samples)
    assert max(abs(a - b) for x, y in zip(base, live) for a, b in zip(x, y)) < 1e-3


@pytest.mark.slow
def test_replay_ids_follow_the_sequence_parallel_token_slices(tmp_path):
    """Issue 14 item 10: under TP 2 with sequence parallelism (EP 2, ETP 1 as in the seeds) each rank's routers
    see half of the tokens;
    the replayed ids must be that half (they were the whole sequence: a shape error or wrong experts)."""
    from support.megatron_worker import launch

    from kimi_pipeline.recipes import load_recipe

    samples = engine_samples(load_recipe("tiny", ["rollout.routing_replay=true"]), n_prompts=2, n=2)
    payload = [{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "rollout_logprobs": s.rollout_logprobs,
                "routed_experts": s.routed_experts.tolist()} for s in samples]
    ranks = launch("replay", 2, tmp_path, {"tp": 2, "sp": True, "ep": 2, "samples": payload, "model": str(TINY / "model")})
    assert ranks[0]["logprobs"] == ranks[1]["logprobs"]
    for s, lp in zip(samples, ranks[0]["logprobs"]):
        assert len(lp) == len(s.rollout_logprobs)
        assert max(abs(a - b) for a, b in zip(lp, s.rollout_logprobs)) < 1e-3
