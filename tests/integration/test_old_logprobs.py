"""Old logprobs without a forward of their own for the first optimizer step of a rollout (rl/policy.py
`PolicyWorker.train`): until that step's update the weights are the ones the rollout sampled, so its micro-batches
take their training forward's logprobs, detached, and only the later steps' micro-batches get the no-grad forward
before the first update. At one step per rollout (kimi-k2.5) that is one forward of the rollout's tokens per rollout.
"""

from __future__ import annotations

import pytest
import torch
from support.common import TINY, graded_share


@pytest.fixture(scope="module")
def recipe():
    from kimi_pipeline.recipes import load_recipe

    # 8 samples in 2 optimizer steps; routing compared with the engine's (tiny's own setting, replay off)
    return load_recipe("tiny", ["rollout.num_steps_per_rollout=2", "rollout.routing_replay=false",
                                "rollout.routing_agreement=true", "quant.int4_qat=false"])


def test_the_first_step_reuses_its_training_forward_which_is_the_no_grad_forward(recipe):
    """Exact, not an approximation: at the rollout's weights the no-grad forward's logprobs of the first step's
    micro-batches equal those of their training forward (measured: bit for bit on CPU, and a tiny run's metrics.jsonl
    identical on every non-timing key to the separate forward's). `train` then runs the first step's micro-batches
    once and the later steps' twice, and still compares every micro-batch's routing with the engine's."""
    from kimi_pipeline.model.context_parallel import batch_logprobs
    from kimi_pipeline.model.megatron_train import forward_backward
    from kimi_pipeline.rl.policy import PolicySections, PolicyWorker

    temperature = recipe.rollout.temperature or 1.0
    w = PolicyWorker(PolicySections.of(recipe))
    try:
        assert w.load("/nonexistent-checkpoints", str(TINY / "model")) is None  # fresh start
        share = graded_share(recipe, n_prompts=4, n=2)
        steps = [[w._collate(share.samples, mb) for mb in st] for st in share.steps]
        first, micro_batches = steps[0], sum(len(st) for st in steps)
        assert len(steps) == 2 and micro_batches > len(first) > 0

        no_grad = w._logprobs(w.model, first)
        trained: list[torch.Tensor] = []

        def keep(logits, batch):
            lp, _ = batch_logprobs(logits, batch, temperature=temperature)
            trained.append(lp.detach() * batch["mask"])
            return lp.sum() * 0.0, 1, {}

        forward_backward(w.model, [{"tokens": mb.tokens, "targets": mb.targets, "lengths": mb.lengths,
                                    "mask": mb.mask} for mb in first], keep, optimizer=w.optimizer)
        assert len(trained) == len(no_grad) == len(first)
        assert max(float((a - b).abs().max()) for a, b in zip(no_grad, trained)) <= 1e-6  # measured: 0.0

        forwards: list[int] = []
        handle = w.model[0].register_forward_hook(lambda *_: forwards.append(1))
        try:
            metrics = w.train(share, 0)
        finally:
            handle.remove()
    finally:
        w.close()
    assert len(forwards) == micro_batches + (micro_batches - len(first)), (len(forwards), micro_batches, len(first))
    assert metrics["optimizer_steps"] == 2
    assert metrics["routing_agreement"] == 1.0, metrics  # the engine's own routing, first step's forward included
