"""``rm_type: deepscaler``: the final ``\\boxed{X}`` only (after ``</think>``, else after ``###Response``; no
``Answer: X`` line), graded as ``math`` grades: the cheap checks, then symbolic equality with math-verify
(sympy) in the worker pool. Only where the answer is read differs.

Forms that only ever explode in sympy (power towers, huge factorials) are refused here, without a worker.
"""

from __future__ import annotations

from kimi_pipeline.reward.extract import extract_answer
from kimi_pipeline.reward.graders.base import Verdict, plain_verdict, symbolic_unless_risky


def grade(response: str, label: str, *, thinking: bool, strict: bool) -> Verdict:
    return symbolic_unless_risky(plain_verdict(extract_answer(response, "deepscaler", thinking, strict), label))
