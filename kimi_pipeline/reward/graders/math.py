"""``rm_type: math``, as the recipes' framework (slime/miles) means it: the final ``\\boxed{X}``, or failing
that DAPO's last line ``Answer: X``, equal to the label by normalized string, exact numeric value
(``\\frac{1}{2}`` = ``0.5``) or symbolic equality with math-verify (sympy) in the worker pool
(``x+1`` = ``1+x``, ``\\sqrt{4}`` = ``2``), as slime's ``grade_answer_verl`` does.

The cheap checks decide first, so a batch whose answers and labels are all plain numbers (DAPO-Math-17k,
AIME) never starts a worker process; forms that only ever explode in sympy are refused without one.
"""

from __future__ import annotations

from kimi_pipeline.reward.extract import extract_answer
from kimi_pipeline.reward.graders.base import Verdict, plain_verdict, symbolic_unless_risky


def grade(response: str, label: str, *, thinking: bool, strict: bool) -> Verdict:
    return symbolic_unless_risky(plain_verdict(extract_answer(response, "math", thinking, strict), label))
