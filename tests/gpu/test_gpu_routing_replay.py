"""Routing replay on one GPU: the trainer (PolicyWorker with `cluster.device=cuda`) routes with the embedded
engine's expert ids, both on CUDA. With the engine's own ids the trainer reproduces the engine's logprobs; with
other ids it does not; without ids the live router decides again. The GPU twin of
tests/integration/test_routing_replay.py (same recipe, same bounds: fp32 on both sides)."""

from __future__ import annotations

import pytest

from support.common import TINY
from support.gpu import engine_samples, off_device

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def worker(cuda):
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.rl.policy import PolicyWorker

    recipe = load_recipe("tiny", ["rollout.routing_replay=true", "quant.int4_qat=false", "cluster.device=cuda"])
    w = PolicyWorker(recipe)
    assert w.device == cuda  # resolved from cluster.device, not from what torch happens to see
    assert w.load("/nonexistent-checkpoints", str(TINY / "model")) is None  # fresh start, bridge load
    assert off_device(w.model[0], cuda) == []
    yield w
    w.close()


def test_replayed_routing_reproduces_engine_logprobs_on_the_gpu(worker, cuda):
    samples = engine_samples(worker.recipe, cuda)
    assert all(s.routed_experts.shape[1:] == (3, 4) for s in samples)  # 3 MoE layers, top-4
    trainer = worker._token_logprobs(worker.model, samples)
    for s, lp in zip(samples, trainer):
        assert len(lp) == len(s.rollout_logprobs)
        assert max(abs(a - b) for a, b in zip(lp, s.rollout_logprobs)) < 1e-3


def test_other_expert_ids_change_the_trainer_forward_on_the_gpu(worker, cuda):
    import numpy as np

    samples = engine_samples(worker.recipe, cuda)
    base = worker._token_logprobs(worker.model, samples)
    experts = worker.recipe.model.num_experts
    for s in samples:
        s.routed_experts = ((s.routed_experts.astype(np.int64) + 5) % experts).astype(np.int16)
    moved = worker._token_logprobs(worker.model, samples)
    diff = max(abs(a - b) for x, y in zip(base, moved) for a, b in zip(x, y))
    assert diff > 1e-2, diff  # replay drives the routers
    for s in samples:
        s.routed_experts = None
    live = worker._token_logprobs(worker.model, samples)
    assert max(abs(a - b) for x, y in zip(base, live) for a, b in zip(x, y)) < 1e-3
