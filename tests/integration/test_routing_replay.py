"""Routing replay: the trainer's routers use the rollout engine's expert ids (probabilities from the live
router). With the engine's own ids the trainer reproduces the engine's logprobs; with other ids it does not —
so the ids really drive the megatron forward. Also covers bridge-mode loading (HF weights straight into
megatron, each rank reading its own slice)."""

from __future__ import annotations

import pytest

from support.common import TINY, engine_samples, replay_diffs


@pytest.fixture(scope="module")
def recipe():
    from kimi_pipeline.recipes import load_recipe

    return load_recipe("tiny", ["rollout.routing_replay=true", "quant.int4_qat=false"])


@pytest.fixture(scope="module")
def worker(recipe):
    from kimi_pipeline.rl.policy import PolicyWorker, policy_sections

    w = PolicyWorker(**policy_sections(recipe))
    assert w.load("/nonexistent-checkpoints", str(TINY / "model")) is None  # fresh start, bridge load
    yield w
    w.close()


def test_replayed_routing_reproduces_engine_logprobs_and_drives_the_routers(worker, recipe):
    samples = engine_samples(recipe)
    assert all(s.routed_experts.shape[1:] == (3, 4) for s in samples)  # 3 MoE layers, top-4
    d = replay_diffs(worker, samples)
    assert d["replayed"] < 1e-3, d  # the engine's own ids: the engine's logprobs
    assert d["moved"] > 1e-2, d  # other ids: replay drives the routers
    assert d["live"] < 1e-3, d  # no ids: the live router decides again