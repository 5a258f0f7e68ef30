"""Issue 14 item 9: a rollout is split into optimizer steps of `global_batch_size` samples and, within a step,
over data-parallel ranks (balanced by tokens with equal counts when `balance_data`), so each rank computes
logprobs and gradients for its own samples only; every rank runs the same number of micro-batches."""

from __future__ import annotations

import random

import pytest

from kimi_pipeline.recipes import load_recipe
from kimi_pipeline.rl.batching import equal_size_partition, split_rollout, step_batch_size
from kimi_pipeline.rl.samples import Sample, share_rollout


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(20, 400) for _ in range(n)]


def test_steps_are_rollout_samples_over_the_global_batch_and_each_sample_trains_once():
    lengths = _lengths(256)
    split = split_rollout(lengths, dp_size=8, global_batch_size=64, balance=True, max_tokens_per_gpu=1024)
    assert len(split.steps) == 4 and split.trimmed == []
    for k, step in enumerate(split.steps):
        got = sorted(i for rank in step for mb in rank for i in mb)
        assert got == list(range(64 * k, 64 * (k + 1)))  # consecutive global batches
        assert len({len(rank) for rank in step}) == 1  # same micro-batch count on every DP rank
        assert {sum(len(mb) for mb in rank) for rank in step} == {8}  # equal samples per rank
        for rank in step:
            assert all(len(mb) <= 1 or sum(lengths[i] for i in mb) <= 1024 for mb in rank)
    assert sorted(i for r in range(8) for i in split.rank_samples(r)) == list(range(256))


def test_balance_data_evens_tokens_and_strided_does_not_try():
    lengths = [400] * 8 + [20] * 8  # long samples first: strided puts all of them on rank 0 and 1
    bal = split_rollout(lengths, dp_size=4, global_batch_size=16, balance=True)
    plain = split_rollout(lengths, dp_size=4, global_batch_size=16, balance=False)
    tokens = lambda s: [sum(lengths[i] for mb in rank for i in mb) for rank in s.steps[0]]  # noqa: E731
    assert max(tokens(bal)) - min(tokens(bal)) == 0
    assert plain.rank_samples(0) == [0, 4, 8, 12]  # the seeds' strided split without balance_data
    assert all(len(rank) == 4 and all(len(mb) == 1 for mb in rank) for rank in plain.steps[0])  # one per micro-batch


def test_tail_past_the_last_full_batch_is_trimmed_and_a_short_rollout_trains_once():
    split = split_rollout([10] * 70, dp_size=4, global_batch_size=32, balance=True)
    assert len(split.steps) == 2 and split.trimmed == list(range(64, 70))
    short = split_rollout([10] * 6, dp_size=4, global_batch_size=32, balance=True, max_tokens_per_gpu=100)
    assert len(short.steps) == 1 and short.trimmed == []
    counts = [len(rank) for rank in short.steps[0]]
    assert len(set(counts)) == 1  # ranks with fewer samples get empty (padding) micro-batches
    assert sorted(i for rank in short.steps[0] for mb in rank for i in mb) == list(range(6))


def test_without_a_global_batch_the_rollout_is_num_steps_slices_of_what_dynamic_sampling_kept():
    split = split_rollout([10] * 50, dp_size=1, num_steps=4, balance=True, max_tokens_per_gpu=1000)
    assert [sum(len(mb) for mb in step[0]) for step in split.steps] == [13, 13, 13, 11] and split.trimmed == []
    recipe = load_recipe("tiny")  # no rollout.global_batch_size: num_steps_per_rollout updates per rollout
    samples = [Sample(prompt_ids=[1] * 5, response_ids=[2] * 5, rollout_logprobs=[0.0] * 5) for _ in range(48)]
    _, split = share_rollout(samples, recipe.rollout, recipe.parallel, recipe.data_parallel_size)
    assert len(split.steps) == recipe.rollout.num_steps_per_rollout == 4
    with pytest.raises(ValueError, match="exactly one"):
        split_rollout([10], dp_size=1, balance=True)


def test_dynamic_global_batch_is_one_step_of_a_dp_multiple():
    assert step_batch_size(100, 256, 8, dynamic=True) == 96
    assert step_batch_size(5, 256, 8, dynamic=True) == 8
    assert step_batch_size(100, 64, 8, dynamic=False) == 64


def test_equal_size_partition_handles_uneven_counts():
    parts = equal_size_partition([5, 4, 3, 2, 1, 9, 7], range(7), 3)
    assert sorted(len(p) for p in parts) == [2, 2, 3]
    assert sorted(i for p in parts for i in p) == list(range(7))


@pytest.mark.parametrize("preset", ["kimi-k2-instruct", "kimi-k2.5"])
def test_presets_split_their_rollout_over_their_dp_ranks(preset):
    recipe = load_recipe(preset, ["parallel.cp=1"])  # the presets run DP 1 (TP8 PP8 CP4); CP 1 gives DP 4
    lengths = _lengths(recipe.rollout.samples_per_rollout, seed=3)
    samples = [Sample(prompt_ids=[1] * 10, response_ids=[2] * (n - 10), rollout_logprobs=[0.0] * (n - 10))
               for n in lengths]
    shares, split = share_rollout(samples, recipe.rollout, recipe.parallel, recipe.data_parallel_size)
    dp = recipe.data_parallel_size
    assert len(shares) == dp == 4 and [s.dp_rank for s in shares] == list(range(dp))
    assert len(split.steps) == recipe.rollout.num_steps_per_rollout
    assert sum(len(s.samples) for s in shares) == len(samples) - len(split.trimmed)
    for s in shares:  # positions in the share's own sample list, every one used exactly once
        used = sorted(i for step in s.steps for mb in step for i in mb)
        assert used == list(range(len(s.samples)))
