"""Reward grading: hand cases, strict parsing, and pathological answers that must neither hang nor crash."""

from __future__ import annotations

import json
import time

import pytest

from kimi_pipeline.recipes import RecipeError, load_recipe
from kimi_pipeline.reward import (
    MAX_ANSWER_CHARS,
    AnswerGrader,
    RewardError,
    SymbolicPool,
    answer_key,
    as_number,
    extract_answer,
    normalize_answer,
)
from support.common import TINY


@pytest.fixture(scope="module")
def deepscaler():
    with AnswerGrader("deepscaler", timeout_s=3.0, workers=2) as rm:
        yield rm


def score_one(response: str, label: str, rm_type: str = "math", thinking: bool = False, *,
              strict: bool = False) -> float:
    """One response graded by a fresh AnswerGrader (its worker, if any, closed afterwards)."""
    with AnswerGrader(rm_type, thinking, workers=1, strict=strict) as grader:
        return grader.score([response], [label])[0]


@pytest.mark.parametrize(
    "response, label, expected",
    [
        # the tiny model's learned format (kimi_pipeline/data/tiny_assets.py), with and without EOS text
        ("The answer is \\boxed{7}. Answer: \\boxed{7}", "7", 1.0),
        ("The answer is \\boxed{7}. Answer: \\boxed{7}<|im_end|>", "7", 1.0),
        ("The answer is \\boxed{7}. Answer: \\boxed{8}", "7", 0.0),  # the LAST answer counts
        ("Answer: \\boxed{7}", "8", 0.0),
        ("Answer: 7", "7", 1.0),  # DAPO "Answer:" last line without a box (math only)
        ("**Answer:** $7$.", "7", 1.0),
        ("\\boxed{ 7 }", "7", 1.0),
        ("$\\boxed{7}$.", "7", 1.0),
        ("\\[\\boxed{7}\\]", "7", 1.0),
        ("\\boxed{7.0}", "7", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\tfrac12}", "\\frac{1}{2}", 1.0),
        ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
        ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
        ("\\boxed{0.33}", "\\frac{1}{3}", 0.0),  # exact values: a rounded decimal is not 1/3
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{5\\text{ cm}}", "5", 1.0),
        ("\\boxed{\\text{(B)}}", "B", 1.0),
        ("\\boxed{x = 3}", "3", 1.0),
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}", 1.0),  # escaped braces are not structure
        ("\\boxed{\\boxed{7}}", "7", 1.0),
        ("\\fbox{7}", "7", 1.0),
        ("The answer is 7.", "7", 0.0),  # no box, no Answer: line
        ("\\boxed{}", "7", 0.0),
        ("", "7", 0.0),
    ],
)
def test_math_hand_cases(response, label, expected):
    assert score_one(response, label, "math") == expected


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{9}}}}",  # the brace-spam exploit a loose parser rewards
        "\\boxed{9}}",
        "\\boxed{9} }",
        "\\boxed{9} and then some more text",
        "\\boxed{9}!!!!!!!!!!!!!!!!!!!!",
        "\\boxed{9",  # never closed
        "\\boxed{{9}",
        "\\boxed9",
    ],
)
def test_strict_parse_rejects_sloppy_endings(response):
    assert extract_answer(response, "math", strict=True) is None
    assert score_one(response, "9", "math", strict=True) == 0.0
    assert score_one(response, "9", "deepscaler", strict=True) == 0.0


def test_default_is_the_seeds_deepscaler_semantics():
    """The seeds' reward: the last box of the answer region, whatever follows it; `###Response` splits too."""
    for rm in ("math", "deepscaler"):
        assert score_one("\\boxed{5}. I hope this helps!", "5", rm) == 1.0
        assert score_one("\\boxed{9} and then some more text", "9", rm) == 1.0
        assert score_one("so \\boxed{8}, no wait \\boxed{9}. Done.", "9", rm) == 1.0
        assert score_one("\\boxed{9", "9", rm) == 0.0  # never closed
        assert score_one("<think>\\boxed{5}</think>So: \\boxed{5}. I hope this helps!", "5", rm, thinking=True) == 1.0
    # upstream deepscaler: no </think> -> the text after ###Response
    draft_then_answer = "draft \\boxed{3} ###Response The answer is \\boxed{5}, done."
    assert score_one(draft_then_answer, "5", "deepscaler", thinking=True) == 1.0
    assert score_one("###Response \\boxed{5}", "3", "deepscaler", thinking=True) == 0.0
    assert score_one("\\boxed{3} ###Response nothing boxed here", "3", "deepscaler", thinking=True) == 0.0
    assert score_one("no marker at all \\boxed{5}", "5", "deepscaler", thinking=True) == 0.0  # never answered
    assert score_one("###Response \\boxed{5}", "5", "math", thinking=True) == 0.0  # the split is deepscaler's only


def test_thinking_models_must_close_their_thinking():
    answered = "<think>maybe \\boxed{3}</think>So the answer is \\boxed{7}."
    unclosed = "<think>so the answer is \\boxed{7}"
    for rm in ("math", "deepscaler"):
        assert score_one(answered, "7", rm, thinking=True) == 1.0
        assert score_one(unclosed, "7", rm, thinking=True) == 0.0  # never answered
        # boxed only inside thinking
        assert score_one("<think>\\boxed{7}</think>I give up.", "7", rm, thinking=True) == 0.0
    assert score_one("<think>a</think>x</think>\\boxed{7}", "7", "math", thinking=True) == 1.0  # after the LAST close
    assert score_one("\\boxed{7}", "7", "math", thinking=False) == 1.0


def test_math_variant_is_string_and_numeric_only():
    # x+1 vs 1+x needs algebra: math says 0 without starting a worker, deepscaler says 1
    rm = AnswerGrader("math")
    assert rm.score(["\\boxed{x+1}"], ["1+x"]) == [0.0]
    assert rm._pool is None
    assert score_one("\\boxed{1+x}", "x+1", "deepscaler") == 1.0
    assert score_one("Answer: x+1", "x+1", "deepscaler") == 0.0  # deepscaler needs a box


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
        ("\\boxed{\\pi r^2}", "\\pi r^{2}", 1.0),
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        ("\\boxed{x+2}", "x+1", 0.0),
        ("\\boxed{\\frac{68}{2}}", "34", 1.0),  # numeric, decided in-process
        ("\\boxed{\\sqrt{2}}", "1.414", 0.0),
    ],
)
def test_deepscaler_symbolic(deepscaler, response, label, expected):
    assert deepscaler.score([response], [label]) == [expected]
    assert deepscaler.last_stats.timeouts == 0 and deepscaler.last_stats.errors == 0


def test_batch_stats_count_each_path(deepscaler):
    responses = ["\\boxed{7}", "\\boxed{\\frac{14}{2}}", "\\boxed{x+1}", "no answer", "\\boxed{9^{9^{9}}}"]
    labels = ["7", "7", "1+x", "7", "9"]
    assert deepscaler.score(responses, labels) == [1.0, 1.0, 1.0, 0.0, 0.0]
    s = deepscaler.last_stats
    assert (s.n, s.correct, s.fast, s.numeric, s.symbolic, s.no_answer, s.rejected) == (5, 3, 1, 1, 1, 1, 1)


def test_normalization_and_numbers():
    assert normalize_answer("\\pi r^2") == "\\pi r^2"  # the command keeps its separating space
    assert normalize_answer("\\left( 1, 2 \\right)") == "(1,2)"
    assert normalize_answer("\\$1{,}000") == "1000"
    assert as_number("0.50") == as_number("\\frac{1}{2}") == as_number("1/2")
    assert as_number("1e999999999") is None  # no exponent notation: nothing can expand
    assert as_number("1/0") is None
    assert answer_key("\\frac{1}{2}") == answer_key("0.5") != answer_key("0.25")
    assert answer_key(None) is None


def test_tiny_dataset_labels_grade_against_the_learned_format():
    rows = [json.loads(line) for line in (TINY / "aime-tiny.jsonl").read_text().splitlines()]
    responses = [f"The answer is \\boxed{{{r['label']}}}. Answer: \\boxed{{{r['label']}}}<|im_end|>" for r in rows]
    rm = AnswerGrader("math")
    assert rm.score(responses, [r["label"] for r in rows]) == [1.0] * len(rows)
    shifted = [str((int(r["label"]) + 1) % 10) for r in rows]
    assert rm.score(responses, shifted) == [0.0] * len(rows)
    assert rm.totals.n == 2 * len(rows) and rm._pool is None  # the common case never starts a worker


# ------------------------------------------------------------------------------------------------
# Pathological answers: bounded time, reward 0, no crash
# ------------------------------------------------------------------------------------------------


def test_power_tower_is_refused_without_sympy(deepscaler):
    t = time.monotonic()
    explosive = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{(10^{100})!}", "\\boxed{3^{123456789}}", "\\boxed{1000000!}"]
    assert deepscaler.score(explosive, ["9"] * 4) == [0.0] * 4
    assert deepscaler.last_stats.rejected == 4
    assert time.monotonic() - t < 1.0
    assert score_one("\\boxed{9^{9^{9^{9}}}}", "9", "deepscaler", strict=False) == 0.0
    assert deepscaler.score(["\\boxed{2^{2024}}", "\\boxed{100!}"], ["2^{2024}", "100!"]) == [1.0, 1.0]


def test_spinning_sympy_is_killed_and_replaced():
    # binom(10^6, 5*10^5) passes the explosive-form filter and then grinds in sympy for long
    with AnswerGrader("deepscaler", timeout_s=1.0, workers=1) as rm:
        t = time.monotonic()
        assert rm.score(["\\boxed{\\binom{1000000}{500000}}", "\\boxed{1+x}"], ["9", "x+1"]) == [0.0, 1.0]
        elapsed = time.monotonic() - t
        assert rm.last_stats.timeouts == 1 and rm.last_stats.symbolic == 2
        assert rm._pool.restarts == 1
        assert elapsed < 8.0, elapsed
        old = [w.proc for w in rm._pool._workers]
    assert all(p.poll() is not None for p in old)  # close() leaves no worker behind


def test_megabytes_and_deep_nesting_finish_fast(deepscaler):
    big = "blah " * 1_000_000  # 5 MB
    nested = "\\boxed{" + "{" * 10_000 + "7" + "}" * 10_000 + "}"
    long_box = "\\boxed{" + "1" * (MAX_ANSWER_CHARS + 1) + "}"
    responses = [
        big,
        big + "\\boxed{7}",
        "<think>" + big,
        "{" * 10_000,
        "}" * 10_000,
        nested,
        big + nested,
        long_box,
        "\\boxed{" + "1" * 200 + "}",
        "\\boxed{1e999999999}",
    ]
    t = time.monotonic()
    rewards = deepscaler.score(responses, ["7"] * len(responses))
    elapsed = time.monotonic() - t
    assert rewards == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert elapsed < 5.0, elapsed
    assert AnswerGrader("math", thinking=True).score(["<think>" + big], ["7"]) == [0.0]


def test_bad_configuration_is_a_clear_error():
    with pytest.raises(RewardError, match="rm_type"):
        AnswerGrader("f1")
    with pytest.raises(RewardError, match="timeout_s"):
        AnswerGrader("math", timeout_s=0)
    with pytest.raises(RewardError, match="workers"):
        SymbolicPool(workers=0)
    with pytest.raises(ValueError, match="labels"):
        AnswerGrader("math").score(["a"], [])


def test_a_worker_killed_from_outside_is_replaced():
    with AnswerGrader("deepscaler", timeout_s=3.0, workers=1) as rm:
        assert rm.score(["\\boxed{1+x}"], ["x+1"]) == [1.0]
        victim = rm._pool._workers[0].proc
        victim.kill()
        victim.wait()
        assert rm.score(["\\boxed{1+x}", "\\boxed{2+x}"], ["x+1", "x+1"]) == [1.0, 0.0]
        assert rm.last_stats.errors == 0 and rm._pool.restarts == 1


def test_nested_boxes_and_units():
    assert score_one("\\boxed{\\boxed{\\boxed{7}}}", "7", "math") == 1.0
    assert score_one("\\boxed{7} \\boxed{8}", "7", "math") == 0.0
    assert score_one("\\boxed{5 \\text{ m}}", "5", "math") == 1.0
    assert score_one("\\boxed{2\\mathrm{i}}", "2", "math") == 0.0  # \mathrm{i} is not a unit


# ------------------------------------------------------------------------------------------------
# Custom graders: rollout.rm_type as a function path package.module:function
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def custom_grader_module(tmp_path, monkeypatch):
    """A user's grader module on sys.path: full marks for an exact echo of the label, half for a prefix."""
    (tmp_path / "my_rm_for_tests.py").write_text(
        "from kimi_pipeline.reward import Verdict\n\n\n"
        "def echo(response, label, *, thinking, strict):\n"
        "    if response == label:\n"
        "        return Verdict(1.0, 'fast')\n"
        "    return Verdict(0.5 if response.startswith(label) else 0.0, 'fast')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rm_for_tests"


def test_a_custom_grader_by_function_path_scores_as_it_says(custom_grader_module):
    recipe = load_recipe("tiny", [f"rollout.rm_type={custom_grader_module}:echo"])
    with AnswerGrader(recipe.rollout.rm_type) as grader:
        assert grader.score(["42", "42 or so", "\\boxed{42}"], ["42", "42", "42"]) == [1.0, 0.5, 0.0]
        assert grader.last_stats.n == 3 and grader.last_stats.fast == 3 and grader._pool is None
        assert grader.answers(["\\boxed{42}"]) == ["42"]  # majority voting reads answers the math way


@pytest.mark.parametrize("rm_type", ["no_such_module_xyz:grade", "my_rm_for_tests:missing", "math:", "f1"])
def test_an_unresolvable_rm_type_fails_at_recipe_load(custom_grader_module, rm_type):
    with pytest.raises(RecipeError) as e:
        load_recipe("tiny", [f"rollout.rm_type={rm_type}"])
    assert any(p.field == "rollout.rm_type" for p in e.value.problems), str(e.value)
    with pytest.raises(RewardError, match="rollout.rm_type"):
        AnswerGrader(rm_type)
