"""Eval metrics against hand-computed values."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from kimi_pipeline.eval.scores import length_stats, majority_vote, pass_at_k, summarize


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0  # n - c < k: some draw must include the correct one
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(16, 3, 4) == pytest.approx(1 - 715 / 1820)  # 1 - C(13,4)/C(16,4)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_pass_at_k_is_stable_for_large_n():
    # binomials with ~100 digits: the product form matches exact rational arithmetic
    n, c, k = 500, 7, 100
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(10_000, 1, 1) == pytest.approx(1e-4)


def test_majority_vote_collides_equal_values_and_breaks_ties_by_first_appearance():
    # "7" and "\frac{14}{2}" are one answer (2 votes), "8" has 2 votes: tie -> "7" appeared first
    assert majority_vote(["7", "\\frac{14}{2}", "8", "8", None]) == (0, 2)
    assert majority_vote(["8", "7", "7"]) == (1, 2)
    assert majority_vote([None, None]) == (None, 0)
    assert majority_vote(["0.5", "\\dfrac{1}{2}", "1/2", "2"]) == (0, 3)


def test_summarize_by_hand():
    correct = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    answers = [["7", "8", "8", "9"], ["5", "5.0", "6", None], [None] * 4]
    lengths = [[10, 20, 30, 40], [5, 5, 5, 5], [16, 16, 16, 16]]
    s = summarize(correct, answers, lengths, labels=["7", "5", "3"], ks=[1, 2, 4], max_response_len=16)
    assert s.n == 4 and s.num_problems == 3
    assert s.avg_at_n == pytest.approx(0.25)  # (1/4 + 2/4 + 0) / 3
    assert s.pass_at[1] == pytest.approx(0.25)  # = avg@n
    # pass@2: p0 1 - C(3,2)/C(4,2) = 0.5, p1 1 - C(2,2)/C(4,2) = 5/6, p2 0
    assert s.pass_at[2] == pytest.approx((0.5 + 5 / 6) / 3)
    assert s.pass_at[4] == pytest.approx(2 / 3)
    # maj: p0 "8" wins (wrong), p1 "5"/"5.0" wins (right), p2 no answer
    assert s.maj_at_n == pytest.approx(1 / 3)
    r0, r1, r2 = s.rows
    assert (r0.maj_answer, r0.maj_votes, r0.maj_correct) == ("8", 2, False)
    assert (r1.maj_answer, r1.maj_votes, r1.maj_correct) == ("5", 2, True)
    assert (r2.maj_answer, r2.maj_votes, r2.maj_correct) == (None, 0, False)
    assert r0.as_dict()["pass@2"] == pytest.approx(0.5) and r0.as_dict()["label"] == "7"
    assert r0.mean_length == 25.0
    # lengths sorted: 5 5 5 5 10 16 16 16 16 20 30 40
    L = s.lengths
    assert L["mean"] == pytest.approx(184 / 12)
    assert (L["min"], L["p50"], L["max"]) == (5.0, 16.0, 40.0)
    assert L["p90"] == pytest.approx(29.0)  # index 9.9: 20 + 0.9 * (30 - 20)
    assert L["mean_correct"] == pytest.approx(20 / 3)  # 10, 5, 5
    assert L["mean_incorrect"] == pytest.approx(164 / 9)
    assert L["truncated_fraction"] == pytest.approx(7 / 12)  # 20, 30, 40 and four 16s
    m = s.metrics("eval/aime/")
    assert m["eval/aime/avg@4"] == pytest.approx(0.25) and m["eval/aime/maj@4"] == pytest.approx(1 / 3)
    assert m["eval/aime/pass@4"] == pytest.approx(2 / 3) and "eval/aime/response_len/p90" in m


def test_summarize_defaults_and_errors():
    s = summarize([[True, False], [False, False]])
    assert sorted(s.pass_at) == [1, 2] and s.maj_at_n is None and s.lengths == {}
    assert s.pass_at[2] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="same number"):
        summarize([[1, 0], [1]])
    with pytest.raises(ValueError, match="pass@k"):
        summarize([[1, 0]], ks=[3])
    with pytest.raises(ValueError, match="answers covers"):
        summarize([[1, 0]], answers=[["1", "2"], ["3", "4"]])
    with pytest.raises(ValueError):
        summarize([])
    assert length_stats([]) == {}
