"""Saved rollouts (`rl/rollout_data.py`): every number the trainer reads comes back exactly; a missing, cut or foreign
rollout is refused naming the file and the fix."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kimi_pipeline.rl.rollout_data import RolloutDataError, check_fits, load_rollout, save_rollout
from kimi_pipeline.rl.samples import Sample


def _samples(routed: bool = True, n: int = 6) -> list[Sample]:
    rng = random.Random(3)
    out = []
    for i in range(n):
        p, r = rng.randint(1, 9), rng.randint(0, 7)  # an empty response too
        out.append(Sample(prompt_ids=[rng.randrange(384) for _ in range(p)], response_ids=[rng.randrange(384) for _ in range(r)],
                          rollout_logprobs=[-rng.random() / 3 for _ in range(r)], label=f"{i}", group=i // 2,
                          reward=float(i % 2), advantage=rng.gauss(0, 1) / 7, finish_reason="length" if i == 3 else "stop",
                          response_text=f"answer é {i}",
                          routed_experts=np.array(np.random.default_rng(i).integers(0, 16, (p + r - 1, 3, 4)), np.int16)
                          if routed else None))
    return out


def test_a_saved_rollout_comes_back_exactly(tmp_path):
    samples, metrics = _samples(), {"reward_mean": 0.5, "samples": 6.0}
    save_rollout(tmp_path, 3, samples, metrics)
    got, got_metrics = load_rollout(tmp_path, 3)
    assert got_metrics == metrics
    for a, b in zip(got, samples):
        assert (a.prompt_ids, a.response_ids, a.rollout_logprobs, a.label, a.group, a.reward, a.advantage,
                a.finish_reason, a.response_text) == \
               (b.prompt_ids, b.response_ids, b.rollout_logprobs, b.label, b.group, b.reward, b.advantage,
                b.finish_reason, b.response_text)  # floats bit for bit (float64)
        assert a.routed_experts.dtype == np.int16 and np.array_equal(a.routed_experts, b.routed_experts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000003.json", "step_0000003.safetensors"]


def test_missing_cut_and_foreign_rollouts_are_refused_naming_the_file(tmp_path):
    save_rollout(tmp_path, 1, _samples(routed=False), {})
    with pytest.raises(RolloutDataError, match=r"step_0000002\.json: no saved rollout for step 2 \(saved: step_0000001\)"
                                                r".*rollout.save_data=true"):
        load_rollout(tmp_path, 2)
    data = tmp_path / "step_0000001.safetensors"
    data.write_bytes(data.read_bytes()[:-20])
    with pytest.raises(RolloutDataError, match=r"step_0000001\.safetensors: unreadable saved rollout"):
        load_rollout(tmp_path, 1)
    save_rollout(tmp_path, 1, _samples(routed=False), {})
    meta = tmp_path / "step_0000001.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "step": 7}))
    with pytest.raises(RolloutDataError, match="format 1 step 7, expected format 1 step 1"):
        load_rollout(tmp_path, 1)


def test_a_rollout_the_recipe_cannot_train_on_is_refused(tmp_path):
    path = tmp_path / "step_0000001.safetensors"
    check_fits(_samples(), path, 384, True, 3, 4)
    with pytest.raises(RolloutDataError, match=r"step_0000001.safetensors: token id 3\d\d is outside model.vocab_size=300"):
        check_fits(_samples(), path, 300, False, 3, 4)
    with pytest.raises(RolloutDataError, match="no routed experts saved, but rollout.routing_replay=true"):
        check_fits(_samples(routed=False), path, 384, True, 3, 4)
    with pytest.raises(RolloutDataError, match=r"routed experts of \(3, 4\).*the model has \(2, 4\)"):
        check_fits(_samples(), path, 384, True, 2, 4)
