"""Where a response commits to its final answer, read so that a policy cannot fool or stall the parser.

0. The text graded (``decode_responses``): the sampled token ids decoded with the special tokens dropped
   (end-of-turn, padding) but ``<think>``/``</think>`` kept: Kimi's (and the tiny) tokenizer marks them special,
   and ``skip_special_tokens=True`` would delete the marker the answer region starts after.
1. The answer region: the text after the last ``</think>``. With ``deepscaler`` and no ``</think>``, the
   text after ``###Response`` (as upstream deepscaler splits). A ``thinking=True`` response with neither
   gets no answer (it never answered); ``thinking=False`` reads the whole response.
2. Only the last ``MAX_TAIL_CHARS`` characters of the region are searched (megabytes of text cost nothing).
3. Default (``strict=False``, the seeds' behaviour): the last ``\\boxed{…}`` of the region by brace
   matching, whatever follows it (``… \\boxed{5}. I hope this helps!`` counts). ``math`` falls back to a
   last line ``Answer: X`` when there is no box. ``strict=True`` (recipe ``rollout.reward_strict``) is an
   explicit, stricter option: the region must END with the boxed answer — after it only whitespace,
   end-of-turn special tokens (``<|im_end|>``, ``[EOS]``, ``</s>``), closing math delimiters
   (``$``, ``\\]``, ``\\)``) and at most ``MAX_TRAILER_CHARS`` of ``.,;!*``; braces are matched backwards
   from the end, so ``\\boxed{9}}}}`` gives no answer (a policy can learn to spam braces under a loose parser).
4. A boxed answer longer than ``MAX_ANSWER_CHARS`` is no answer, and is never parsed.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

from kimi_pipeline.reward.reward_errors import RewardError

RmType = Literal["math", "deepscaler"]  # the two ways of reading an answer (the built-in graders')
RM_TYPES: tuple[str, ...] = get_args(RmType)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
RESPONSE_MARK = "###Response"  # upstream deepscaler's split when there is no </think>
MAX_TAIL_CHARS = 4096
MAX_ANSWER_CHARS = 256
MAX_TRAILER_CHARS = 8
BOX_COMMANDS = ("\\boxed", "\\fbox")

_END_TOKEN = re.compile(r"(?:<\|[A-Za-z0-9_]{1,32}\|>|\[EOS\]|\[PAD\]|</s>)\Z")
_ANSWER_LINE = re.compile(r"\s*(?:\*\*)?answer\s*(?:\*\*)?\s*:\s*(?:\*\*)?\s*(.+?)\s*", re.IGNORECASE)


def decode_responses(tokenizer, sequences: list[list[int]]) -> list[str]:
    """Response texts for grading (item 0 above); `tokenizer` a transformers tokenizer."""
    kept = {tokenizer.convert_tokens_to_ids(t) for t in (THINK_OPEN, THINK_CLOSE)}
    kept.discard(getattr(tokenizer, "unk_token_id", None))
    kept.discard(None)
    special = set(tokenizer.all_special_ids)
    special.update(i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if tok.special)
    drop = special - kept
    return tokenizer.batch_decode([[i for i in seq if i not in drop] for seq in sequences], skip_special_tokens=False)


def _answer_region(response: str, thinking: bool, rm_type: str = "math") -> str | None:
    """The part of a response that may hold the final answer (None: a thinking model never answered)."""
    cut, mark = response.rfind(THINK_CLOSE), THINK_CLOSE
    if cut < 0 and rm_type == "deepscaler":
        cut, mark = response.rfind(RESPONSE_MARK), RESPONSE_MARK
    if cut < 0:
        return None if thinking else response[-MAX_TAIL_CHARS:]
    return response[cut + len(mark) :][-MAX_TAIL_CHARS:]


def _strip_end_tokens(s: str) -> str:
    while True:
        t = s.rstrip()
        m = _END_TOKEN.search(t[-40:])
        if m:
            t = t[: len(t) - len(m.group())]
        if t == s:
            return s
        s = t


def _strip_trailer(s: str) -> str | None:
    """Drop what may legitimately follow a final answer; None if too much punctuation follows."""
    s = s.rstrip()
    end, budget = len(s), MAX_TRAILER_CHARS
    while end > 0:
        c = s[end - 1]
        if c.isspace():
            end -= 1
            continue
        if c in ".,;!*$":
            step = 1
        elif c in "])" and end >= 2 and s[end - 2] == "\\":
            step = 2
        else:
            break
        budget -= 1
        if budget < 0:
            return None
        end -= step
    return s[:end]


def _escaped(s: str, i: int) -> bool:
    return i > 0 and s[i - 1] == "\\"


def _final_boxed(s: str) -> str | None:
    """Content of the ``\\boxed{…}`` that ends ``s``, by backward brace matching (strict)."""
    if not s.endswith("}") or _escaped(s, len(s) - 1):
        return None
    depth, i, lo = 0, len(s) - 1, max(0, len(s) - MAX_ANSWER_CHARS - 2)
    while i >= lo:
        c = s[i]
        if c in "{}" and not _escaped(s, i):
            depth += 1 if c == "}" else -1
            if depth == 0:
                break
        i -= 1
    else:
        return None  # unbalanced, or the answer is longer than MAX_ANSWER_CHARS
    before = s[max(0, i - 16) : i].rstrip()
    if not before.endswith(BOX_COMMANDS):
        return None
    return s[i + 1 : len(s) - 1]


def braced_after(s: str, j: int) -> tuple[str, int] | None:
    """(content, end index) of the ``{…}`` group opening at ``s[j]`` (after spaces), bounded in length."""
    while j < len(s) and s[j] == " ":
        j += 1
    if j >= len(s) or s[j] != "{":
        return None
    depth, k = 0, j
    stop = min(len(s), j + MAX_ANSWER_CHARS + 2)
    while k < stop:
        c = s[k]
        if c in "{}" and not _escaped(s, k):
            depth += 1 if c == "{" else -1
            if depth == 0:
                return s[j + 1 : k], k
        k += 1
    return None


def _last_boxed_anywhere(s: str) -> str | None:
    """Content of the last ``\\boxed{…}`` wherever it is (upstream deepscaler behaviour)."""
    start = max(s.rfind(cmd) for cmd in BOX_COMMANDS)
    if start < 0:
        return None
    group = braced_after(s, start + (len("\\boxed") if s.startswith("\\boxed", start) else len("\\fbox")))
    return group[0] if group else None


def extract_answer(
    response: str, rm_type: RmType = "math", thinking: bool = False, strict: bool = False
) -> str | None:
    """The final answer a response commits to (raw LaTeX), or None if it gives none we accept."""
    if rm_type not in RM_TYPES:
        raise RewardError(
            f"unknown rm_type {rm_type!r}: choose one of {', '.join(RM_TYPES)} (recipe field rollout.rm_type)"
        )
    region = _answer_region(response, thinking, rm_type)
    if region is None:
        return None
    body = _strip_end_tokens(region)
    if not strict:
        answer = _last_boxed_anywhere(body)
    else:
        body = _strip_trailer(body)
        if body is None:
            return None
        answer = _final_boxed(body)
    if answer is None and rm_type == "math":  # DAPO's plain "Answer: X" last line
        body = body.rstrip()
        last_line = body[body.rfind("\n") + 1 :]
        m = _ANSWER_LINE.fullmatch(last_line[-(MAX_ANSWER_CHARS + 32) :])
        answer = m.group(1).strip().strip("$").strip().rstrip(".").strip("$").strip() if m else None
    if answer is None or len(answer) > MAX_ANSWER_CHARS or not answer.strip():
        return None
    return answer
