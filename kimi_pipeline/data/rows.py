"""Row-level facts about DAPO/AIME-format rows: prompt shape, label parseability, normalization.

Kept separate from the pandera schema so the reward and rollout code reuse the same definitions.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

# math_verify warns on every call that we run it without its signal-based timeout (which only works
# in the main thread); labels are length-capped instead.
logging.getLogger("math_verify.parser").setLevel(logging.ERROR)

VALID_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_LABEL_CHARS = 256
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)(/\d+)?$")

DAPO_PREFIX = "Solve the following math problem step by step. The last line of your response should be of the form Answer: \\boxed{$Answer} where $Answer is the answer to the problem."
DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'


def prompt_problem(prompt: Any) -> str | None:
    """Why a prompt is invalid (None = valid): non-empty string, or non-empty chat list with valid roles."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "empty prompt"
    if isinstance(prompt, list):
        if not prompt:
            return "empty prompt (no messages)"
        for i, m in enumerate(prompt):
            if not isinstance(m, dict):
                return f"message {i} is not an object"
            role = m.get("role")
            if role not in VALID_ROLES:
                return f"message {i} has invalid role {role!r} (expected one of {sorted(VALID_ROLES)})"
            content = m.get("content")
            if not isinstance(content, str):
                return f"message {i} content is not a string"
        if not any(isinstance(m.get("content"), str) and m["content"].strip() for m in prompt):
            return "empty prompt (all messages empty)"
        if not any(m.get("role") == "user" for m in prompt):
            return "no user message"
        return None
    if prompt is None:
        return "missing prompt"
    return f"prompt is a {type(prompt).__name__}, expected a string or a list of messages"


@functools.lru_cache(maxsize=65536)
def label_problem(label: str) -> str | None:
    """Why a label is not a usable math answer (None = fine). Plain numbers skip the (slow) parser."""
    text = label.strip()
    if not text:
        return "empty label"
    if len(text) > MAX_LABEL_CHARS:
        return f"label longer than {MAX_LABEL_CHARS} characters"
    if _NUMBER.match(text.replace(",", "")):
        return None
    if text.count("{") != text.count("}"):
        return "label has unbalanced braces"
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    try:
        parsed = parse(
            f"${text}$", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None
        )
    except Exception as e:  # the parser's own failure is a property of the label, not a crash
        return f"label does not parse as math ({type(e).__name__})"
    if not parsed or isinstance(parsed[0], str):
        return "label does not parse as a math answer"
    return None


def label_value_problem(label: Any) -> str | None:
    if label is None:
        return "missing label"
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        return f"label is a {type(label).__name__}, expected a string"
    return label_problem(str(label))


def prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(m.get("content", "") for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str))


# sentence punctuation only: math symbols (+ - * / ^ = ( ) …) carry meaning
_PUNCT = str.maketrans("", "", ".,?!;:\"'`")


def normalize_problem(prompt: Any) -> str:
    """Normalized problem text for duplicate/contamination checks: the DAPO wrapper, case, sentence
    punctuation and whitespace removed, so the same problem matches across differently formatted copies."""
    text = prompt_text(prompt)
    text = text.replace(DAPO_PREFIX, " ").replace(DAPO_SUFFIX, " ")
    return "".join(text.lower().translate(_PUNCT).split())


_NUMBERS_IN_TEXT = re.compile(r"\d+(?:\.\d+)?")
MIN_SIGNATURE_NUMBERS = 2  # fewer numbers say too little about a problem to call two problems equivalent


def problem_signature(prompt: Any, label: Any) -> tuple | None:
    """An order- and wording-free key for "the same problem": the multiset of numbers in the problem text
    (wrapper removed) plus the normalized answer. "What is 2+3?" and "Find the sum of 3 and 2." share one;
    problems with fewer than two numbers get None (text identity is all that can be said of them)."""
    text = prompt_text(prompt).replace(DAPO_PREFIX, " ").replace(DAPO_SUFFIX, " ")
    numbers = sorted(float(n) for n in _NUMBERS_IN_TEXT.findall(text))
    if len(numbers) < MIN_SIGNATURE_NUMBERS:
        return None
    return (tuple(numbers), "".join(str(label).split()).lower())


def as_messages(prompt: Any) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
