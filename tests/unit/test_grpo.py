"""GRPO math against numbers computed by hand (written out in the comments), plus dynamic sampling."""

from __future__ import annotations

import math

import pytest
import torch

from kimi_pipeline.recipes.models import GRPOSpec
from kimi_pipeline.rl.grpo import (
    broadcast_to_tokens,
    group_advantages,
    grpo_loss,
    kl_penalty,
    per_sample_token_mean,
    policy_loss,
    ppo_ratio,
    tis_weights,
)
from kimi_pipeline.rl.step_metrics import settle
from kimi_pipeline.rl.dynamic_sampling import collect_groups, filter_groups, group_has_signal

D = torch.float64
LN = math.log


def t(x):
    return torch.tensor(x, dtype=D)


def test_group_advantages_by_hand():
    # group 1: [1,0,0,0], mean 1/4, unbiased var (0.5625 + 3*0.0625)/3 = 0.25, std 0.5 -> 1.5, -0.5 x3
    # group 2: [1,1,0,0], mean 1/2, var 4*0.25/3 = 1/3, std 0.57735 -> +-0.866025
    # group 3: all equal -> 0 (no signal)
    a = group_advantages(t([1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1]), 4)
    s3 = 1 / math.sqrt(1 / 3)
    want = [1.5, -0.5, -0.5, -0.5, 0.5 * s3, 0.5 * s3, -0.5 * s3, -0.5 * s3, 0, 0, 0, 0]
    assert a.tolist() == pytest.approx(want, abs=1e-5)
    # the 1e-6 is added to the std: 0.75 / (0.5 + 1e-6)
    assert a[0].item() == pytest.approx(0.75 / 0.500001, rel=1e-9)
    assert group_advantages(t([0.3, 0.9]), 1).tolist() == [0.0, 0.0]  # n = 1: no std, no signal
    with pytest.raises(ValueError, match="groups"):
        group_advantages(t([1, 0, 1]), 2)


def test_broadcast_and_per_sample_token_mean():
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert broadcast_to_tokens(t([2.0, -1.0]), mask).tolist() == [[2, 2, 2, 0], [-1, 0, 0, 0]]
    x = t([[1, 2, 3, 100], [4, 100, 100, 100]])
    # sample means 2 and 4 -> 3 (a token mean over all 4 tokens would be 2.5)
    assert per_sample_token_mean(x, mask).item() == pytest.approx(3.0)
    assert per_sample_token_mean(x, mask, num_samples=4).item() == pytest.approx(1.5)
    # a sample without response tokens contributes 0 but still counts
    assert per_sample_token_mean(t([[5, 5], [9, 9]]), t([[1, 1], [0, 0]])).item() == pytest.approx(2.5)


def test_policy_loss_asymmetric_clip_by_hand():
    # eps 0.2 / eps_high 0.28:   A    rho   -rho*A   -clip(rho)*A   loss   clipped?
    #                            +1   1.5   -1.5     -1.28          -1.28  yes
    #                            +1   0.5   -0.5     -0.8           -0.5   no
    #                            -1   0.5    0.5      0.8            0.8   yes
    #                            -1   1.5    1.5      1.28           1.5   no
    #                            +2   1.1   -2.2     -2.2           -2.2   no (equal)
    rho = [1.5, 0.5, 0.5, 1.5, 1.1]
    adv = t([1, 1, -1, -1, 2])
    old = t([0.0] * 5) - 1.0
    logp = old + t([LN(r) for r in rho])
    loss, clipped = policy_loss(logp, old, adv, 0.2, 0.28)
    assert loss.tolist() == pytest.approx([-1.28, -0.5, 0.8, 1.5, -2.2])
    assert clipped.tolist() == [True, False, True, False, False]
    # the log-ratio is clamped to +-20 before exp
    assert ppo_ratio(t([100.0, -100.0]), t([0.0, 0.0])).tolist() == pytest.approx([math.exp(20), math.exp(-20)])


def test_tis_weights_by_hand():
    old = t([LN(3), LN(0.5), 0.0, -30.0])
    rollout = t([0.0, 0.0, 0.0, 0.0])
    w, raw = tis_weights(old, rollout, clip=2.0)
    assert raw.tolist() == pytest.approx([3.0, 0.5, 1.0, math.exp(-20)])
    assert w.tolist() == pytest.approx([2.0, 0.5, 1.0, math.exp(-20)])
    w, _ = tis_weights(old, rollout, clip=2.0, clip_low=0.8)
    assert w.tolist() == pytest.approx([2.0, 0.8, 1.0, 0.8])


def test_kl_penalties_by_hand():
    logp = t([LN(0.5), LN(0.5), 0.0])
    ref = t([LN(0.25), LN(1.0), 40.0])
    # low_var_kl: d = ref - logp = -ln2 -> 0.5 - 1 + ln2 = 0.193147; d = +ln2 -> 2 - 1 - ln2 = 0.306853;
    # d = 40 -> clamp to 20 -> e^20 - 21 -> clamp to 10
    assert kl_penalty(logp, ref).tolist() == pytest.approx([0.5 - 1 + LN(2), 1 - LN(2), 10.0])
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([LN(2), -LN(2), -40.0])
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([LN(2) ** 2 / 2, LN(2) ** 2 / 2, 800.0])
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_penalty(logp, ref, "k9")


def _batch():
    # sample 0: A = +1, 2 response tokens (third is padding), rho = 1.5, 0.5
    # sample 1: A = -1, 3 response tokens, rho = 0.5, 1.5, 1.0
    mask = t([[1, 1, 0], [1, 1, 1]])
    old = t([[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0]])
    logp = (old + t([[LN(1.5), LN(0.5), LN(7.0)], [LN(0.5), LN(1.5), 0.0]])).requires_grad_()
    # trainer/rollout ratios: sample 0: 3 (-> clipped to 2), 1; sample 1: 0.5, 1, 1
    rollout = old - t([[LN(3.0), 0.0, 0.0], [LN(0.5), 0.0, 0.0]])
    ref = logp.detach() + LN(2)  # low_var_kl = 1 - ln2 = 0.306853 on every token
    entropy = t([[1.0, 2.0, 99.0], [3.0, 3.0, 3.0]])  # sample means 1.5, 3 -> 2.25
    return logp, old, rollout, ref, entropy, t([1.0, -1.0]), mask


def test_grpo_loss_pg_only_by_hand():
    logp, old, _, _, _, adv, mask = _batch()
    cfg = GRPOSpec(eps_clip=0.2, eps_clip_high=0.28)
    loss, m = grpo_loss(logp, old, None, None, None, adv, mask, cfg)
    (m,) = settle([m])
    # per-token pg: s0 [-1.28, -0.5] -> -0.89; s1 [0.8, 1.5, 1.0] -> 1.1; mean 0.105
    assert loss.item() == pytest.approx(0.105)
    assert m["pg_loss"] == pytest.approx(0.105)
    # clipped tokens: s0 1/2, s1 1/3 -> 0.416667
    assert m["clip_fraction"] == pytest.approx((0.5 + 1 / 3) / 2)
    assert "tis_mean" not in m and "kl" not in m and "mismatch_k3" not in m  # no rollout logprobs given
    loss.backward()
    # d/dlogp of -A*rho/(2 tokens)/(2 samples) at s0 t1 (unclipped, rho 0.5): -0.125; clipped and padded: 0;
    # s1 t1: +1.5/3/2 = 0.25, s1 t2: 1/3/2
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.125, 0.0, 0.0, 0.25, 1 / 6])


def test_grpo_loss_with_tis_kl_entropy_by_hand():
    logp, old, rollout, ref, entropy, adv, mask = _batch()
    cfg = GRPOSpec(
        eps_clip=0.2, eps_clip_high=0.28, use_tis=True, tis_clip=2.0,
        use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coef=0.01,
    )
    loss, m = grpo_loss(logp, old, rollout, ref, entropy, adv, mask, cfg)
    (m,) = settle([m])
    # pg * w: s0 [-1.28*2, -0.5*1] -> -1.53; s1 [0.8*0.5, 1.5, 1.0] -> 0.966667; mean -0.281667
    pg = (-1.53 + 2.9 / 3) / 2
    kl = 1 - LN(2)
    assert m["pg_loss"] == pytest.approx(pg)
    assert m["kl"] == pytest.approx(kl)
    assert m["entropy"] == pytest.approx(2.25)
    assert loss.item() == pytest.approx(pg + 0.1 * kl - 0.01 * 2.25)
    assert m["loss"] == pytest.approx(loss.item())
    # raw TIS ratios on response tokens: s0 [3, 1], s1 [0.5, 1, 1]; the mean is per sample, as every mean here
    assert (m["tis_mean"], m["tis_min"], m["tis_max"]) == pytest.approx(((2 + 2.5 / 3) / 2, 0.5, 3.0))
    assert m["tis_clipfrac"] == pytest.approx((1 / 2 + 0) / 2)
    # train/inference mismatch, d = old - rollout: s0 [ln 3, 0], s1 [ln 0.5, 0, 0]; k3 = e^d - 1 - d
    assert m["mismatch_abs_logp_mean"] == pytest.approx((LN(3) / 2 + LN(2) / 3) / 2)
    assert m["mismatch_abs_logp_max"] == pytest.approx(LN(3))  # the padded token (d = 0 there too) is not counted
    assert m["mismatch_k3"] == pytest.approx(((2 - LN(3)) / 2 + (LN(2) - 0.5) / 3) / 2)
    # split into micro-batches of one sample with num_samples=2: the parts add up to the whole
    parts = [
        grpo_loss(logp[i : i + 1], old[i : i + 1], rollout[i : i + 1], ref[i : i + 1], entropy[i : i + 1],
                  adv[i : i + 1], mask[i : i + 1], cfg, num_samples=2)[0].item()
        for i in range(2)
    ]
    assert sum(parts) == pytest.approx(loss.item())


def test_mismatch_is_reported_without_tis_and_is_zero_when_engine_and_trainer_agree():
    logp, old, rollout, _, _, adv, mask = _batch()
    cfg = GRPOSpec(eps_clip=0.2, eps_clip_high=0.28, use_tis=False)
    (m,) = settle([grpo_loss(logp, old, rollout, None, None, adv, mask, cfg)[1]])
    assert "tis_mean" not in m and m["mismatch_abs_logp_max"] == pytest.approx(LN(3))
    (same,) = settle([grpo_loss(logp, old, old.clone(), None, None, adv, mask, cfg)[1]])
    assert (same["mismatch_abs_logp_mean"], same["mismatch_abs_logp_max"], same["mismatch_k3"]) == (0.0, 0.0, 0.0)


def test_grpo_loss_refuses_missing_inputs():
    logp, old, _, _, _, adv, mask = _batch()
    with pytest.raises(ValueError, match="rollout logprobs"):
        grpo_loss(logp, old, None, None, None, adv, mask, GRPOSpec(use_tis=True))
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, old, None, None, None, adv, mask, GRPOSpec(use_kl_loss=True, kl_loss_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        grpo_loss(logp, old, None, None, None, adv, mask, GRPOSpec(entropy_coef=0.1))


# ------------------------------------------------------------------------------------------------
# Dynamic sampling
# ------------------------------------------------------------------------------------------------


def test_group_has_signal():
    assert group_has_signal([1, 0, 0, 0])
    assert not group_has_signal([1, 1, 1, 1])
    assert not group_has_signal([0.0, 0.0])
    assert not group_has_signal([1.0])  # one sample has no spread
    assert not group_has_signal([0.5, 0.5 + 1e-12])
    kept, dropped = filter_groups([{"rewards": [1, 1]}, {"rewards": [0, 1]}, {"rewards": [0, 0]}])
    assert kept == [{"rewards": [0, 1]}] and len(dropped) == 2


def test_collect_groups_over_samples_until_target():
    # each draw yields 4 groups; groups alternate solved-all / mixed, so 2 of 4 are kept per draw
    draws = []

    def produce(i):
        draws.append(i)
        return [{"id": (i, j), "rewards": [1, 1] if j % 2 == 0 else [0, 1]} for j in range(4)]

    kept, surplus, rep = collect_groups(produce, target=5, max_draws=10)
    assert draws == [0, 1, 2]  # 2 + 2 + 2 = 6 >= 5 after three draws
    assert [g["id"] for g in kept] == [(0, 1), (0, 3), (1, 1), (1, 3), (2, 1)]
    assert [g["id"] for g in surplus] == [(2, 3)]
    got = (rep.draws, rep.groups_seen, rep.kept, rep.dropped, rep.surplus, rep.reached_target)
    assert got == (3, 12, 5, 6, 1, True)
    assert rep.keep_rate == pytest.approx(0.5)


def test_collect_groups_stops_at_max_draws():
    kept, surplus, rep = collect_groups(lambda i: [[1.0, 1.0], [0.0, 1.0]], 4, 3, rewards_of=lambda g: g)
    assert len(kept) == 3 and surplus == [] and not rep.reached_target
    assert rep.as_dict()["dropped"] == 3
    with pytest.raises(ValueError):
        collect_groups(lambda i: [], 0, 1)


# ------------------------------------------------------------------------------------------------
# Dynamic micro-batching
# ------------------------------------------------------------------------------------------------

from kimi_pipeline.rl.batching import first_fit_decreasing, split_micro_batches  # noqa: E402


def _check_plan(plan, lengths, cap):
    seen = sorted(i for rank in plan.ranks for mb in rank for i in mb)
    assert seen == list(range(len(lengths)))  # every sample exactly once
    assert len({len(rank) for rank in plan.ranks}) == 1  # same micro-batch count on every DP rank
    for rank in plan.ranks:
        for mb in rank:
            assert len(mb) <= 1 or sum(lengths[i] for i in mb) <= cap


def test_first_fit_decreasing_by_hand():
    # sorted 5,4,3,2,1 into bins of 6: [5,1] [4,2] [3]
    assert first_fit_decreasing([1, 2, 3, 4, 5], 6) == [[4, 0], [3, 1], [2]]


def test_plan_balances_within_a_rank():
    # FFD needs 3 bins for 5,4,3,2,1 (cap 6); LPT into 3 bins: [5] [4,1] [3,2] -> 5 tokens each
    plan = split_micro_batches([5, 4, 3, 2, 1], 6)
    assert plan.ranks == [[[0], [1, 4], [2, 3]]]
    assert plan.tokens() == [[5, 5, 5]] and plan.oversized == [] and plan.empty_micro_batches == 0


def test_plan_balances_across_dp_ranks_by_hand():
    # LPT over 2 ranks: r0 = 8,5,4,1 (18), r1 = 7,6,3,2 (18); both need 2 bins of <= 10:
    # r0 -> [8,1] [5,4]; r1 -> [7,2] [6,3]
    lengths = [8, 7, 6, 5, 4, 3, 2, 1]
    plan = split_micro_batches(lengths, 10, dp_size=2)
    assert plan.ranks == [[[0, 7], [3, 4]], [[1, 6], [2, 5]]]
    assert plan.tokens() == [[9, 9], [9, 9]]
    assert plan.summary()["rank_tokens"] == [18, 18]


def test_oversized_sample_gets_its_own_micro_batch(caplog):
    plan = split_micro_batches([3, 12, 3, 3], 8)
    assert plan.oversized == [1]
    assert [1] in plan.ranks[0]
    assert "exceed max_tokens_per_gpu=8" in caplog.text
    _check_plan(plan, [3, 12, 3, 3], 8)


def test_short_rank_borrows_samples_instead_of_padding():
    # LPT gives r0 = [20] (1 sample) and r1 = [5,5,5] (2 bins of <= 10): r0 takes a 5 so both have 2 micro-batches
    lengths = [20, 5, 5, 5]
    plan = split_micro_batches(lengths, 10, dp_size=2)
    _check_plan(plan, lengths, 10)
    assert plan.num_micro_batches == 2 and plan.empty_micro_batches == 0
    # fewer samples than ranks x micro-batches: padding is unavoidable and reported
    plan = split_micro_batches([30, 30, 1], 10, dp_size=4)
    _check_plan(plan, [30, 30, 1], 10)
    assert plan.num_micro_batches == 1 and plan.empty_micro_batches == 1


def test_random_plans_keep_every_invariant():
    import random

    rng = random.Random(0)
    for _ in range(200):
        dp, cap = rng.choice([1, 2, 4, 8]), rng.choice([64, 256, 1024])
        lengths = [rng.randint(1, int(cap * 1.2)) for _ in range(rng.randint(1, 64))]
        plan = split_micro_batches(lengths, cap, dp)
        _check_plan(plan, lengths, cap)
        assert plan.oversized == [i for i, n in enumerate(lengths) if n > cap]
        if len(lengths) >= dp * plan.num_micro_batches:
            assert plan.empty_micro_batches == 0
    with pytest.raises(ValueError, match="max_tokens_per_gpu"):
        split_micro_batches([1], 0)
    with pytest.raises(ValueError, match="at least one token"):
        split_micro_batches([0], 8)
