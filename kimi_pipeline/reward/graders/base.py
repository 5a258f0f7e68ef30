"""What a grader returns, the signature every grader has, and the checks the built-in graders share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from kimi_pipeline.reward.normalize import as_number, normalize_answer, too_risky

Via = Literal["no_answer", "fast", "numeric", "rejected", "symbolic"]  # the RewardStats counter a grade adds to


@dataclass(frozen=True)
class Verdict:
    """One response's grade: decided in-process (`reward`), or a normalized (gold, pred) pair in `symbolic`
    left to the worker pool, whose outcome then decides it (1.0 if equal)."""

    reward: float
    via: Via
    symbolic: tuple[str, str] | None = None

    @classmethod
    def pending(cls, gold: str, pred: str) -> Verdict:
        return cls(0.0, "symbolic", (gold, pred))


class Grader(Protocol):
    """A grading function: a built-in, or the user's `package.module:function` named by `rollout.rm_type`."""

    def __call__(self, response: str, label: str, *, thinking: bool, strict: bool) -> Verdict: ...


def plain_verdict(pred: str | None, label: str) -> Verdict:
    """The cheap checks: no answer, normalized string match, exact numeric value. What they cannot decide
    comes back pending with the normalized pair; each grader decides whether to send it on."""
    if pred is None:
        return Verdict(0.0, "no_answer")
    p, g = normalize_answer(pred), normalize_answer(str(label))
    if not p or not g:
        return Verdict(0.0, "no_answer")
    if p == g:
        return Verdict(1.0, "fast")
    pv, gv = as_number(p), as_number(g)
    if pv is not None and gv is not None:
        return Verdict(1.0 if pv == gv else 0.0, "numeric")
    return Verdict.pending(g, p)


def symbolic_unless_risky(verdict: Verdict) -> Verdict:
    """`verdict` as it stands, except that a pending pair whose prediction only ever explodes in sympy
    (power tower, huge factorial) is refused here, 0 without a worker: the time limit would catch it
    too, but each one costs a full timeout and a worker restart. What stays pending goes to the pool."""
    if verdict.symbolic is not None and too_risky(verdict.symbolic[1]):
        return Verdict(0.0, "rejected")
    return verdict
