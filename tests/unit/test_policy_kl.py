"""The KL term: a reference model is built only when the KL coefficient is > 0, and then the trainer
reports a KL that starts at 0 (policy = reference) and, once the policy has been updated, is the low_var_kl
estimate of KL(policy || reference): per token e^d - 1 - d with d = clamp(logp_ref - logp, +-20), clamped to
[-10, 10], averaged over each sample's response tokens, then over samples."""

from __future__ import annotations

import math

import pytest
from support.common import TINY, graded_share


def _low_var_kl(policy: list[list[float]], ref: list[list[float]]) -> float:
    """The reference formula, written out here (not the trainer's code)."""
    per_sample = []
    for lp, rp in zip(policy, ref):
        assert len(lp) == len(rp) > 0
        ks = []
        for a, b in zip(lp, rp):
            d = min(20.0, max(-20.0, b - a))
            ks.append(min(10.0, max(-10.0, math.exp(d) - 1.0 - d)))
        per_sample.append(sum(ks) / len(ks))
    return sum(per_sample) / len(per_sample)


def test_reference_model_only_with_a_kl_coefficient():
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.rl.policy import PolicySections, PolicyWorker

    recipe = load_recipe("tiny", ["grpo.use_kl_loss=true", "grpo.kl_loss_coef=0.01", "quant.int4_qat=false",
                                  "rollout.num_steps_per_rollout=1", "rollout.rollout_batch_size=4",
                                  "rollout.n_samples_per_prompt=4"])  # 16 samples = 1 global batch
    w = PolicyWorker(PolicySections.of(recipe))
    try:
        w.load("/nonexistent-checkpoints", str(TINY / "model"))
        assert w.ref_model is not None
        share = graded_share(recipe)  # one DP rank: the whole rollout
        samples = share.samples
        first = w.train(share, 0)  # its loss is computed before the update: policy = reference
        assert first["optimizer_steps"] == 1
        assert first["kl"] == pytest.approx(0.0, abs=1e-9)
        # after one update: the KL of the policy now against the reference, from the formula
        expected = _low_var_kl(w._token_logprobs(w.model, samples), w._token_logprobs([w.ref_model], samples))
        assert expected > 1e-6, "the update did not move the policy"
        second = w.train(share, 1)  # reported on the forward before its own update: the policy of `expected`
        assert second["kl"] == pytest.approx(expected, rel=1e-4)
    finally:
        w.close()
    w0 = PolicyWorker(PolicySections.of(load_recipe("tiny", ["quant.int4_qat=false"])))
    try:
        w0.load("/nonexistent-checkpoints", str(TINY / "model"))
        assert w0.ref_model is None
    finally:
        w0.close()
