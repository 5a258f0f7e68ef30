"""Periodic evaluation during training, like torchtitan's validator: `should_evaluate` says when, `evaluate`
scores the engines' current weights. The scoring itself is injected (the eval package's `run_eval_step`, or
the Prefect layer's retried eval task), so rl does not depend on eval."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

EvalFn = Callable[[int, list[str]], dict[str, Any]]  # (step, engine URLs) -> the eval row


class PeriodicEval:
    def __init__(self, evaluate: EvalFn, interval: int, total: int) -> None:
        self._evaluate, self.interval, self.total = evaluate, interval, total

    def should_evaluate(self, done: int) -> bool:
        """After every `eval.interval` steps and at the end (the loop also scores the base policy, step 0, of a
        fresh run)."""
        return done % self.interval == 0 or done == self.total

    def evaluate(self, step: int, urls: list[str]) -> dict[str, Any]:
        return self._evaluate(step, urls)
