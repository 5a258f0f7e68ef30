"""Deterministic synthetic math problems in the exact DAPO-Math-17k / AIME-2024 row formats.

The tiny recipe needs a task a ~1.7 M-parameter model can learn in minutes on 2 cores (measured:
single-digit sums with one-token answers; two-digit answers plateau, modular arithmetic never learns,
and mixing in subtraction and products kept GRPO at chance reward for 60 rollouts). Rows look exactly like the real sets: `{"prompt": [{"role": "user", "content": ...}],
"label": "7"}` (or a plain-string prompt), answers expected in `\\boxed{}`.

Train and eval are drawn from disjoint problem sets (op, a, b) so the contamination check passes
for the right reason, not because the phrasing differs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from kimi_pipeline.util.files import atomic_write_jsonl

DAPO_WRAPPER = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: \\boxed{{$Answer}} where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
SHORT_WRAPPER = "{problem} Answer in \\boxed{{}}."

TEMPLATES = {
    "+": ["What is {a}+{b}?", "Compute {a} + {b}.", "Find the sum of {a} and {b}.", "{a} plus {b} is?"],
    "-": ["What is {a}-{b}?", "Compute {a} - {b}.", "Subtract {b} from {a}.", "{a} minus {b} is?"],
    "*": ["What is {a}*{b}?", "Compute {a} * {b}.", "Find the product of {a} and {b}.", "{a} times {b} is?"],
}
APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class MathGenConfig:
    """Difficulty knobs: which operations, operand range, answer range, phrasing."""

    seed: int = 0
    ops: tuple[str, ...] = ("+",)  # measured: with -, * mixed in GRPO stays at chance for 60 rollouts
    max_operand: int = 9
    max_answer: int = 9  # answers 0..9 are single tokens for the tiny tokenizer
    min_answer: int = 0
    eval_fraction: float = 0.2
    templates_per_problem: int = 4
    wrapper: str = "short"  # "short" or "dapo" (the real DAPO-Math-17k user message)
    string_prompt_fraction_train: float = 0.0
    string_prompt_fraction_eval: float = 1.0


def _problems(cfg: MathGenConfig) -> list[tuple[str, int, int, int]]:
    out = []
    for op in cfg.ops:
        if op not in APPLY:
            raise ValueError(f"unknown operation {op!r}; choose from {sorted(APPLY)}")
        for a in range(cfg.max_operand + 1):
            for b in range(cfg.max_operand + 1):
                if op == "*" and (a == 0 or b == 0):
                    continue  # trivially 0; would dominate the small answer range
                ans = APPLY[op](a, b)
                if cfg.min_answer <= ans <= cfg.max_answer:
                    out.append((op, a, b, ans))
    return out


def _row(text: str, answer: int, as_string: bool, wrapper: str) -> dict:
    tmpl = DAPO_WRAPPER if wrapper == "dapo" else SHORT_WRAPPER
    content = tmpl.format(problem=text)
    prompt: str | list[dict] = content if as_string else [{"role": "user", "content": content}]
    return {"prompt": prompt, "label": str(answer)}


def generate(cfg: MathGenConfig = MathGenConfig()) -> tuple[list[dict], list[dict]]:
    """(train_rows, eval_rows), deterministic for a config."""
    rng = random.Random(cfg.seed)
    problems = _problems(cfg)
    rng.shuffle(problems)
    n_eval = max(1, int(len(problems) * cfg.eval_fraction))
    eval_set, train_set = problems[:n_eval], problems[n_eval:]
    train: list[dict] = []
    for op, a, b, ans in train_set:
        templates = TEMPLATES[op][: cfg.templates_per_problem]
        for t in templates:
            train.append(_row(t.format(a=a, b=b), ans, rng.random() < cfg.string_prompt_fraction_train, cfg.wrapper))
    rng.shuffle(train)
    evals = [
        _row(rng.choice(TEMPLATES[op]).format(a=a, b=b), ans, rng.random() < cfg.string_prompt_fraction_eval, cfg.wrapper)
        for op, a, b, ans in eval_set
    ]
    return train, evals


def write_tiny_datasets(out_dir: Path, cfg: MathGenConfig = MathGenConfig()) -> dict[str, Path]:
    train, evals = generate(cfg)
    out_dir = Path(out_dir)
    paths = {"train": out_dir / "dapo-math-tiny.jsonl", "eval": out_dir / "aime-tiny.jsonl"}
    atomic_write_jsonl(paths["train"], train)
    atomic_write_jsonl(paths["eval"], evals)
    return paths
