"""Deterministic synthetic math problems in the exact DAPO-Math-17k / AIME-2024 row formats.

The tiny recipe needs a task that a ~1.7 M-parameter model learns *and generalises* in minutes on 2 cores,
with an eval set of ≥ 64 problems that share no problem with train. Measured (SFT probes, 2 cores):

- single-digit sums have only 30 distinct problems once commuted copies count as the same (2+3 = 3+2), too few
  for a disjoint eval set; held-out sums stay near 0 even after 200 supervised steps (no generalisation);
- the largest / smallest of three digits generalise: 200 supervised steps reach 0.97 / 1.0 greedy accuracy on
  held-out digit sets; mixing in subtraction and products kept GRPO at chance.

So the tiny task is single-digit comparisons (largest / smallest of three digits, 220 digit sets each) plus
the sums (a + b ≤ 9) as a memorised minority. Every answer is one token. Rows look exactly like the real
sets: `{"prompt": [{"role": "user", "content": ...}], "label": "7"}` (or a plain-string prompt), answers
expected in `\\boxed{}`.

Train and eval are split by *problem signature* (`data.rows.problem_signature`: the multiset of numbers and
the answer), the same key the validate stage's contamination check uses, so commuted and reworded copies of
an eval problem never appear in train.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kimi_pipeline.data.rows import problem_signature
from kimi_pipeline.util.files import atomic_write_jsonl

DAPO_WRAPPER = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: \\boxed{{$Answer}} where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
SHORT_WRAPPER = "{problem} Answer in \\boxed{{}}."


@dataclass(frozen=True)
class Family:
    """A kind of problem: how many operands, how the answer is computed, how it is worded."""

    arity: int
    answer: Callable[[tuple[int, ...]], int]
    templates: tuple[str, ...]
    commutative: bool = True  # operand order does not change the problem (its copies share a signature)


FAMILIES: dict[str, Family] = {
    "+": Family(2, lambda x: x[0] + x[1],
                ("What is {0}+{1}?", "Compute {0} + {1}.", "Find the sum of {0} and {1}.", "{0} plus {1} is?")),
    "-": Family(2, lambda x: x[0] - x[1],
                ("What is {0}-{1}?", "Compute {0} - {1}.", "Subtract {1} from {0}.", "{0} minus {1} is?"),
                commutative=False),
    "*": Family(2, lambda x: x[0] * x[1],
                ("What is {0}*{1}?", "Compute {0} * {1}.", "Find the product of {0} and {1}.", "{0} times {1} is?")),
    "max": Family(3, max, ("What is the largest of {0}, {1} and {2}?", "Find the maximum of {0}, {1}, {2}.",
                           "Which is largest: {0}, {1} or {2}?", "Largest of {0}, {1}, {2}?")),
    "min": Family(3, min, ("What is the smallest of {0}, {1} and {2}?", "Find the minimum of {0}, {1}, {2}.",
                           "Which is smallest: {0}, {1} or {2}?", "Smallest of {0}, {1}, {2}?")),
}


@dataclass(frozen=True)
class MathGenConfig:
    """Difficulty knobs: which problem families, operand and answer range, split size, phrasing."""

    seed: int = 0
    ops: tuple[str, ...] = ("max", "min", "+")
    max_operand: int = 9
    max_answer: int = 9  # answers 0..9 are single tokens for the tiny tokenizer
    min_answer: int = 0
    eval_problems: int = 96  # distinct eval problems (by signature), drawn first
    rows_per_problem: int = 2  # train rows per problem, each with its own wording and operand order
    wrapper: str = "short"  # "short" or "dapo" (the real DAPO-Math-17k user message)
    string_prompt_fraction_train: float = 0.0
    string_prompt_fraction_eval: float = 1.0


Problem = tuple[str, tuple[int, ...], int]  # (family, operands, answer)


def problems(cfg: MathGenConfig) -> list[Problem]:
    """Every distinct problem of the configured families (commuted copies once)."""
    out: list[Problem] = []
    for op in cfg.ops:
        if op not in FAMILIES:
            raise ValueError(f"unknown problem family {op!r}; choose from {sorted(FAMILIES)}")
        fam = FAMILIES[op]
        operands = range(cfg.max_operand + 1)
        combos = (itertools.combinations_with_replacement(operands, fam.arity) if fam.commutative
                  else itertools.product(operands, repeat=fam.arity))
        for x in combos:
            if op == "*" and 0 in x:
                continue  # trivially 0; would dominate the small answer range
            ans = fam.answer(x)
            if cfg.min_answer <= ans <= cfg.max_answer:
                out.append((op, tuple(x), ans))
    return out


def _texts(p: Problem, k: int, rng: random.Random) -> list[str]:
    """Up to k distinct wordings of a problem (template x operand order), never the same text twice."""
    op, x, _ = p
    fam = FAMILIES[op]
    orders = sorted(set(itertools.permutations(x))) if fam.commutative else [x]
    texts = sorted({t.format(*o) for t in fam.templates for o in orders})
    return rng.sample(texts, min(k, len(texts)))


def _row(text: str, answer: int, as_string: bool, wrapper: str) -> dict:
    tmpl = DAPO_WRAPPER if wrapper == "dapo" else SHORT_WRAPPER
    content = tmpl.format(problem=text)
    prompt: str | list[dict] = content if as_string else [{"role": "user", "content": content}]
    return {"prompt": prompt, "label": str(answer)}


def generate(cfg: MathGenConfig = MathGenConfig()) -> tuple[list[dict], list[dict]]:
    """(train_rows, eval_rows), deterministic for a config; no eval problem's signature occurs in train."""
    rng = random.Random(cfg.seed)
    by_signature: dict[tuple, list[Problem]] = {}
    for p in problems(cfg):
        by_signature.setdefault(problem_signature(FAMILIES[p[0]].templates[0].format(*p[1]), str(p[2])), []).append(p)
    keys = sorted(by_signature)
    rng.shuffle(keys)
    eval_set: list[Problem] = []
    train_set: list[Problem] = []
    for key in keys:
        (eval_set if len(eval_set) < cfg.eval_problems else train_set).extend(by_signature[key])
    if not train_set:
        raise ValueError(f"eval_problems={cfg.eval_problems} leaves no training problems ({len(eval_set)} in all)")
    train = [_row(text, p[2], rng.random() < cfg.string_prompt_fraction_train, cfg.wrapper)
             for p in train_set for text in _texts(p, cfg.rows_per_problem, rng)]
    rng.shuffle(train)
    evals = [_row(_texts(p, 1, rng)[0], p[2], rng.random() < cfg.string_prompt_fraction_eval, cfg.wrapper)
             for p in eval_set]
    return train, evals


def write_tiny_datasets(out_dir: Path, cfg: MathGenConfig = MathGenConfig()) -> dict[str, Path]:
    train, evals = generate(cfg)
    out_dir = Path(out_dir)
    paths = {"train": out_dir / "dapo-math-tiny.jsonl", "eval": out_dir / "aime-tiny.jsonl"}
    atomic_write_jsonl(paths["train"], train)
    atomic_write_jsonl(paths["eval"], evals)
    return paths
