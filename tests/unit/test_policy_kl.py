"""The KL term: a reference model is built only when the KL coefficient is > 0, and then the trainer
reports a KL that starts at 0 (policy = reference) and moves once the policy has been updated."""

from __future__ import annotations

from support.common import TINY, engine_samples


def test_reference_model_only_with_a_kl_coefficient():
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.rl.grpo import group_advantages
    from kimi_pipeline.rl.policy import PolicyWorker
    from kimi_pipeline.rl.samples import share_rollout

    import torch

    recipe = load_recipe("tiny", ["grpo.use_kl_loss=true", "grpo.kl_loss_coef=0.01", "quant.int4_qat=false",
                                  "rollout.num_steps_per_rollout=2", "rollout.rollout_batch_size=4",
                                  "rollout.n_samples_per_prompt=4"])  # 16 samples = 2 global batches of 8
    w = PolicyWorker(recipe)
    try:
        w.load("/nonexistent-checkpoints", str(TINY / "model"))
        assert w.ref_model is not None
        samples = engine_samples(recipe, n_prompts=4, n=4)
        rewards = torch.tensor([float(i % 2) for i in range(len(samples))])
        for s, a, r in zip(samples, group_advantages(rewards, 4).tolist(), rewards.tolist()):
            s.advantage, s.reward = a, r
        (share,), _ = share_rollout(samples, recipe)  # one DP rank: the whole rollout
        first = w.train(share, 0)
        assert "kl" in first and first["optimizer_steps"] == 2
        second = w.train(share, 1)  # the policy has moved away from the reference by now
        assert second["kl"] > first["kl"] >= 0.0
    finally:
        w.close()
    w0 = PolicyWorker(load_recipe("tiny", ["quant.int4_qat=false"]))
    try:
        w0.load("/nonexistent-checkpoints", str(TINY / "model"))
        assert w0.ref_model is None
    finally:
        w0.close()
