"""AIME-style evaluation metrics over n sampled responses per problem.

* avg@n: mean correctness over all samples (per problem, then over problems) = unbiased pass@1.
* pass@k: the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021), in the product form
  1 - prod_{i=n-c+1..n} (1 - k/i), which never forms huge binomials.
* maj@n: majority vote over the extracted final answers (equal values collide: ``0.5`` and
  ``\\frac{1}{2}`` are one answer). Samples without an answer do not vote. Ties go to the answer
  that appeared FIRST in sample order, deterministic for a fixed sampling order. The problem counts
  as solved if the first sample giving the winning answer was graded correct.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from kimi_pipeline.reward import answer_key


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples (drawn without replacement from n, c correct) is correct."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_vote(
    answers: Sequence[str | None], key: Callable[[str | None], str | None] = answer_key
) -> tuple[int | None, int]:
    """(index of the first sample carrying the winning answer, its vote count); (None, 0) if no sample answered."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, a in enumerate(answers):
        k = key(a)
        if k is None:
            continue
        counts[k] = counts.get(k, 0) + 1
        first.setdefault(k, i)
    if not counts:
        return None, 0
    winner = min(counts, key=lambda k: (-counts[k], first[k]))
    return first[winner], counts[winner]


def length_stats(
    lengths: Sequence[int], correct: Sequence[bool] | None = None, max_len: int | None = None
) -> dict[str, float]:
    """Response-length statistics (tokens): mean/std/min/p50/p90/max, by correctness, truncation rate."""
    if len(lengths) == 0:
        return {}
    x = np.asarray(lengths, dtype=np.float64)
    out = {
        "mean": float(x.mean()),
        "std": float(x.std()),
        "min": float(x.min()),
        "p50": float(np.percentile(x, 50)),
        "p90": float(np.percentile(x, 90)),
        "max": float(x.max()),
    }
    if correct is not None:
        ok = np.asarray(correct, dtype=bool)
        if ok.shape != x.shape:
            raise ValueError(f"{len(lengths)} lengths but {len(correct)} correctness values")
        out["mean_correct"] = float(x[ok].mean()) if ok.any() else float("nan")
        out["mean_incorrect"] = float(x[~ok].mean()) if (~ok).any() else float("nan")
    if max_len is not None:
        out["truncated_fraction"] = float((x >= max_len).mean())
    return out


@dataclass
class ProblemRow:
    index: int
    n: int
    correct: int
    avg: float
    pass_at: dict[int, float]
    label: str | None = None
    maj_answer: str | None = None
    maj_votes: int = 0
    maj_correct: bool = False
    mean_length: float | None = None
    prompt: str | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update({f"pass@{k}": v for k, v in d.pop("pass_at").items()})
        return d


@dataclass
class EvalSummary:
    n: int
    num_problems: int
    avg_at_n: float
    pass_at: dict[int, float]
    maj_at_n: float | None
    lengths: dict[str, float] = field(default_factory=dict)
    rows: list[ProblemRow] = field(default_factory=list)

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """Flat scalars for logging, e.g. ``{prefix}avg@16``, ``{prefix}pass@1``, ``{prefix}maj@16``."""
        m = {f"{prefix}avg@{self.n}": self.avg_at_n}
        m.update({f"{prefix}pass@{k}": v for k, v in self.pass_at.items()})
        if self.maj_at_n is not None:
            m[f"{prefix}maj@{self.n}"] = self.maj_at_n
        m.update({f"{prefix}response_len/{k}": v for k, v in self.lengths.items()})
        return m


def summarize(
    correct: Sequence[Sequence[float | bool]],
    answers: Sequence[Sequence[str | None]] | None = None,
    lengths: Sequence[Sequence[int]] | None = None,
    labels: Sequence[str] | None = None,
    ks: Sequence[int] | None = None,
    max_response_len: int | None = None,
    prompts: Sequence[str] | None = None,
) -> EvalSummary:
    """Metrics for P problems x n samples. ``correct[p][j]`` is 0/1 (a reward > 0.5 counts as correct),
    ``answers[p][j]`` the extracted answer (None if none) for maj@n, ``lengths[p][j]`` response tokens.
    ``ks`` defaults to {1, n}; every problem must have the same n."""
    if not correct:
        raise ValueError("no problems to evaluate")
    n = len(correct[0])
    if n < 1 or any(len(c) != n for c in correct):
        raise ValueError(f"every problem needs the same number of samples (first has {n})")
    for name, seq in (("answers", answers), ("lengths", lengths), ("labels", labels), ("prompts", prompts)):
        if seq is not None and len(seq) != len(correct):
            raise ValueError(f"{name} covers {len(seq)} problems, correctness covers {len(correct)}")
    ks = sorted(set(ks) if ks else {1, n})
    if any(not 1 <= k <= n for k in ks):
        raise ValueError(f"pass@k needs 1 <= k <= n={n}, got ks={ks}")

    rows: list[ProblemRow] = []
    for p, cs in enumerate(correct):
        ok = [float(c) > 0.5 for c in cs]
        c = sum(ok)
        row = ProblemRow(
            index=p,
            n=n,
            correct=c,
            avg=c / n,
            pass_at={k: pass_at_k(n, c, k) for k in ks},
            label=None if labels is None else str(labels[p]),
            prompt=None if prompts is None else prompts[p],
        )
        if answers is not None:
            if len(answers[p]) != n:
                raise ValueError(f"problem {p}: {len(answers[p])} answers for {n} samples")
            idx, votes = majority_vote(answers[p])
            if idx is not None:
                row.maj_answer, row.maj_votes, row.maj_correct = answers[p][idx], votes, ok[idx]
        if lengths is not None:
            if len(lengths[p]) != n:
                raise ValueError(f"problem {p}: {len(lengths[p])} lengths for {n} samples")
            row.mean_length = float(np.mean(lengths[p]))
        rows.append(row)

    flat_ok = [float(c) > 0.5 for cs in correct for c in cs]
    return EvalSummary(
        n=n,
        num_problems=len(rows),
        avg_at_n=float(np.mean([r.avg for r in rows])),
        pass_at={k: float(np.mean([r.pass_at[k] for r in rows])) for k in ks},
        maj_at_n=None if answers is None else float(np.mean([r.maj_correct for r in rows])),
        lengths={} if lengths is None else length_stats([x for ls in lengths for x in ls], flat_ok, max_response_len),
        rows=rows,
    )
