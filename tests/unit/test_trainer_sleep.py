"""Colocated, the trainer sleeps while the engines generate (`model/offload.py`, `PolicyWorker.sleep / wake`): its
parameters, DDP buffers, optimizer state and reference model leave the device (storages resized to zero) and come
back byte for byte, so a trainer that slept between two steps trains exactly as one that did not."""

from __future__ import annotations

import pytest
import torch
from support.common import TIMING, TINY, graded_share

from kimi_pipeline.model.offload import PARTS


def _share(recipe):
    return graded_share(recipe, reward=lambda i: float(i % 3 == 0))


def _two_steps(recipe, share, sleep_between: bool):
    from kimi_pipeline.rl.policy import PolicySections, PolicyWorker

    w = PolicyWorker(PolicySections.of(recipe))
    try:
        w.load("/nonexistent-checkpoints", str(TINY / "model"))
        w.train(share, 0)
        if sleep_between:
            state = w._state()
            before = {p: [t.detach().clone() for t in state[p]] for p in ("weights", "optimizer")}
            storages = {p: {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in state[p]} for p in PARTS}
            assert all(storages.values())  # every part holds memory: params, grad buffers, Adam state, ref model
            total = sum({k: v for p in PARTS for k, v in storages[p].items()}.values())  # each storage once
            freed = w.sleep(["grads", "optimizer"])["offloaded_gb"] + w.sleep(["weights"])["offloaded_gb"]
            assert w.asleep() == PARTS
            assert all(t.untyped_storage().nbytes() == 0 for p in PARTS for t in state[p])  # really freed
            assert round(freed * 2**30) == total
            with pytest.raises(RuntimeError, match="asleep"):
                w.train(share, 1)
            w.wake(list(PARTS))
            for p, tensors in before.items():
                assert all(torch.equal(a, b) for a, b in zip(w._state()[p], tensors)), p
            assert all(not t.any() for t in w._state()["grads"])  # grads come back zeroed, as each step starts
        metrics = w.train(share, 1)
        params = [p.detach().clone() for p in w.model[0].parameters()]
    finally:
        w.close()
    return {k: v for k, v in metrics.items() if k not in TIMING}, params


def test_a_trainer_that_slept_between_steps_trains_as_one_that_did_not():
    from kimi_pipeline.recipes import load_recipe

    recipe = load_recipe("tiny", ["grpo.use_kl_loss=true", "grpo.kl_loss_coef=0.01",  # a reference model too
                                  "rollout.num_steps_per_rollout=1", "rollout.rollout_batch_size=4",
                                  "rollout.n_samples_per_prompt=4"])
    share = _share(recipe)
    slept, slept_params = _two_steps(recipe, share, sleep_between=True)
    awake, awake_params = _two_steps(recipe, share, sleep_between=False)
    assert slept == awake
    assert all(torch.equal(a, b) for a, b in zip(slept_params, awake_params))
