"""``rm_type: deepscaler``: the final ``\\boxed{X}`` only (after ``</think>``, else after ``###Response``);
the same cheap checks as ``math``, then symbolic equality with math-verify (sympy) in the worker pool.

Forms that only ever explode in sympy (power towers, huge factorials) are refused here, without a worker.
"""

from __future__ import annotations

from kimi_pipeline.reward.extract import extract_answer
from kimi_pipeline.reward.graders.base import Verdict, plain_verdict
from kimi_pipeline.reward.normalize import too_risky


def grade(response: str, label: str, *, thinking: bool, strict: bool) -> Verdict:
    verdict = plain_verdict(extract_answer(response, "deepscaler", thinking, strict), label)
    if verdict.symbolic and too_risky(verdict.symbolic[1]):
        return Verdict(0.0, "rejected")
    return verdict
