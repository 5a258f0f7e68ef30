"""The batch API: grade responses against labels with the `rm_type`'s grader, the symbolic pool behind it."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from typing import Sequence

from kimi_pipeline.reward.extract import RmType, extract_answer
from kimi_pipeline.reward.graders import Verdict, grader_for
from kimi_pipeline.reward.pool import DEFAULT_MEMORY_MB, DEFAULT_TIMEOUT_S, SymbolicPool
from kimi_pipeline.reward.reward_errors import RewardError

log = logging.getLogger(__name__)


@dataclass
class RewardStats:
    """How a batch was graded; `timeouts` and `errors` should stay near 0 (log them)."""

    n: int = 0
    correct: int = 0
    no_answer: int = 0  # nothing acceptable to grade (no boxed answer, unclosed thinking, too long)
    fast: int = 0  # decided by normalized string match
    numeric: int = 0  # decided by exact numeric value
    rejected: int = 0  # symbolic check refused (power tower, huge factorial)
    symbolic: int = 0  # sent to a worker
    timeouts: int = 0
    errors: int = 0

    def add(self, other: RewardStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class AnswerGrader:
    """Rule-based grader of answers against labels (no learned reward model).

    ``AnswerGrader("deepscaler", thinking=True).score(responses, labels)``; `rm_type` names a built-in
    grader or a function path ``package.module:function``. The worker pool starts lazily on the first
    answer that needs symbolic checking, so a run whose answers are all plain numbers never starts a
    process. Close it (or use ``with``) when done.
    """

    def __init__(
        self,
        rm_type: str = "math",
        thinking: bool = False,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        workers: int = 2,
        strict: bool = False,
        memory_mb: int = DEFAULT_MEMORY_MB,
    ):
        self._grade = grader_for(rm_type)
        if timeout_s <= 0:
            raise RewardError(f"reward timeout_s must be > 0, got {timeout_s}")
        self.rm_type, self.thinking, self.strict = rm_type, thinking, strict
        # answers() for majority voting: a custom grader's responses are read the default (math) way
        self._answer_style: RmType = "deepscaler" if rm_type == "deepscaler" else "math"
        self.timeout_s, self.workers, self.memory_mb = timeout_s, workers, memory_mb
        self._pool: SymbolicPool | None = None
        self.last_stats = RewardStats()
        self.totals = RewardStats()

    def score(self, responses: Sequence[str], labels: Sequence[str]) -> list[float]:
        if len(responses) != len(labels):
            raise ValueError(f"{len(responses)} responses but {len(labels)} labels")
        stats = RewardStats(n=len(responses))
        rewards: list[float] = []
        pending: list[tuple[int, tuple[str, str]]] = []
        for i, (resp, label) in enumerate(zip(responses, labels)):
            v = self._grade(resp, label, thinking=self.thinking, strict=self.strict)
            if not isinstance(v, Verdict):
                raise RewardError(
                    f"grader {self.rm_type!r} (rollout.rm_type) returned {type(v).__name__}, not a Verdict"
                )
            setattr(stats, v.via, getattr(stats, v.via) + 1)
            rewards.append(v.reward)
            if v.symbolic is not None:
                pending.append((i, v.symbolic))
        if pending:
            if self._pool is None:
                self._pool = SymbolicPool(self.workers, self.memory_mb)
            for (i, _), outcome in zip(pending, self._pool.compare([p for _, p in pending], self.timeout_s)):
                rewards[i] = 1.0 if outcome == "equal" else 0.0
                stats.timeouts += outcome == "timeout"
                stats.errors += outcome == "error"
        stats.correct = int(sum(rewards))
        if stats.timeouts or stats.errors:
            log.warning(
                "reward: %d symbolic timeouts, %d errors in a batch of %d", stats.timeouts, stats.errors, stats.n
            )
        self.last_stats = stats
        self.totals.add(stats)
        return rewards

    def answers(self, responses: Sequence[str]) -> list[str | None]:
        """The extracted final answers (for majority voting in eval)."""
        return [extract_answer(r, self._answer_style, self.thinking, self.strict) for r in responses]

    def worker_pids(self) -> list[int]:
        """Process ids of this grader's symbolic workers; empty until an answer first needs sympy (and after
        close). How a caller checks that a batch of plain numbers, or of refused forms, started no process."""
        return self._pool.pids() if self._pool is not None else []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> AnswerGrader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
