"""``rm_type: math`` (DAPO-style): the final ``\\boxed{X}``, or failing that a last line ``Answer: X``,
compared with the label by normalized string or exact numeric value (``\\frac{1}{2}`` = ``0.5``).

No symbolic engine: cheap and deterministic, enough for integer labels (DAPO-Math-17k, AIME), and a
run graded this way never starts a worker process.
"""

from __future__ import annotations

from kimi_pipeline.reward.extract import extract_answer
from kimi_pipeline.reward.graders.base import Verdict, plain_verdict


def grade(response: str, label: str, *, thinking: bool, strict: bool) -> Verdict:
    verdict = plain_verdict(extract_answer(response, "math", thinking, strict), label)
    return Verdict(0.0, "fast") if verdict.symbolic else verdict
