"""Routing replay on one GPU: the trainer (PolicyWorker with `cluster.device=cuda`) routes with the embedded
engine's expert ids, both on CUDA. With the engine's own ids the trainer reproduces the engine's logprobs; with
other ids it does not; without ids the live router decides again. The GPU twin of
tests/integration/test_routing_replay.py (same recipe, same bounds: fp32 on both sides)."""

from __future__ import annotations

import pytest
from support.common import TINY, engine_samples, replay_diffs
from support.gpu import off_device

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def recipe():
    from kimi_pipeline.recipes import load_recipe

    return load_recipe("tiny", ["rollout.routing_replay=true", "quant.int4_qat=false", "cluster.device=cuda"])


@pytest.fixture(scope="module")
def worker(cuda, recipe):
    from kimi_pipeline.rl.policy import PolicySections, PolicyWorker

    w = PolicyWorker(PolicySections.of(recipe))
    assert w.device == cuda  # resolved from cluster.device, not from what torch happens to see
    assert w.load("/nonexistent-checkpoints", str(TINY / "model")) is None  # fresh start, bridge load
    assert off_device(w.model[0], cuda) == []
    yield w
    w.close()


def test_replayed_routing_reproduces_engine_logprobs_and_drives_the_routers_on_the_gpu(worker, cuda, recipe):
    samples = engine_samples(recipe, cuda)
    assert all(s.routed_experts.shape[1:] == (3, 4) for s in samples)  # 3 MoE layers, top-4
    d = replay_diffs(worker, samples)
    assert d["replayed"] < 1e-3, d  # the engine's own ids: the engine's logprobs
    assert d["moved"] > 1e-2, d  # other ids: replay drives the routers
    assert d["live"] < 1e-3, d  # no ids: the live router decides again
