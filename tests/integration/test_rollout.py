"""One rollout through the real HTTP engine: samples, rewards, group advantages and dynamic sampling."""

from __future__ import annotations

import pytest

from support.common import TINY, tiny_correct


@pytest.fixture(scope="module")
def engine_url():
    from kimi_pipeline.engine.model import EngineModel
    from kimi_pipeline.engine.rollout_engine import RolloutEngine
    from kimi_pipeline.engine.server import EngineServer

    with EngineServer(RolloutEngine(EngineModel.from_pretrained(TINY / "model"), seed=0)) as server:
        yield server.url


def _rollout(url: str, sets: list[str], step: int = 0):
    from kimi_pipeline.engine.client import Router
    from kimi_pipeline.model.tokenizer import load_tokenizer
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.reward import AnswerGrader
    from kimi_pipeline.rl.prompts import PromptStream, load_prompts
    from kimi_pipeline.rl.rollout import collect_rollout

    recipe = load_recipe("tiny", ["rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4", *sets])
    tok = load_tokenizer(TINY / "model")
    stream = PromptStream(load_prompts(TINY / "dapo-math-tiny.jsonl", tok), seed=1)
    with Router([url]) as client, AnswerGrader("math") as rm:
        samples, metrics = collect_rollout(client, tok, rm, stream, recipe.rollout, recipe.grpo.advantage_estimator, step)
    return recipe, stream, samples, metrics


def test_rollout_samples_rewards_and_advantages(engine_url):
    recipe, stream, samples, m = _rollout(engine_url, ["rollout.dynamic_sampling=false"])
    assert len(samples) == 32 and stream.state() == {"epoch": 0, "index": 8}
    for g in range(8):
        group = [s for s in samples if s.group == g]
        assert len(group) == 4 and len({tuple(s.prompt_ids) for s in group}) == 1
        rewards = [s.reward for s in group]
        if len(set(rewards)) == 1:
            assert all(s.advantage == 0.0 for s in group)
        else:  # correct answers pushed up, wrong ones down
            assert all((s.advantage > 0) == (s.reward > 0.5) for s in group)
    for s in samples:
        assert len(s.rollout_logprobs) == len(s.response_ids) and all(lp <= 0 for lp in s.rollout_logprobs)
    # each reward is the grade of its own response against its prompt's label (graded here, independently)
    label_of = {tuple(p.ids): p.label for p in stream.prompts}
    assert all(s.label == label_of[tuple(s.prompt_ids)] for s in samples)
    expected = [1.0 if tiny_correct(s.response_text, s.label) else 0.0 for s in samples]
    assert [s.reward for s in samples] == expected, [(s.response_text, s.label, s.reward) for s in samples]
    assert 0 < sum(expected) < len(expected), "the tiny policy solves some prompts, not all: nothing was checked"
    assert m["samples"] == 32 and m["reward_mean"] == pytest.approx(sum(expected) / 32)
    assert m["solved_group_fraction"] == pytest.approx(sum(max(expected[g * 4:(g + 1) * 4]) for g in range(8)) / 8)
    assert m["rollout_tokens_per_s"] > 0
    # same seed and step: the same rollout (resume relies on it)
    again = _rollout(engine_url, ["rollout.dynamic_sampling=false"])[2]
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]


def test_dynamic_sampling_keeps_only_groups_with_signal(engine_url):
    _, stream, samples, m = _rollout(engine_url, ["rollout.dynamic_sampling=true",
                                                  "rollout.over_sampling_batch_size=16"])
    assert m["dynamic_draws"] >= 1 and m["dynamic_kept_groups"] >= 1
    groups = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s.reward)
    assert all(len(set(r)) > 1 for r in groups.values()), groups  # zero-variance groups were dropped
    # reward_mean is the policy's (every sample drawn), not the filtered batch's (biased towards 0.5)
    assert m["samples_drawn"] == m["dynamic_draws"] * 16 * 4 and m["samples"] == len(samples)
    assert m["reward_trained_mean"] == pytest.approx(sum(s.reward for s in samples) / len(samples))
    assert len(groups) <= 8 and stream.state()["index"] >= 8 * m["dynamic_draws"]
