"""Rule-based math rewards (0/1) that a policy cannot hang, crash or fool with a sloppy answer.

* ``extract``: the text graded (``decode_responses``: token ids → text, ``</think>`` kept) and where a response
  commits to its final answer (answer region, ``\\boxed{…}``, ``Answer:``).
* ``normalize``: canonical answer strings, exact numbers, majority-vote keys, forms too risky for sympy.
* ``graders``: one grading function per recipe ``rollout.rm_type`` (``math``, ``deepscaler``), or the
  user's ``package.module:function``; each returns a ``Verdict``.
* ``pool``: symbolic comparisons in killable worker processes (``python -m kimi_pipeline.reward --worker``).
* ``answer_grader``: ``AnswerGrader``, the batch API the trainer and eval use, and its ``RewardStats``.
"""

from kimi_pipeline.reward.answer_grader import AnswerGrader, RewardStats
from kimi_pipeline.reward.extract import MAX_ANSWER_CHARS, decode_responses, extract_answer
from kimi_pipeline.reward.graders import Verdict, grader_for
from kimi_pipeline.reward.normalize import answer_key, as_number, normalize_answer
from kimi_pipeline.reward.pool import SymbolicPool
from kimi_pipeline.reward.reward_errors import RewardError

__all__ = [
    "MAX_ANSWER_CHARS",
    "AnswerGrader",
    "RewardError",
    "RewardStats",
    "SymbolicPool",
    "Verdict",
    "answer_key",
    "as_number",
    "decode_responses",
    "extract_answer",
    "grader_for",
    "normalize_answer",
]
