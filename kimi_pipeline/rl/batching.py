"""Dynamic micro-batching: pack variable-length samples into token-budgeted micro-batches.

With ``parallel.use_dynamic_batch_size`` a micro-batch is not a fixed number of samples but any set
whose total tokens fit ``max_tokens_per_gpu``. Megatron runs the same number of micro-batches on
every data-parallel rank (pipeline schedules and expert all-to-alls are collective per
micro-batch), so the split fixes one count K for all ranks:

1. samples are spread over DP ranks balancing token totals (longest-processing-time greedy);
2. each rank's first-fit-decreasing bin count is computed; K = the largest;
3. each rank's samples are spread over exactly K micro-batches, again balancing tokens, as long as
   every micro-batch stays within the budget (else the first-fit-decreasing packing, split up).

A sample longer than the budget cannot be split here (that needs context parallelism or a larger
budget): it gets a micro-batch of its own, is listed in ``MicroBatches.oversized`` and logged. A rank with
fewer samples than K (tiny batches, huge samples) gets empty micro-batches, counted in
``MicroBatches.empty_micro_batches``: the trainer runs them as a padding-only step with zero loss weight.

Hand-written: a few dozen lines of greedy packing; the libraries that do it belong to trainers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


def first_fit_decreasing(
    lengths: Sequence[int], max_tokens: int, indices: Sequence[int] | None = None
) -> list[list[int]]:
    """Bins of sample indices with token sum <= max_tokens (an over-long sample sits alone)."""
    idx = list(range(len(lengths))) if indices is None else list(indices)
    idx.sort(key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in idx:
        n = lengths[i]
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return bins


def balanced_partition(lengths: Sequence[int], indices: Sequence[int], parts: int) -> list[list[int]]:
    """Greedy LPT: longest first into the lightest part (ties: fewer samples, then lower part)."""
    out: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        p = min(range(parts), key=lambda p: (loads[p], len(out[p]), p))
        out[p].append(i)
        loads[p] += lengths[i]
    return out


def _fits(bins: list[list[int]], lengths: Sequence[int], max_tokens: int) -> bool:
    return all(len(b) <= 1 or sum(lengths[i] for i in b) <= max_tokens for b in bins)


def _into_k_bins(lengths: Sequence[int], indices: list[int], k: int, max_tokens: int) -> list[list[int]]:
    bins = balanced_partition(lengths, indices, k)
    if _fits(bins, lengths, max_tokens):
        return [b for b in bins if b] + [[] for b in bins if not b]
    bins = first_fit_decreasing(lengths, max_tokens, indices)
    while len(bins) < k:  # split the heaviest splittable bin; splitting never breaks the budget
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            break
        big = max(splittable, key=lambda b: (sum(lengths[i] for i in b), -min(b)))
        bins.remove(big)
        bins.extend(balanced_partition(lengths, big, 2))
    return bins + [[] for _ in range(k - len(bins))]


@dataclass
class MicroBatches:
    """``ranks[r][m]`` = sample indices of micro-batch m on data-parallel rank r."""

    ranks: list[list[list[int]]]
    lengths: list[int]
    max_tokens: int
    oversized: list[int] = field(default_factory=list)

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    @property
    def num_micro_batches(self) -> int:
        return len(self.ranks[0])

    @property
    def empty_micro_batches(self) -> int:
        return sum(1 for rank in self.ranks for mb in rank if not mb)

    def tokens(self) -> list[list[int]]:
        return [[sum(self.lengths[i] for i in mb) for mb in rank] for rank in self.ranks]

    def rank_tokens(self) -> list[int]:
        return [sum(t) for t in self.tokens()]

    def summary(self) -> dict:
        toks = [t for rank in self.tokens() for t in rank]
        return {
            "dp_size": self.dp_size,
            "num_micro_batches": self.num_micro_batches,
            "samples": len(self.lengths),
            "tokens": sum(self.lengths),
            "max_micro_batch_tokens": max(toks, default=0),
            "min_micro_batch_tokens": min(toks, default=0),
            "rank_tokens": self.rank_tokens(),
            "oversized": len(self.oversized),
            "empty_micro_batches": self.empty_micro_batches,
        }


def split_micro_batches(lengths: Sequence[int], max_tokens_per_gpu: int, dp_size: int = 1) -> MicroBatches:
    """Pack samples (token lengths, prompt + response) into the same number of micro-batches per DP rank."""
    lengths = [int(n) for n in lengths]
    if max_tokens_per_gpu < 1:
        raise ValueError(
            f"max_tokens_per_gpu must be >= 1, got {max_tokens_per_gpu} (recipe field parallel.max_tokens_per_gpu)"
        )
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if any(n < 1 for n in lengths):
        raise ValueError("every sample needs at least one token")
    oversized = [i for i, n in enumerate(lengths) if n > max_tokens_per_gpu]
    if oversized:
        log.warning(
            "%d sample(s) exceed max_tokens_per_gpu=%d (longest %d tokens): each gets a micro-batch of its own; "
            "raise parallel.max_tokens_per_gpu or lower the response length if memory runs out",
            len(oversized), max_tokens_per_gpu, max(lengths[i] for i in oversized),
        )
    per_rank = balanced_partition(lengths, range(len(lengths)), dp_size)
    # A rank with fewer samples than the micro-batch count would need empty micro-batches: hand it
    # the smallest samples of ranks that have more than they need, while that is possible.
    for _ in range(4 * dp_size + len(lengths)):
        k = max(1, *(len(first_fit_decreasing(lengths, max_tokens_per_gpu, r)) for r in per_rank))
        short = [r for r in per_rank if len(r) < k]
        donors = [r for r in per_rank if len(r) > k]
        if not short or not donors:
            break
        donor = max(donors, key=len)
        smallest = min(donor, key=lambda i: (lengths[i], i))
        donor.remove(smallest)
        short[0].append(smallest)
    return MicroBatches(ranks=_pack_ranks(lengths, per_rank, max_tokens_per_gpu), lengths=lengths,
                          max_tokens=max_tokens_per_gpu, oversized=oversized)


def _pack_ranks(lengths: Sequence[int], per_rank: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """Each rank's samples into the same number K of token-budgeted micro-batches (K = the largest need)."""
    k = max(1, *(len(first_fit_decreasing(lengths, max_tokens, r)) for r in per_rank))
    ranks = [_into_k_bins(lengths, sorted(r), k, max_tokens) for r in per_rank]
    return [[sorted(mb) for mb in rank] for rank in ranks]


# --------------------------------------------------------------------------- a rollout over DP ranks and steps


def equal_size_partition(lengths: Sequence[int], indices: Sequence[int], parts: int) -> list[list[int]]:
    """LPT with equal sample counts (±1 when they do not divide): the seeds' `balance_data` split."""
    idx = list(indices)
    full, extra = divmod(len(idx), parts)
    out: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(idx, key=lambda i: (-lengths[i], i)):
        room = [p for p in range(parts) if len(out[p]) < full or (len(out[p]) == full and extra > 0)]
        p = min(room, key=lambda p: (loads[p], len(out[p]), p))
        extra -= len(out[p]) == full
        out[p].append(i)
        loads[p] += lengths[i]
    return [sorted(part) for part in out]


def step_batch_size(num_samples: int, global_batch_size: int, dp_size: int, dynamic: bool) -> int:
    """Samples per optimizer step: the recipe's, or with a dynamic global batch (dynamic sampling keeps a
    varying number) all samples rounded down to a multiple of DP in one step, as slime does."""
    return max(dp_size, num_samples // dp_size * dp_size) if dynamic else global_batch_size


@dataclass
class RolloutSplit:
    """``steps[k][r][m]`` = rollout sample indices of micro-batch m of DP rank r in optimizer step k.

    Every rank has the same number of micro-batches in a step (expert all-to-alls and pipeline schedules are
    collective per micro-batch); an empty one is run as zero-weight padding."""

    steps: list[list[list[list[int]]]]
    global_batch_size: int
    trimmed: list[int]  # samples left out (the tail past the last full global batch)

    def rank_steps(self, rank: int) -> list[list[list[int]]]:
        return [step[rank] for step in self.steps]

    def rank_samples(self, rank: int) -> list[int]:
        return [i for step in self.steps for mb in step[rank] for i in mb]


def split_rollout(lengths: Sequence[int], *, dp_size: int, balance: bool, global_batch_size: int | None = None,
                  num_steps: int | None = None, max_tokens_per_gpu: int | None = None) -> RolloutSplit:
    """A rollout's samples (token lengths) → optimizer steps → DP ranks → micro-batches, so each rank
    computes logprobs and gradients for its own samples only.

    Steps take consecutive slices: of `global_batch_size` samples (the tail past the last full batch is
    trimmed, as in slime; a rollout shorter than one batch trains one step on everything), or `num_steps`
    slices of ceil(n / num_steps) samples, whatever dynamic sampling kept (nothing trimmed). Within a step
    the samples go to DP ranks in equal counts balanced by tokens (`balance`, the seeds' balance_data) or
    strided; then into token-budgeted micro-batches (`max_tokens_per_gpu`, dynamic batch size) or one each."""
    lengths = [int(n) for n in lengths]
    if (global_batch_size is None) == (num_steps is None):
        raise ValueError("give exactly one of global_batch_size and num_steps")
    if (global_batch_size or num_steps or 0) < 1 or dp_size < 1:
        raise ValueError(f"global_batch_size/num_steps ({global_batch_size or num_steps}) and dp_size ({dp_size}) "
                         "must be >= 1")
    n = len(lengths)
    if global_batch_size is None:
        per = -(-n // num_steps)
        bounds = [(lo, min(n, lo + per)) for lo in range(0, n, per)]
        global_batch_size = per
    else:
        bounds = [(k * global_batch_size, (k + 1) * global_batch_size) for k in range(n // global_batch_size)]
        if not bounds:
            log.warning("rollout has %d samples, fewer than one global batch (%d): training one step on all of them",
                        n, global_batch_size)
            bounds = [(0, n)]
    steps = []
    for lo, hi in bounds:
        idx = list(range(lo, hi))
        per_rank = (equal_size_partition(lengths, idx, dp_size) if balance
                    else [idx[r::dp_size] for r in range(dp_size)])
        if max_tokens_per_gpu is not None:
            ranks = _pack_ranks(lengths, per_rank, max_tokens_per_gpu)
        else:
            k = max(1, *(len(r) for r in per_rank))
            ranks = [[[i] for i in r] + [[] for _ in range(k - len(r))] for r in per_rank]
        steps.append(ranks)
    return RolloutSplit(steps=steps, global_batch_size=global_batch_size, trimmed=list(range(bounds[-1][1], n)))
