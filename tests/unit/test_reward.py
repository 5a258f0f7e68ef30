"""Reward grading: hand cases, strict parsing, and pathological answers that must neither hang nor crash."""

from __future__ import annotations

import json

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


# Per-comparison limit where a test is not about the limit: far above what a comparison takes (< 1 s even on a
# loaded 2-core box), so a slow machine never turns an equivalent answer into a timeout.
GENEROUS_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def deepscaler():
    with AnswerGrader("deepscaler", timeout_s=GENEROUS_TIMEOUT_S, workers=2) as rm:
        yield rm


@pytest.fixture(scope="module")
def math_grader():
    with AnswerGrader("math", timeout_s=GENEROUS_TIMEOUT_S, workers=2) as rm:
        yield rm


def score_one(response: str, label: str, rm_type: str = "math", thinking: bool = False, *,
              strict: bool = False) -> float:
    """One response graded by a fresh AnswerGrader (its worker, if any, closed afterwards)."""
    with AnswerGrader(rm_type, thinking, workers=1, strict=strict, timeout_s=GENEROUS_TIMEOUT_S) as grader:
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


@pytest.mark.parametrize(
    "response, label, via",
    [
        # slime's --rm-type math: normalized string OR symbolic equality (sympy), so algebra counts
        ("\\boxed{1+x}", "x+1", "symbolic"),
        ("Answer: 1+x", "x+1", "symbolic"),  # DAPO's "Answer:" last line is graded the same way
        ("\\boxed{\\sqrt{4}}", "2", "symbolic"),
        ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", "symbolic"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", "symbolic"),
        ("\\boxed{(x+1)^2}", "x^2+2x+1", "symbolic"),
        ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2", "symbolic"),
        ("\\boxed{2^{10}}", "1024", "symbolic"),
        ("\\boxed{3\\cdot 4}", "12", "symbolic"),
        ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", "symbolic"),  # a set: order does not matter
        # decided in-process, before any worker
        ("\\boxed{\\frac{2}{4}}", "\\frac12", "numeric"),
        ("\\boxed{0.5}", "1/2", "numeric"),
        ("\\boxed{(1,2)}", "(1, 2)", "fast"),
    ],
)
def test_math_scores_equivalent_forms_1(math_grader, response, label, via):
    assert math_grader.score([response], [label]) == [1.0]
    s = math_grader.last_stats
    assert getattr(s, via) == 1 and s.timeouts == 0 and s.errors == 0, s


@pytest.mark.parametrize(
    "response, label",
    [
        ("\\boxed{x+2}", "x+1"),
        ("\\boxed{y+1}", "x+1"),
        ("\\boxed{x^2-1}", "(x-1)^2"),
        ("\\boxed{\\sqrt{5}}", "2"),
        ("\\boxed{\\sqrt{2}}", "1.414"),  # a rounded value is not the exact one
        ("\\boxed{2\\sqrt{3}}", "\\sqrt{13}"),
        ("\\boxed{(2,1)}", "(1,2)"),  # an ordered pair: order matters
        ("\\boxed{[1,2)}", "[1,2]"),
        ("\\boxed{\\frac{\\pi}{3}}", "\\frac{\\pi}{2}"),
        ("\\boxed{7x}", "7"),
    ],
)
def test_math_scores_different_forms_0(math_grader, response, label):
    assert math_grader.score([response], [label]) == [0.0]
    s = math_grader.last_stats
    assert s.symbolic == 1 and s.timeouts == 0 and s.errors == 0, s  # sympy said "different", nothing failed


def test_a_math_batch_of_plain_numbers_starts_no_worker():
    responses = ["\\boxed{7}", "Answer: 7", "\\boxed{\\frac{14}{2}}", "\\boxed{0.5}", "\\boxed{1,000}",
                 "\\boxed{8}", "no answer"]
    labels = ["7", "7", "7", "\\frac{1}{2}", "1000", "7", "7"]
    with AnswerGrader("math") as rm:
        assert rm.score(responses, labels) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
        s = rm.last_stats
        assert (s.fast, s.numeric, s.no_answer, s.symbolic) == (3, 3, 1, 0), s
        assert rm.worker_pids() == [] and rm._pool is None
        # the control: one answer that is not a plain number does start a worker, and close() ends it
        assert rm.score(["\\boxed{1+x}"], ["x+1"]) == [1.0]
        assert rm.last_stats.symbolic == 1 and len(rm.worker_pids()) == 1
    assert rm.worker_pids() == []


def test_deepscaler_needs_a_box():
    assert score_one("Answer: 1+x", "x+1", "deepscaler") == 0.0  # no box, no answer
    assert score_one("Answer: 1+x", "x+1", "math") == 1.0  # DAPO's Answer: line, equal by sympy
    assert score_one("\\boxed{1+x}", "x+1", "deepscaler") == 1.0


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


@pytest.mark.parametrize("rm_type", ["math", "deepscaler"])
def test_batch_stats_count_each_path(request, rm_type):
    grader = request.getfixturevalue({"math": "math_grader", "deepscaler": "deepscaler"}[rm_type])
    responses = ["\\boxed{7}", "\\boxed{\\frac{14}{2}}", "\\boxed{x+1}", "no answer", "\\boxed{9^{9^{9}}}"]
    labels = ["7", "7", "1+x", "7", "9"]
    assert grader.score(responses, labels) == [1.0, 1.0, 1.0, 0.0, 0.0]
    s = grader.last_stats
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
    with AnswerGrader("math") as rm:
        assert rm.score(responses, [r["label"] for r in rows]) == [1.0] * len(rows)
        shifted = [str((int(r["label"]) + 1) % 10) for r in rows]
        assert rm.score(responses, shifted) == [0.0] * len(rows)
        # the common case never starts a worker
        assert rm.totals.n == 2 * len(rows) and rm.totals.symbolic == 0 and rm.worker_pids() == []


# ------------------------------------------------------------------------------------------------
# Pathological answers: bounded time, reward 0, no crash
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rm_type", ["math", "deepscaler"])
def test_power_tower_is_refused_without_sympy(rm_type):
    explosive = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{(10^{100})!}", "\\boxed{3^{123456789}}", "\\boxed{1000000!}"]
    with AnswerGrader(rm_type, timeout_s=GENEROUS_TIMEOUT_S, workers=1) as rm:
        assert rm.score(explosive, ["9"] * 4) == [0.0] * 4
        s = rm.last_stats
        assert (s.rejected, s.symbolic, s.timeouts) == (4, 0, 0), s
        assert rm.worker_pids() == [] and rm._pool is None  # refused in-process: no worker was ever started
        # tame powers and factorials are not refused: the string match, or sympy, grades them
        tame = ["\\boxed{2^{2024}}", "\\boxed{100!}", "\\boxed{5!}"]
        assert rm.score(tame, ["2^{2024}", "100!", "120"]) == [1.0, 1.0, 1.0]
        s = rm.last_stats
        assert (s.rejected, s.fast, s.symbolic, s.timeouts) == (0, 2, 1, 0), s


@pytest.mark.timeout(180)  # a generous bound on the whole test; what it checks are the pool's states, not times
def test_spinning_sympy_is_killed_and_replaced():
    # binom(10^6, 5*10^5) passes the explosive-form filter and then grinds in sympy for minutes (> 85 s measured),
    # far past the default 5 s limit that an ordinary comparison (~0.05 s) never nears
    with AnswerGrader("deepscaler", workers=1) as rm:
        assert rm.score(["\\boxed{1+x}"], ["x+1"]) == [1.0]
        (first,) = rm._pool._workers
        assert rm.worker_pids() == [first.proc.pid]
        assert rm.score(["\\boxed{\\binom{1000000}{500000}}", "\\boxed{1+x}"], ["9", "x+1"]) == [0.0, 1.0]
        s = rm.last_stats
        assert (s.symbolic, s.timeouts, s.errors) == (2, 1, 0), s  # the binomial timed out, nothing else failed
        assert rm._pool.restarts == 1
        assert first.proc.poll() is not None  # the stuck worker was killed, not waited for
        (second,) = rm._pool._workers
        assert rm.worker_pids() == [second.proc.pid] != [first.proc.pid]  # and replaced: the new one graded 1+x
    assert second.proc.poll() is not None and rm.worker_pids() == []  # close() leaves no worker behind


@pytest.mark.parametrize("rm_type", ["math", "deepscaler"])
def test_megabytes_and_deep_nesting_take_the_cheap_path(rm_type):
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
    ]
    with AnswerGrader(rm_type, timeout_s=GENEROUS_TIMEOUT_S, workers=1) as rm:
        assert rm.score(responses, ["7"] * len(responses)) == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        s = rm.last_stats
        # only the last MAX_TAIL_CHARS are read, brace matching stops at MAX_ANSWER_CHARS: no worker to wait for
        assert (s.no_answer, s.fast, s.symbolic) == (7, 1, 0), s
        assert rm.worker_pids() == []
    with AnswerGrader(rm_type, thinking=True) as rm:
        assert rm.score(["<think>" + big], ["7"]) == [0.0] and rm.last_stats.no_answer == 1


def test_numbers_too_long_for_exact_values_go_to_sympy_safely(deepscaler):
    # past 40 digits, or in exponent notation, as_number gives up (nothing is expanded in-process);
    # sympy compares them without expanding 10^999999999 either
    responses = ["\\boxed{" + "1" * 200 + "}", "\\boxed{1e999999999}", "\\boxed{" + "1" * 200 + "}"]
    assert deepscaler.score(responses, ["7", "7", "1" * 200]) == [0.0, 0.0, 1.0]
    s = deepscaler.last_stats
    assert (s.symbolic, s.fast, s.timeouts, s.errors) == (2, 1, 0, 0), s


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
    with AnswerGrader("deepscaler", timeout_s=GENEROUS_TIMEOUT_S, workers=1) as rm:
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
