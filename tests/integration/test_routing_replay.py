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
    from kimi_pipeline.rl.policy import PolicySections, PolicyWorker

    w = PolicyWorker(PolicySections.of(recipe))
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

def test_routing_agreement_is_the_share_of_response_routing_the_trainer_shares_with_the_engine(worker, recipe):
    """Issue 43 item 1: with replay off (`rollout.routing_agreement`), the trainer records its own top-k in the
    old-logprob forward (megatron's RouterReplay RECORD action) and counts the (response token, MoE layer) pairs
    whose expert set is the engine's: all of them for the engine's own ids (same fp32 weights), none for ids
    shifted by 5 (no 4-of-16 set is its own shift). Off, or with replay on, nothing is measured."""
    import numpy as np

    from kimi_pipeline.rl.batching import split_micro_batches
    from kimi_pipeline.rl.samples import collate

    samples = engine_samples(recipe)

    def measured() -> dict:
        split = split_micro_batches([s.num_tokens for s in samples], worker.parallel.max_tokens_per_gpu, 1)
        mbs = [collate([samples[i] for i in mb], mb, pad_id=0).to(worker.device) for mb in split.ranks[0] if mb]
        tally = worker._routing_tally(mbs)  # as `PolicyWorker.train` compares the old-logprob forward
        with worker._compare_routes(mbs, tally):
            worker._logprobs(worker.model, mbs)
        return {} if tally is None else {k: float(v.value) for k, v in tally.metrics().items()}

    assert measured() == {}  # replay on: replayed routing agrees by construction
    worker.rollout.routing_replay, worker.rollout.routing_agreement = False, True
    try:
        own = measured()["routing_agreement"]
        for s in samples:
            s.routed_experts = ((s.routed_experts.astype(np.int64) + 5) % worker.spec.num_experts).astype(np.int16)
        shifted = measured()["routing_agreement"]
        worker.rollout.routing_agreement = False
        assert measured() == {}
    finally:
        worker.rollout.routing_replay, worker.rollout.routing_agreement = True, False
    assert own == 1.0 and shifted == 0.0, (own, shifted)


def test_a_worker_never_saves_non_finite_weights(worker, tmp_path):
    """Issue 43 item 2: with `health.nonfinite` on (the default) a checkpoint save refuses NaN/inf weights on every
    rank (one flag all-reduced) and writes nothing; the weight is put back after."""
    import torch

    from kimi_pipeline.model.megatron_model import unwrap
    from kimi_pipeline.model.megatron_train import NonFiniteError

    param = next(unwrap(worker.model).parameters())
    kept = param.detach().clone()
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    try:
        with pytest.raises(NonFiniteError, match="NaN or inf"):
            worker.save(str(tmp_path / "checkpoints"), 1, {"step": 1})
    finally:
        with torch.no_grad():
            param.copy_(kept)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
